import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from accounts.models import APIKey, Organization
from accounts.services import do_create_invite
from tests.factories import UserFactory, api_key, organization_with_owner

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


def test_staff_who_may_only_view_keys_cannot_revoke_or_delete_them(org: Organization) -> None:
    key, _ = api_key(org)
    viewer = UserFactory(is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_apikey"))
    client = Client()
    client.force_login(viewer)

    listed = client.get("/admin/accounts/apikey/")
    revoked = client.post("/admin/accounts/apikey/", {
        "action": "revoke", "_selected_action": [str(key.id)]})
    deleted = client.post("/admin/accounts/apikey/", {
        "action": "delete_selected", "_selected_action": [str(key.id)], "post": "yes"})

    assert listed.status_code == 200 and b'value="revoke"' not in listed.content
    assert revoked.status_code == 200 and deleted.status_code == 200  # "no action selected"
    key.refresh_from_db()
    assert key.revoked_at is None
    superuser = Client()
    superuser.force_login(UserFactory(is_staff=True, is_superuser=True))
    assert b"delete_selected" not in superuser.get("/admin/accounts/apikey/").content
    assert superuser.post(f"/admin/accounts/apikey/{key.id}/delete/").status_code == 403
    assert APIKey.objects.filter(id=key.id).exists()


def test_an_operator_still_deletes_an_organisation_with_its_keys(operator: Client) -> None:
    gone = organization_with_owner("Gone")
    api_key(gone)

    confirmed = operator.post(f"/admin/accounts/organization/{gone.id}/delete/", {"post": "yes"})

    assert confirmed.status_code == 302
    assert not Organization.objects.filter(id=gone.id).exists()
    assert not APIKey.objects.filter(organization_id=gone.id).exists()
