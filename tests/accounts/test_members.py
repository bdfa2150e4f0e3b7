import logging

import pytest
from django.test import Client
from rest_framework.test import APIClient

from accounts.models import Invite, Membership, Organization, Role, User
from tests.factories import UserFactory, organization_with_owner

pytestmark = pytest.mark.django_db


def members_url(org: Organization) -> str:
    return f"/api/v1/organizations/{org.slug}/members/"


def invites_url(org: Organization) -> str:
    return f"/api/v1/organizations/{org.slug}/invites/"


def join(org: Organization, role: str = Role.MEMBER) -> User:
    user = UserFactory()
    Membership.objects.create(organization=org, user=user, role=role)
    return user


def test_an_invite_link_works_once(owner_api: APIClient, org: Organization) -> None:
    response = owner_api.post(invites_url(org), {"role": "admin"}, format="json")
    assert "no-store" in response["Cache-Control"]  # no cache may keep the token
    created = response.json()
    assert created["url"].endswith(f"/invite/{created['token']}/")
    invitee, second = APIClient(), APIClient()
    invitee.force_authenticate(UserFactory(email="new@acme.test"))
    second.force_authenticate(UserFactory(email="late@acme.test"))

    first = invitee.post("/api/v1/invites/accept/", {"token": created["token"]}, format="json")
    again = second.post("/api/v1/invites/accept/", {"token": created["token"]}, format="json")

    assert first.status_code == 201
    assert again.status_code == 400
    assert "ask for a new one" in again.json()["error"]["message"]
    assert Membership.objects.get(organization=org, user__email="new@acme.test").role == Role.ADMIN
    assert not Membership.objects.filter(user__email="late@acme.test").exists()
    assert Invite.objects.get().accepted_by.email == "new@acme.test"


def test_the_invite_token_is_not_stored(owner_api: APIClient, org: Organization) -> None:
    token = owner_api.post(invites_url(org), {}, format="json").json()["token"]

    invite = Invite.objects.get()
    assert token not in str(invite.__dict__)


def test_a_revoked_invite_cannot_be_used(owner_api: APIClient, org: Organization) -> None:
    created = owner_api.post(invites_url(org), {}, format="json").json()
    assert owner_api.delete(f"{invites_url(org)}{created['id']}/").status_code == 204
    invitee = APIClient()
    invitee.force_authenticate(UserFactory())

    response = invitee.post("/api/v1/invites/accept/", {"token": created["token"]}, format="json")

    assert response.status_code == 400
    assert Membership.objects.filter(organization=org).count() == 1


def test_only_owners_invite_owners(api: APIClient, org: Organization) -> None:
    api.force_authenticate(join(org, Role.ADMIN))

    response = api.post(invites_url(org), {"role": "owner"}, format="json")

    assert response.status_code == 403
    assert not Invite.objects.exists()


def test_members_cannot_invite(api: APIClient, org: Organization) -> None:
    api.force_authenticate(join(org))

    assert api.post(invites_url(org), {}, format="json").status_code == 403
    assert not Invite.objects.exists()


def test_an_owner_changes_a_role(owner_api: APIClient, org: Organization) -> None:
    member = join(org)

    response = owner_api.patch(f"{members_url(org)}{member.id}/", {"role": "admin"}, format="json")

    assert response.status_code == 200
    assert Membership.objects.get(user=member).role == Role.ADMIN


def test_the_last_owner_stays(owner_api: APIClient, owner: User, org: Organization) -> None:
    demote = owner_api.patch(f"{members_url(org)}{owner.id}/", {"role": "member"}, format="json")
    leave = owner_api.delete(f"{members_url(org)}{owner.id}/")

    assert demote.status_code == 400
    assert "needs an owner" in demote.json()["error"]["message"]
    assert leave.status_code == 400
    assert Membership.objects.get(user=owner).role == Role.OWNER


def test_an_admin_removes_a_member_but_not_an_owner(api: APIClient, owner: User,
                                                     org: Organization) -> None:
    api.force_authenticate(join(org, Role.ADMIN))
    member = join(org)

    assert api.delete(f"{members_url(org)}{member.id}/").status_code == 204
    assert api.delete(f"{members_url(org)}{owner.id}/").status_code == 403
    assert not Membership.objects.filter(user=member).exists()
    assert Membership.objects.filter(user=owner).exists()


def test_a_member_can_leave(api: APIClient, org: Organization) -> None:
    member = join(org)
    api.force_authenticate(member)

    assert api.delete(f"{members_url(org)}{member.id}/").status_code == 204
    assert not Membership.objects.filter(user=member).exists()


def test_members_list_filters_by_role(owner_api: APIClient, org: Organization) -> None:
    join(org)
    join(org, Role.ADMIN)

    admins = owner_api.get(members_url(org), {"role": "admin"}).json()["results"]

    assert [m["role"] for m in admins] == ["admin"]


def test_a_user_creates_another_organisation(owner_api: APIClient, owner: User) -> None:
    response = owner_api.post("/api/v1/organizations/", {"name": "Side Project"}, format="json")

    assert response.status_code == 201
    assert Membership.objects.get(user=owner, organization__slug="side-project").role == Role.OWNER


def test_one_person_owns_a_bounded_number_of_organisations(
        owner_api: APIClient, owner: User, org: Organization, settings: object) -> None:
    settings.KVRUN_MAX_OWNED_ORGANIZATIONS = 3
    answers = [owner_api.post("/api/v1/organizations/", {"name": f"Side {n}"},
                              format="json") for n in range(3)]

    assert [answer.status_code for answer in answers] == [201, 201, 400]
    assert answers[2].json()["error"]["fields"]["name"] == [
        "You own 3 organisations, the most one person may; use one of them, or ask an "
        "operator."]
    assert Membership.objects.filter(user=owner, role=Role.OWNER).count() == 3


def test_owner_invites_and_promotions_keep_to_the_cap_too(
        owner_api: APIClient, org: Organization, settings: object) -> None:
    settings.KVRUN_MAX_OWNED_ORGANIZATIONS = 1
    busy = UserFactory(email="busy@example.com")
    organization_with_owner("Busy's own", busy)  # busy owns one: the most
    token = owner_api.post(invites_url(org), {"role": "owner"}, format="json").json()["token"]
    invitee = APIClient()
    invitee.force_authenticate(busy)

    refused = invitee.post("/api/v1/invites/accept/", {"token": token}, format="json")

    assert refused.status_code == 400
    assert refused.json()["error"]["fields"]["token"] == [
        "You own 1 organisations, the most one person may: leave one, or ask for an invite "
        "as an admin or a member."]
    assert not Membership.objects.filter(organization=org, user=busy).exists()
    member = Membership.objects.create(organization=org, user=busy, role=Role.ADMIN)
    promoted = owner_api.patch(f"/api/v1/organizations/{org.slug}/members/{busy.id}/",
                               {"role": "owner"}, format="json")
    assert promoted.status_code == 400
    assert "busy@example.com owns 1 organisations" in promoted.json()["error"]["fields"][
        "role"][0]
    assert Membership.objects.get(id=member.id).role == Role.ADMIN


def test_a_key_cannot_create_organisations(manage_secret: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {manage_secret}")

    response = client.post("/api/v1/organizations/", {"name": "Sneaky"}, format="json")

    assert response.status_code == 403
    assert not Organization.objects.filter(name="Sneaky").exists()


def test_an_invite_for_an_email_is_refused_to_anyone_else(owner_api: APIClient,
                                                          org: Organization) -> None:
    token = owner_api.post(invites_url(org), {"email": "ada@acme.test"},
                           format="json").json()["token"]
    stranger, ada = APIClient(), APIClient()
    stranger.force_authenticate(UserFactory(email="eve@evil.test"))
    ada.force_authenticate(UserFactory(email="ada@acme.test"))

    refused = stranger.post("/api/v1/invites/accept/", {"token": token}, format="json")

    assert refused.status_code == 400
    assert "This invite is for ada@acme.test" in refused.json()["error"]["message"]
    assert not Membership.objects.filter(user__email="eve@evil.test").exists()
    assert Invite.objects.get().state == "pending"
    assert ada.post("/api/v1/invites/accept/", {"token": token}, format="json").status_code == 201


def test_no_invite_link_reaches_the_log(owner_api: APIClient, org: Organization) -> None:
    lines: list[str] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        token = owner_api.post(invites_url(org), {}, format="json").json()["token"]
    finally:
        root.removeHandler(handler)

    assert lines, "the invite's creation is logged"
    assert not [line for line in lines if token in line]


def test_the_invite_page_says_whom_the_invite_is_for(owner_api: APIClient, org: Organization,
                                                     client: Client) -> None:
    token = owner_api.post(invites_url(org), {"email": "ada@acme.test"},
                           format="json").json()["token"]
    client.force_login(UserFactory(email="eve@evil.test"))

    response = client.post(f"/invite/{token}/")

    assert response.status_code == 400
    assert b"This invite is for ada@acme.test" in response.content
    assert Invite.objects.get().state == "pending"
    assert Membership.objects.filter(organization=org).count() == 1
