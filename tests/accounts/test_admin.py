import pytest
from django.test import Client

from accounts.models import Organization
from accounts.services import do_create_invite
from tests.factories import UserFactory, api_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client: Client) -> Client:
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


def test_the_console_never_shows_a_key_secret_or_digest(operator: Client,
                                                        org: Organization) -> None:
    key, secret = api_key(org)

    pages = [operator.get("/admin/accounts/apikey/"),
             operator.get(f"/admin/accounts/apikey/{key.id}/change/")]

    for page in pages:
        assert page.status_code == 200
        assert secret.encode() not in page.content
        assert key.digest.encode() not in page.content
    assert key.masked.encode() in pages[0].content


def test_the_console_never_shows_an_invite_token(operator: Client, org: Organization,
                                                 owner: object) -> None:
    invite, token = do_create_invite(organization=org, actor_role="owner", created_by=owner)

    page = operator.get(f"/admin/accounts/invite/{invite.id}/change/")

    assert page.status_code == 200
    assert token.encode() not in page.content
    assert invite.token_digest.encode() not in page.content


def test_an_operator_revokes_keys(operator: Client, org: Organization) -> None:
    key, _ = api_key(org)

    response = operator.post("/admin/accounts/apikey/", {
        "action": "revoke", "_selected_action": [str(key.id)]})

    assert response.status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_the_console_lists_people_and_organisations(operator: Client, org: Organization) -> None:
    assert b"Acme" in operator.get("/admin/accounts/organization/").content
    assert b"owner@acme.test" in operator.get("/admin/accounts/user/").content
