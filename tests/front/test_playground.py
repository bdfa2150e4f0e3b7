"""The playground's chat relay: who may use it, what it checks, and the key it holds.
Its streaming through the gateway to a real engine is in tests/browser/test_journey.py."""

import json

import pytest
from django.test import Client

from accounts.models import APIKey, KeyPurpose, Organization, Scope, User
from accounts.selectors import get_key_identity
from kvrun.common.digests import playground_secret
from tests.factories import ready_endpoint

pytestmark = pytest.mark.django_db


def chat(client: Client, org: Organization, body: object) -> object:
    return client.post(f"/orgs/{org.slug}/endpoints/chat/playground/chat/", json.dumps(body),
                       content_type="application/json")


@pytest.mark.parametrize("body", [
    {}, {"messages": []}, {"messages": [{"role": "robot", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 3},
])
def test_bad_chat_input_is_refused_before_any_key_is_made(owner_client: Client,
                                                          org: Organization, body: dict) -> None:
    ready_endpoint(org, "chat", ports=[])

    response = chat(owner_client, org, body)

    assert response.status_code == 400
    assert response.json()["error"]["message"]
    assert not APIKey.objects.exists()


def test_the_playground_key_is_short_lived_restricted_reused_and_never_stored(
        owner_client: Client, owner: User, org: Organization, settings: object) -> None:
    settings.KVRUN_GATEWAY_URL = "http://127.0.0.1:9"  # nothing listens there
    ready_endpoint(org, "chat", ports=[])
    message = {"messages": [{"role": "user", "content": "hi"}]}

    answers = [chat(owner_client, org, message) for _ in range(2)]

    assert [answer.status_code for answer in answers] == [502, 502]
    assert "The gateway did not answer" in answers[0].json()["error"]["message"]
    key = APIKey.objects.get()  # one key, reused
    assert (key.purpose, key.scope, key.endpoint_names) == (KeyPurpose.PLAYGROUND,
                                                            Scope.INFERENCE, ["chat"])
    assert key.created_by == owner
    assert 3500 < (key.expires_at - key.created_at).total_seconds() <= 3600
    # Its secret is derived for each message, so neither the session nor a row holds it.
    secret = playground_secret(key.id)
    identity = get_key_identity(secret=secret)
    assert identity.id == key.id and identity.endpoint_names == ("chat",)
    assert identity.is_usable()
    assert secret not in str(dict(owner_client.session))
    assert key.digest != secret and key.last_four == secret[-4:]


def test_the_page_never_holds_a_key(owner_client: Client, org: Organization) -> None:
    ready_endpoint(org, "chat", ports=[])

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/playground/")

    assert page.status_code == 200
    assert b"kvr_" not in page.content
    assert not APIKey.objects.exists()


def test_signed_out_people_are_sent_to_sign_in(client: Client, org: Organization) -> None:
    ready_endpoint(org, "chat", ports=[])

    response = chat(client, org, {"messages": [{"role": "user", "content": "hi"}]})

    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def test_members_are_read_only_and_cannot_spend_through_the_playground(
        member_client: Client, org: Organization) -> None:
    ready_endpoint(org, "chat", ports=[])

    page = member_client.get(f"/orgs/{org.slug}/endpoints/chat/playground/", follow=True)
    refused = chat(member_client, org, {"messages": [{"role": "user", "content": "hi"}]})
    endpoint_page = member_client.get(f"/orgs/{org.slug}/endpoints/chat/")

    assert page.redirect_chain == [(f"/orgs/{org.slug}/endpoints/chat/", 302)]
    assert b"Only owners and admins can use the playground" in page.content
    assert refused.status_code == 403
    assert "Only owners and admins" in refused.json()["error"]["message"]
    assert not APIKey.objects.exists()
    assert b"Open the playground" not in endpoint_page.content


def pooled(client: Client, org: Organization, name: str, body: object) -> object:
    return client.post(f"/orgs/{org.slug}/endpoints/{name}/playground/pooled/",
                       json.dumps(body), content_type="application/json")


@pytest.mark.parametrize(("name", "body", "message"), [
    ("embed", {"texts": ["only one"]}, "Write both texts to compare"),
    ("embed", {"texts": ["a", "  "]}, "Write both texts to compare"),
    ("rerank", {"query": "", "documents": ["a"]}, "Write a query"),
    ("rerank", {"query": "q", "documents": []}, "Write 1 to 50 documents, one a line."),
    ("rerank", {"query": "q", "documents": ["a"] * 51}, "Write 1 to 50 documents"),
    ("chat", {"texts": ["a", "b"]}, "chat serves chat: use the chat above."),
])
def test_bad_embedding_and_rerank_input_is_refused_before_any_key_is_made(
        owner_client: Client, org: Organization, name: str, body: dict,
        message: str) -> None:
    ready_endpoint(org, "chat", ports=[])
    ready_endpoint(org, "embed", ports=[], model="kvrun-demo-embed")
    ready_endpoint(org, "rerank", ports=[], model="kvrun-demo-rerank")

    response = pooled(owner_client, org, name, body)

    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert not APIKey.objects.exists()


def test_an_embedding_model_s_playground_asks_for_two_texts_and_holds_no_key(
        owner_client: Client, org: Organization) -> None:
    ready_endpoint(org, "embed", ports=[], model="kvrun-demo-embed")

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/embed/playground/").content.decode()

    assert "Compare two texts' embeddings" in page and 'id="chat-form"' not in page
    assert "kvr_" not in page
