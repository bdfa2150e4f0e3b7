"""The members page: invite links, leaving, and no other organisation's pages."""

import pytest
from django.test import Client

from accounts.models import APIKey, Membership, Role, User
from endpoints.services import do_load_catalogs
from tests.factories import UserFactory, api_key, organization_with_owner, ready_endpoint

pytestmark = pytest.mark.django_db


def test_an_invite_link_from_the_dashboard_adds_a_member(client: Client, owner: User,
                                                          org: object) -> None:
    client.force_login(owner)
    url = client.post(f"/orgs/{org.slug}/invites/", {"role": "member"}).context["created"][
        "invite_url"]
    path = "/" + url.split("://", 1)[1].split("/", 1)[1]
    invitee = Client()
    invitee.force_login(UserFactory(email="joiner@example.com"))

    assert invitee.get(path).status_code == 200
    joined = invitee.post(path)
    assert joined.status_code == 302
    assert joined["Location"] == f"/orgs/{org.slug}/"
    assert invitee.get(path).status_code == 404
    assert Membership.objects.get(user__email="joiner@example.com").role == Role.MEMBER


def test_it_switches_between_organisations_and_remembers_the_last(client: Client, owner: User,
                                                                   org: object) -> None:
    second = organization_with_owner("Second", owner)
    client.force_login(owner)

    page = client.get(f"/orgs/{second.slug}/members/")
    home = client.get("/")

    assert page.status_code == 200
    assert f'href="/orgs/{org.slug}/"'.encode() in page.content  # the switcher
    assert home["Location"] == f"/orgs/{second.slug}/"


@pytest.mark.parametrize("path", ["", "endpoints/new/", "endpoints/chat/",
                                  "endpoints/chat/status/", "endpoints/chat/usage/",
                                  "endpoints/chat/playground/", "keys/", "members/"])
def test_another_organisations_pages_are_not_found(client: Client, other_org: object,
                                                   path: str) -> None:
    do_load_catalogs()
    ready_endpoint(other_org, "chat", ports=[])
    client.force_login(UserFactory())

    assert client.get(f"/orgs/{other_org.slug}/{path}").status_code == 404


@pytest.mark.parametrize("path", ["keys/new/", "invites/", "endpoints/chat/stop/",
                                  "endpoints/chat/start/", "endpoints/chat/scale/",
                                  "endpoints/chat/delete/", "endpoints/chat/playground/chat/",
                                  "endpoints/new/", "endpoints/new/sizing/",
                                  "members/1/remove/"])
def test_another_organisations_forms_change_nothing(client: Client, other_org: object,
                                                    path: str) -> None:
    endpoint = ready_endpoint(other_org, "chat", ports=[])
    key, _ = api_key(other_org)
    client.force_login(UserFactory())

    path = path.replace("members/1/", f"members/{owner_of(other_org).id}/")
    response = client.post(f"/orgs/{other_org.slug}/{path}",
                           {"name": "x", "scope": "manage", "replicas": "1"})
    revoke = client.post(f"/orgs/{other_org.slug}/keys/{key.id}/revoke/")

    assert (response.status_code, revoke.status_code) == (404, 404)
    endpoint.refresh_from_db()
    assert (endpoint.desired_state, endpoint.desired_replicas, endpoint.deleted_at) == (
        "running", 1, None)
    assert list(APIKey.objects.values_list("id", "revoked_at")) == [(key.id, None)]
    assert Membership.objects.filter(organization=other_org).count() == 1


def owner_of(organization: object) -> User:
    return Membership.objects.get(organization=organization).user


def test_a_member_is_told_only_managers_create_endpoints(member_client: Client,
                                                         org: object) -> None:
    response = member_client.get(f"/orgs/{org.slug}/endpoints/new/", follow=True)

    assert response.redirect_chain[-1][0] == f"/orgs/{org.slug}/"
    assert b"Only owners and admins can create endpoints" in response.content


def test_an_owner_changes_a_members_role(owner_client: Client, org: object) -> None:
    member = UserFactory(email="dev@acme.test")
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)

    response = owner_client.post(f"/orgs/{org.slug}/members/{member.id}/role/",
                                 {"role": "admin"}, follow=True)

    assert b"dev@acme.test is now admin" in response.content
    assert Membership.objects.get(user=member).role == Role.ADMIN


def test_a_member_cannot_change_roles(member_client: Client, owner: User, org: object) -> None:
    response = member_client.post(f"/orgs/{org.slug}/members/{owner.id}/role/",
                                  {"role": "member"}, follow=True)

    assert b"Only owners and admins can change roles" in response.content
    assert Membership.objects.get(user=owner).role == Role.OWNER


def test_the_only_owner_is_told_how_to_leave_not_offered_a_button_that_fails(
        owner_client: Client, owner: User, org: object) -> None:
    alone = owner_client.get(f"/orgs/{org.slug}/members/").content.decode()
    second = UserFactory(email="cto@acme.test")
    Membership.objects.create(organization=org, user=second, role=Role.OWNER)
    shared = owner_client.get(f"/orgs/{org.slug}/members/").content.decode()

    assert "make another member an owner to leave" in alone
    assert f'aria-label="Leave {org.name}"' not in alone
    assert f'aria-label="Leave {org.name}"' in shared
