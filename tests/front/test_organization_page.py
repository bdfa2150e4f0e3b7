"""The organisation page: API keys shown once, invite links, and no other organisation's."""

import pytest
from django.test import Client

from accounts.models import APIKey, Membership, User
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


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
