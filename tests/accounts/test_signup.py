import pytest
from rest_framework.test import APIClient

from accounts.models import Membership, Organization, Role, User

pytestmark = pytest.mark.django_db

URL = "/api/v1/signup/"


def test_it_creates_a_user_and_an_owned_organisation(api: APIClient) -> None:
    response = api.post(URL, {"email": "Ada@Example.com", "password": "analytical engine 1843",
                              "organization_name": "Engines Ltd"}, format="json")

    assert response.status_code == 201, response.content
    assert response.json()["organization"]["slug"] == "engines-ltd"
    user = User.objects.get()
    assert user.email == "ada@example.com"
    assert user.password.startswith("argon2$")
    membership = Membership.objects.get(user=user)
    assert membership.role == Role.OWNER
    assert membership.organization.name == "Engines Ltd"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"email": "", "password": "analytical engine 1843"}, "email"),
        ({"email": "not-an-email", "password": "analytical engine 1843"}, "email"),
        ({"email": "ada@example.com", "password": "short"}, "password"),
        ({"email": "ada@example.com", "password": "password123"}, "password"),
        ({"email": "ada@example.com", "password": "1234567890123"}, "password"),
        ({"password": "analytical engine 1843"}, "email"),
    ],
)
def test_it_refuses_bad_input_and_writes_nothing(api: APIClient, body: dict, field: str) -> None:
    response = api.post(URL, body, format="json")

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["fields"][field]
    assert field in error["message"]
    assert not User.objects.exists()
    assert not Organization.objects.exists()


def test_it_refuses_a_duplicate_signup_whatever_the_case(api: APIClient) -> None:
    body = {"email": "ada@example.com", "password": "analytical engine 1843"}
    assert api.post(URL, body, format="json").status_code == 201

    response = api.post(URL, {**body, "email": "ADA@example.com"}, format="json")

    assert response.status_code == 400
    assert "already exists" in response.json()["error"]["fields"]["email"][0]
    assert User.objects.count() == 1
    assert Organization.objects.count() == 1


def test_it_refuses_unknown_fields(api: APIClient) -> None:
    response = api.post(URL, {"email": "ada@example.com", "password": "analytical engine 1843",
                              "is_staff": True}, format="json")

    assert response.status_code == 400
    assert response.json()["error"]["fields"]["is_staff"] == [
        "Unknown field; remove it from the request."
    ]
    assert not User.objects.exists()


def test_it_refuses_malformed_json(api: APIClient) -> None:
    response = api.generic("POST", URL, '{"email": "ada@example.com", ',
                           content_type="application/json")

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "malformed_request"
    assert "JSON" in error["message"]
    assert not User.objects.exists()


def test_it_refuses_an_oversized_body_with_413(api: APIClient, settings: object) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    body = '{"email": "ada@example.com", "password": "' + "x" * 2048 + '"}'

    response = api.generic("POST", URL, body, content_type="application/json")

    assert response.status_code == 413
    assert "1024 bytes" in response.json()["error"]["message"]
    assert not User.objects.exists()


def test_slugs_stay_unique_for_equal_names(api: APIClient) -> None:
    for email in ("a@example.com", "b@example.com"):
        api.post(URL, {"email": email, "password": "analytical engine 1843",
                       "organization_name": "Same Name"}, format="json")

    slugs = sorted(Organization.objects.values_list("slug", flat=True))
    assert slugs[0] == "same-name"
    assert slugs[1].startswith("same-name-") and len(set(slugs)) == 2


def test_a_new_x_forwarded_for_per_request_does_not_escape_the_throttle(api: APIClient) -> None:
    answers = [api.post(URL, {}, format="json", REMOTE_ADDR="203.0.113.9",
                        HTTP_X_FORWARDED_FOR=f"10.0.0.{n}").status_code for n in range(21)]

    assert answers == [400] * 20 + [429]
    assert not User.objects.exists()


def test_behind_trusted_proxies_each_client_has_its_own_allowance(api: APIClient,
                                                                  settings: object) -> None:
    settings.KVRUN_TRUSTED_PROXIES = 1
    proxy = {"REMOTE_ADDR": "10.1.1.1"}
    for n in range(20):  # what the client writes further left proves nothing
        api.post(URL, {}, format="json", HTTP_X_FORWARDED_FOR=f"192.0.2.{n}, 203.0.113.9",
                 **proxy)

    spent = api.post(URL, {}, format="json", HTTP_X_FORWARDED_FOR="203.0.113.9", **proxy)
    other = api.post(URL, {}, format="json", HTTP_X_FORWARDED_FOR="198.51.100.7", **proxy)

    assert spent.status_code == 429
    assert other.status_code == 400
