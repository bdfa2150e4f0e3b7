"""The API keys page: a secret shown once, restrictions and limits, revoking."""

from datetime import timedelta

import pytest
from django.test import Client

from accounts.models import APIKey, KeyPurpose, Organization, Role, User
from accounts.services import do_issue_playground_key
from endpoints.models import Adapter
from tests.factories import api_key, ready_endpoint

pytestmark = pytest.mark.django_db


def test_a_new_key_is_shown_once_with_its_restrictions(owner_client: Client,
                                                       org: Organization) -> None:
    ready_endpoint(org, "chat", ports=[])

    created = owner_client.post(f"/orgs/{org.slug}/keys/new/", {
        "name": "laptop", "scope": "inference", "endpoint_names": "chat",
        "requests_per_minute": "30", "tokens_per_minute": "5000"})
    later = owner_client.get(f"/orgs/{org.slug}/keys/")

    assert created.status_code == 200
    key = APIKey.objects.get()
    secret = created.context["created"]["secret"]
    assert secret.encode() in created.content
    assert secret.encode() not in later.content
    assert key.masked.encode() in later.content
    assert b"30 req/min \xc2\xb7 5,000 tok/min" in later.content
    assert (key.endpoint_names, key.requests_per_minute, key.tokens_per_minute) == (
        ["chat"], 30, 5000)


def test_the_key_form_sent_twice_creates_one_key(owner_client: Client,
                                                 org: Organization) -> None:
    form = owner_client.get(f"/orgs/{org.slug}/keys/").context["key_form"]
    sent = {"name": "laptop", "scope": "inference",
            "creation_token": form["creation_token"].initial}

    first = owner_client.post(f"/orgs/{org.slug}/keys/new/", sent)
    again = owner_client.post(f"/orgs/{org.slug}/keys/new/", sent)  # a reload of the answer

    assert first.status_code == 200
    assert again.status_code == 400
    assert b"This form was sent before and its key created" in again.content
    assert again.context["created"] == {}  # no secret shown
    assert APIKey.objects.count() == 1
    # The form shown with the refusal is a new one: sent, it creates the next key.
    token = again.context["key_form"]["creation_token"].value()
    assert token != sent["creation_token"]
    third = owner_client.post(f"/orgs/{org.slug}/keys/new/", {**sent, "creation_token": token})
    assert third.status_code == 200 and APIKey.objects.count() == 2
    # Each page's form is a new one.
    assert first.context["key_form"]["creation_token"].initial != sent["creation_token"]


@pytest.mark.parametrize("requests_per_minute", ["0", str(2**31)])
def test_bad_key_input_shows_the_error_next_to_its_field(owner_client: Client,
                                                         org: Organization,
                                                         requests_per_minute: str) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/keys/new/", {
        "name": "x", "scope": "inference", "requests_per_minute": requests_per_minute,
        "endpoint_names": "not-an-endpoint", "expires_at": "2020-01-01T00:00"})

    assert response.status_code == 400
    # Every field's error at once, the expiry's (a service rule) with the others.
    assert b'id="id_requests_per_minute_error"' in response.content
    assert b'id="id_endpoint_names_error"' in response.content
    assert b"Choose an expiry in the future, or none." in response.content
    assert not APIKey.objects.exists()


def test_a_member_cannot_create_or_revoke_keys(member_client: Client, org: Organization) -> None:
    key, _ = api_key(org)

    created = member_client.post(f"/orgs/{org.slug}/keys/new/", {"name": "x",
                                                                 "scope": "manage"})
    revoked = member_client.post(f"/orgs/{org.slug}/keys/{key.id}/revoke/", follow=True)

    assert created.status_code == 302
    assert b"Only owners and admins can revoke API keys" in revoked.content
    key.refresh_from_db()
    assert key.revoked_at is None
    assert APIKey.objects.count() == 1


def test_a_key_without_limits_shows_the_deployment_s(owner_client: Client,
                                                   org: Organization) -> None:
    api_key(org)

    page = owner_client.get(f"/orgs/{org.slug}/keys/").content.decode()

    assert "600 req/min · 1,000,000 tok/min" in page
    assert "default, 600." in page and "default, 1,000,000." in page  # the form's help


def test_revoking_a_key_refuses_it_at_once(owner_client: Client, org: Organization) -> None:
    key, _ = api_key(org)

    response = owner_client.post(f"/orgs/{org.slug}/keys/{key.id}/revoke/", follow=True)

    assert b"is revoked" in response.content
    key.refresh_from_db()
    assert key.state == "revoked"


def test_playground_keys_are_listed_apart_for_owners_and_admins(
        owner_client: Client, member_client: Client, owner: User, org: Organization) -> None:
    do_issue_playground_key(organization=org, user=owner, actor_role=Role.OWNER,
                            endpoint_name="chat", lifetime=timedelta(hours=1))

    page = owner_client.get(f"/orgs/{org.slug}/keys/")
    seen_by_member = member_client.get(f"/orgs/{org.slug}/keys/")

    assert list(page.context["api_keys"]) == []
    assert [key.created_by for key in page.context["playground_keys"]] == [owner]
    assert APIKey.objects.get().purpose == KeyPurpose.PLAYGROUND
    assert b"Create key" in page.content
    assert seen_by_member.context["playground_keys"] == []


def test_a_hidden_field_s_error_is_shown_too(owner_client: Client, org: Organization) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/keys/new/", {
        "name": "laptop", "scope": "inference", "creation_token": "x" * 33})

    assert response.status_code == 400
    assert b"Creation token: Ensure this value has at most 32 characters" in response.content
    assert not APIKey.objects.exists()


def test_a_key_can_be_restricted_to_one_adapter_of_an_endpoint(owner_client: Client,
                                                                org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[])
    Adapter.objects.create(endpoint=endpoint, name="legal", source="hub", rank=8, size_bytes=1,
                           hf_repo="acme/legal-lora", hf_commit="ab" * 20)

    refused = owner_client.post(f"/orgs/{org.slug}/keys/new/", {
        "name": "lawyers", "scope": "inference", "endpoint_names": "chat:tax"})
    created = owner_client.post(f"/orgs/{org.slug}/keys/new/", {
        "name": "lawyers", "scope": "inference", "endpoint_names": "chat:legal"})

    assert refused.status_code == 400
    assert b"No endpoint or adapter named chat:tax" in refused.content
    assert created.status_code == 200
    assert APIKey.objects.get().endpoint_names == ["chat:legal"]
