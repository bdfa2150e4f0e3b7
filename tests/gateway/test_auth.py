"""Who may call the gateway and with what: keys missing, wrong, misused, revoked or held by a
budget, an address that keeps guessing, and input refused before it reaches an engine.

The gateway's ASGI app driven in this process, in front of scripted stand-in engines
(tests.stub_upstream); the same against a real vLLM engine is in tests/e2e."""

import time
from uuid import uuid4

import httpx
import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from accounts.models import APIKey, Organization
from accounts.services import do_set_billing_hold
from billing.models import UsageRecord
from endpoints.models import Endpoint
from engine.processes import free_port
from gateway.limits import in_flight_name
from tests.factories import api_key, inference_key, ready_endpoint
from tests.gateway.helpers import InProcessGateway, raw_client, received, stored
from tests.helpers import wait_until

# e2e: the stand-in engines are processes of their own.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_it_refuses_missing_wrong_and_misused_keys(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, other_org: Organization,
    secret: str, stubs: list[httpx.Client]
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    restricted = inference_key(org, endpoint_names=["other"])[1]
    ready_endpoint(other_org, "theirs", [free_port()])
    outsider = inference_key(other_org)[1]

    missing = gateway.post(None, body)
    wrong = gateway.post("kvr_" + "x" * 43, body)
    manage = gateway.post(api_key(org)[1], body)
    not_allowed = gateway.post(restricted, body)
    foreign = gateway.post(outsider, body)
    other_way = gateway.post(secret, {"model": "theirs", "prompt": "hello"})

    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")
    assert "kvr_xxxx…xxxx" in wrong.json()["error"]["message"]
    assert (manage.status_code, manage.json()["error"]["code"]) == (403, "insufficient_scope")
    assert not_allowed.status_code == 403 and "other" in not_allowed.json()["error"]["message"]
    # Another organisation's endpoint does not exist for the caller.
    assert (foreign.status_code, foreign.json()["error"]["code"]) == (404, "model_not_found")
    assert other_way.status_code == 404
    assert foreign.json()["error"]["type"] == "invalid_request_error"
    assert received(stubs[0]) == []
    gateway.stop()  # every report the gateway had is written
    assert not stored(1, timeout=0)


@override_settings(KVRUN_TRUSTED_PROXIES=1)
def test_an_address_that_keeps_sending_unknown_keys_is_refused_before_they_are_looked_up(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    flooder = {"X-Forwarded-For": "203.0.113.9"}
    assert gateway.post(secret, body, **flooder).status_code == 200  # a key known here
    _, unseen = inference_key(org)
    allowed = settings.KVRUN_GATEWAY_FAILED_AUTHENTICATIONS_PER_MINUTE
    flood = [gateway.post(f"kvr_{uuid4().hex}", body, **flooder) for _ in range(allowed + 2)]

    known_from_flooder = gateway.post(secret, body, **flooder)
    unseen_from_flooder = gateway.post(unseen, body, **flooder)
    unseen_elsewhere = gateway.post(unseen, body, **{"X-Forwarded-For": "198.51.100.7"})

    assert [r.status_code for r in flood] == [401] * allowed + [429, 429]
    assert "from your address; retry in" in flood[-1].json()["error"]["message"]
    assert 1 <= int(flood[-1].headers["retry-after"]) <= 60
    # Keys this gateway already holds go on (clients behind one NAT or proxy); the address
    # looks up no new key until its minute is over.
    assert known_from_flooder.status_code == 200
    assert unseen_from_flooder.status_code == 429
    assert unseen_elsewhere.status_code == 200


def test_messages_or_a_prompt_of_the_wrong_type_are_a_400(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    for body, param in (({"model": "chat", "messages": 1}, "messages"),
                        ({"model": "chat", "prompt": {"text": "hi"}}, "prompt")):
        response = gateway.post(secret, body, path="/v1/chat/completions")

        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


def test_a_request_is_admitted_when_its_body_has_arrived_not_when_it_began(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str
) -> None:
    admitted_at: list[float] = []

    async def watch_the_slot() -> bool:
        admitted_at.extend(score for _, score in await gateway.app.redis.zrange(
            in_flight_name(org.id), 0, -1, withscores=True))
        return bool(admitted_at)

    gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "slow"},
                           upload_seconds=1.0, leave_when=watch_the_slot))

    assert stored(1)
    began_ms = UsageRecord.objects.get().started_at.timestamp() * 1000
    assert admitted_at[0] - began_ms >= 1000


def test_it_refuses_bad_input_without_reaching_an_engine(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    auth = {"Authorization": f"Bearer {secret}"}
    cases = {
        "invalid_json": gateway.post(secret, b"{not json"),
        "no model": gateway.post(secret, {"prompt": "hello"}),
        "bad stream": gateway.post(secret, {"model": "chat", "prompt": "x", "stream": "yes"}),
        "bad stream_options": gateway.post(secret, {"model": "chat", "prompt": "x",
                                                    "stream_options": [1]}),
        "too large": gateway.post(secret, {"model": "chat",
                                           "prompt": "x" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE}),
        "wrong method": gateway.run(gateway.client.get("/v1/completions", headers=auth)),
        "engine metrics": gateway.run(gateway.client.get("/v1/metrics", headers=auth)),
    }

    statuses = {name: response.status_code for name, response in cases.items()}
    assert statuses == {"invalid_json": 400, "no model": 400, "bad stream": 400,
                        "bad stream_options": 400, "too large": 413, "wrong method": 405,
                        "engine metrics": 404}
    assert cases["invalid_json"].json()["error"]["code"] == "invalid_json"
    assert cases["no model"].json()["error"]["param"] == "model"
    assert cases["too large"].json()["error"]["message"] == (
        f"The request body is larger than the limit of {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} "
        "bytes; send a smaller body.")
    assert cases["wrong method"].headers["allow"] == "POST"
    assert "vllm" not in cases["engine metrics"].text.lower()
    assert received(stubs[0]) == []


def test_a_key_revoked_through_kvrun_is_refused_at_once(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, owner_api: object
) -> None:
    key, secret = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200

    assert owner_api.delete(f"/api/v1/organizations/{org.slug}/api-keys/{key.id}/"
                            ).status_code == 204

    # Every gateway hears of the revocation; give the message a moment to arrive.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"}
                                           ).status_code == 401, 1.0, interval=0.05)


def test_a_key_revoked_behind_kvrun_s_back_is_refused_within_the_cache_ttl(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization
) -> None:
    key, secret = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200

    APIKey.objects.filter(id=key.id).update(revoked_at=timezone.now())  # no message sent
    revoked_at = time.monotonic()

    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"}
                                           ).status_code == 401,
                      settings.KVRUN_API_KEY_CACHE_SECONDS + 1, interval=0.2)
    assert time.monotonic() - revoked_at <= settings.KVRUN_API_KEY_CACHE_SECONDS + 0.5


def test_an_organisation_held_by_its_budget_is_refused_with_the_budget_s_message(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization
) -> None:
    _, secret = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200
    reason = (f"This organisation's monthly budget of $1.00 is reached; raise it under Usage "
              f"& billing (/orgs/{org.slug}/billing/).")

    do_set_billing_hold(organization_id=org.id, reason=reason)

    # Within the key cache's lifetime, as for any change to the key's organisation.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"}
                                           ).status_code == 402,
                      settings.KVRUN_API_KEY_CACHE_SECONDS + 1, interval=0.2)
    refused = gateway.post(secret, {"model": "chat", "prompt": "hello"}).json()["error"]
    assert (refused["message"], refused["code"], refused["type"]) == (
        reason, "billing_hold", "insufficient_quota")
