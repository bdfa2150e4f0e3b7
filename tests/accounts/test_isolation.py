"""Organisation B sees none of A's objects: every resource is a 404 and every list is empty."""

import pytest
from rest_framework.test import APIClient

from accounts.models import Membership, Organization, Role, User
from accounts.services import do_create_invite
from tests.factories import UserFactory, api_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def a_objects(org: Organization, owner: User) -> dict[str, str]:
    key, _ = api_key(org)
    invite, _ = do_create_invite(organization=org, actor_role=Role.OWNER, created_by=owner)
    member = UserFactory()
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    base = f"/api/v1/organizations/{org.slug}"
    return {
        "organization": f"{base}/",
        "members": f"{base}/members/",
        "member": f"{base}/members/{member.id}/",
        "invites": f"{base}/invites/",
        "invite": f"{base}/invites/{invite.id}/",
        "api-keys": f"{base}/api-keys/",
        "api-key": f"{base}/api-keys/{key.id}/",
    }


@pytest.fixture(params=["user", "key"])
def outsider(request: pytest.FixtureRequest, other_org: Organization) -> APIClient:
    client = APIClient()
    if request.param == "user":
        client.force_authenticate(Membership.objects.get(organization=other_org).user)
    else:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key(other_org)[1]}")
    return client


@pytest.mark.parametrize(
    "name", ["organization", "members", "member", "invites", "invite", "api-keys", "api-key"]
)
def test_another_organisations_objects_are_not_found(
    outsider: APIClient, a_objects: dict[str, str], name: str
) -> None:
    response = outsider.get(a_objects[name])

    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"


@pytest.mark.parametrize(
    ("name", "method", "body"),
    [
        ("api-key", "delete", None),
        ("invite", "delete", None),
        ("member", "delete", None),
        ("member", "patch", {"role": "owner"}),
        ("organization", "patch", {"name": "Taken"}),
        ("api-keys", "post", {"name": "planted"}),
        ("invites", "post", {"role": "owner"}),
    ],
)
def test_another_organisations_objects_cannot_be_changed(
    outsider: APIClient, a_objects: dict[str, str], org: Organization, name: str, method: str,
    body: dict | None,
) -> None:
    before = (org.api_keys.filter(revoked_at=None).count(), org.invites.count(),
              org.memberships.count(), org.name)

    response = getattr(outsider, method)(a_objects[name], body, format="json")

    assert response.status_code == 404
    org.refresh_from_db()
    after = (org.api_keys.filter(revoked_at=None).count(), org.invites.count(),
             org.memberships.count(), org.name)
    assert after == before


def test_lists_show_only_the_callers_organisation(
    outsider: APIClient, a_objects: dict[str, str], other_org: Organization
) -> None:
    slugs = [o["slug"] for o in outsider.get("/api/v1/organizations/").json()["results"]]

    assert slugs == [other_org.slug]
