"""A person confirms their address from the link mailed at sign-up; until then nothing their
organisations own may hold hardware."""

import re
from datetime import timedelta

import pytest
import time_machine
from django.core import mail
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import Organization, User
from endpoints.models import Endpoint, Node
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PASSWORD = "analytical engine 1843"
DEMO = {"name": "demo", "model": "kvrun-demo-tiny", "context_length": 2048, "concurrency": 4}


def link_in(message: mail.EmailMessage) -> str:
    found = re.search(r"https?://[^/\s]+(/email/verify/\S+/)", message.body)
    assert found, message.body
    return found.group(1)


def sign_up(client: Client, django_capture_on_commit_callbacks: object,
            email: str = "grace@example.com") -> User:
    with django_capture_on_commit_callbacks(execute=True):  # type: ignore[operator]
        response = client.post("/signup/", {"email": email, "password": PASSWORD,
                                            "organization_name": "Compilers"})
    assert response.status_code == 302
    return User.objects.get(email=email)


def test_sign_up_mails_a_link_that_confirms_the_address_once(
        client: Client, django_capture_on_commit_callbacks: object) -> None:
    user = sign_up(client, django_capture_on_commit_callbacks)
    assert user.email_verified_at is None
    [message] = mail.outbox
    assert message.to == ["grace@example.com"]
    assert "works for 3 days" in message.body

    client.logout()  # mail is often read on another device
    response = client.get(link_in(message))

    assert response.status_code == 200
    assert b"grace@example.com is confirmed" in response.content
    user.refresh_from_db()
    confirmed_at = user.email_verified_at
    assert confirmed_at is not None
    assert client.get(link_in(message)).status_code == 200
    user.refresh_from_db()
    assert user.email_verified_at == confirmed_at


@pytest.mark.parametrize(("change", "says"), [
    ("tampered", "This is not a link kvrun sent"),
    ("expired", "This link has expired"),
    ("address changed", "no longer has an account"),
])
def test_a_link_that_does_not_hold_is_refused_and_confirms_nothing(
        client: Client, django_capture_on_commit_callbacks: object, change: str,
        says: str) -> None:
    user = sign_up(client, django_capture_on_commit_callbacks)
    link = link_in(mail.outbox[0])
    if change == "tampered":
        link = link.replace("/verify/", "/verify/x")
    elif change == "address changed":
        User.objects.filter(id=user.id).update(email="grace.h@example.com")

    with time_machine.travel(timezone.now() + timedelta(days=4 if change == "expired" else 0)):
        response = client.get(link)

    assert response.status_code == 400
    assert says in response.content.decode()
    user.refresh_from_db()
    assert user.email_verified_at is None


def test_the_dashboard_asks_for_the_confirmation_and_sends_it_again_a_few_times_an_hour(
        client: Client, django_capture_on_commit_callbacks: object) -> None:
    sign_up(client, django_capture_on_commit_callbacks)
    page = client.get("/", follow=True)
    assert b'data-testid="unconfirmed-email"' in page.content

    answers = []
    for _ in range(6):
        with django_capture_on_commit_callbacks(execute=True):  # type: ignore[operator]
            answers.append(client.post("/email/verify/", {"next": "/"}, follow=True))

    assert b"A new confirmation link is on its way" in answers[0].content
    assert b"Too many confirmation mails sent this hour" in answers[5].content
    assert len(mail.outbox) == 1 + 5
    client.get(link_in(mail.outbox[-1]))
    assert b'data-testid="unconfirmed-email"' not in client.get("/", follow=True).content


def test_an_unconfirmed_owner_s_organisation_starts_no_endpoint_until_they_confirm(
        api: APIClient, cpu_node: Node, client: Client,
        django_capture_on_commit_callbacks: object) -> None:
    user = sign_up(client, django_capture_on_commit_callbacks)
    organization = Organization.objects.get(memberships__user=user)
    api.force_authenticate(user)
    endpoints = f"/api/v1/organizations/{organization.slug}/endpoints/"

    refused = api.post(endpoints, DEMO, format="json")

    assert refused.status_code == 400
    assert ("owners have confirmed their email address, and grace@example.com has not yet"
            in refused.json()["error"]["message"])
    assert not Endpoint.objects.exists()
    client.get(link_in(mail.outbox[0]))
    assert api.post(endpoints, DEMO, format="json").status_code == 201


def test_a_co_owner_s_unconfirmed_address_holds_the_organisation_too(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    stranger = UserFactory(email="new@example.com", email_verified_at=None)
    org.memberships.create(user=stranger, role="owner")

    response = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", DEMO,
                              format="json")

    assert response.status_code == 400
    assert "new@example.com has not yet" in response.json()["error"]["message"]


def test_an_operator_made_on_the_command_line_vouches_for_their_own_address(db: None) -> None:
    operator = User.objects.create_superuser(email="ops@example.com", password=PASSWORD)

    assert operator.email_verified_at is not None
