import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from accounts.models import APIKey, Membership, Role, User
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db


def test_it_signs_up_and_lands_on_the_dashboard(client: Client) -> None:
    response = client.post("/signup/", {"email": "grace@example.com", "password": PASSWORD,
                                        "organization_name": "Compilers"}, follow=True)

    assert response.status_code == 200
    assert b"Compilers" in response.content
    assert Membership.objects.get(user__email="grace@example.com").role == Role.OWNER


def test_it_shows_field_errors_and_writes_nothing(client: Client) -> None:
    response = client.post("/signup/", {"email": "nope", "password": "short"})

    assert response.status_code == 400
    assert b"valid email" in response.content
    assert b"too short" in response.content
    assert not get_user_model().objects.exists()


def test_sign_in_sign_out_and_change_password(client: Client) -> None:
    user = UserFactory(email="lin@example.com")

    assert client.post("/login/", {"username": "lin@example.com", "password": PASSWORD}
                       ).status_code == 302
    assert client.get("/").status_code == 200
    changed = client.post("/password/", {"old_password": PASSWORD,
                                         "new_password1": "a much better passphrase",
                                         "new_password2": "a much better passphrase"})
    assert changed.status_code == 302
    user.refresh_from_db()
    assert user.check_password("a much better passphrase")
    assert user.password.startswith("argon2$")
    client.post("/logout/")
    assert client.get("/").status_code == 302


def test_failed_logins_lock_the_account(client: Client, settings: object) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    UserFactory(email="target@example.com")
    for _ in range(3):
        client.post("/login/", {"username": "target@example.com", "password": "wrong guess"})

    locked = client.post("/login/", {"username": "target@example.com", "password": PASSWORD})

    assert locked.status_code == 429
    assert b"Too many failed sign-in attempts" in locked.content


def test_failed_logins_lock_the_address_across_accounts(settings: object) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    UserFactory(email="innocent@example.com")
    client = Client(REMOTE_ADDR="203.0.113.9")
    for n in range(3):
        client.post("/login/", {"username": f"guess{n}@example.com", "password": "wrong guess"})

    locked = client.post("/login/", {"username": "innocent@example.com", "password": PASSWORD})
    elsewhere = Client(REMOTE_ADDR="198.51.100.7").post(
        "/login/", {"username": "innocent@example.com", "password": PASSWORD})

    assert locked.status_code == 429
    assert elsewhere.status_code == 302


def test_a_new_key_is_shown_once_in_the_dashboard(client: Client, owner: User, org: object) -> None:
    client.force_login(owner)

    created = client.post(f"/orgs/{org.slug}/keys/", {"name": "laptop", "scope": "inference"})
    later = client.get(f"/orgs/{org.slug}/")

    key = APIKey.objects.get()
    secret = created.context["created"]["secret"]
    assert secret.encode() in created.content
    assert secret.encode() not in later.content
    assert key.masked.encode() in later.content


def test_an_invite_link_from_the_dashboard_adds_a_member(client: Client, owner: User,
                                                          org: object) -> None:
    client.force_login(owner)
    url = client.post(f"/orgs/{org.slug}/invites/", {"role": "member"}).context["created"][
        "invite_url"]
    path = url.split("127.0.0.1:8000", 1)[-1] if "://" in url else url
    path = "/" + path.split("/", 3)[-1] if path.startswith("http") else path
    invitee = Client()
    invitee.force_login(UserFactory(email="joiner@example.com"))

    assert invitee.get(path).status_code == 200
    assert invitee.post(path).status_code == 302
    assert invitee.get(path).status_code == 404
    assert Membership.objects.get(user__email="joiner@example.com").organization == org


def test_another_organisations_dashboard_is_not_found(client: Client, other_org: object) -> None:
    client.force_login(UserFactory())

    assert client.get(f"/orgs/{other_org.slug}/").status_code == 404
    assert client.post(f"/orgs/{other_org.slug}/keys/", {"name": "x", "scope": "manage"}
                       ).status_code == 404
    assert not APIKey.objects.exists()
