"""Idempotency keys: a request sent again is answered once, a key in use is a conflict, and
every way a request ends frees or keeps its key as a retry needs.

The gateway's ASGI app driven in this process, in front of scripted stand-in engines
(tests.stub_upstream); the same against a real vLLM engine is in tests/e2e."""

import asyncio
import time
from datetime import UTC, datetime
from uuid import uuid4

import httpx
import orjson
import pytest
import time_machine
from redis.asyncio import Redis

from accounts.models import APIKey, Organization
from billing.models import UsageRecord
from billing.usage_stream import lease_ms
from endpoints.models import Endpoint
from gateway.errors import GatewayError
from gateway.idempotency import MAX_KEPT_BYTES, Claim, Idempotency
from kvrun.common.redis import redis_client
from tests.factories import inference_key, ready_endpoint
from tests.gateway.helpers import (
    InProcessGateway,
    engine_received,
    raw_client,
    received,
    stored,
    with_redis,
)
from tests.helpers import wait_until

ORGANIZATION = uuid4()  # an organisation of this module's own: the claims outlive it in Redis

# e2e: the stand-in engines are processes of their own.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_repeated_idempotency_key_does_not_run_again(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    first = gateway.post(secret, body, **{"Idempotency-Key": "order-1"})
    again = gateway.post(secret, body, **{"Idempotency-Key": "order-1"})
    failed = gateway.post(secret, {"model": "chat", "prompt": "context"},
                          **{"Idempotency-Key": "order-2"})
    retried = gateway.post(secret, {"model": "chat", "prompt": "context"},
                           **{"Idempotency-Key": "order-2"})

    assert (first.status_code, again.status_code) == (200, 200)
    assert again.content == first.content
    assert again.headers["x-kvrun-idempotent-replay"] == "true"
    assert (failed.status_code, retried.status_code) == (400, 400)  # a failure frees the key
    assert len(received(stubs[0])) == 3
    gateway.stop()
    assert stored(3)
    assert UsageRecord.objects.count() == 3
    assert UsageRecord.objects.filter(idempotency_key="order-1").count() == 1


def test_an_idempotency_key_in_use_or_streamed_is_a_conflict(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    key = {"Idempotency-Key": "job-7"}
    slow = gateway.submit(gateway.send(secret, {"model": "chat", "prompt": "slow"}, **key))
    assert wait_until(lambda: received(stubs[0]), 5, interval=0.02)  # running at the engine
    clash = gateway.post(secret, {"model": "chat", "prompt": "slow"}, **key)
    assert slow.result(10).status_code == 200
    streamed = gateway.post(secret, {"model": "chat", "prompt": "hello", "stream": True},
                            **{"Idempotency-Key": "job-8"})
    again = gateway.post(secret, {"model": "chat", "prompt": "hello", "stream": True},
                         **{"Idempotency-Key": "job-8"})
    too_long = gateway.post(secret, {"model": "chat", "prompt": "hello"},
                            **{"Idempotency-Key": "k" * 256})

    assert clash.status_code == 409
    assert clash.json()["error"]["code"] == "idempotency_key_reused"
    assert "still running" in clash.json()["error"]["message"]
    assert streamed.status_code == 200
    assert again.status_code == 409 and "was streamed" in again.json()["error"]["message"]
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "Idempotency-Key"


def test_an_idempotency_key_belongs_to_the_api_key_and_the_endpoint_it_was_sent_with(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str,
    stub_ports: list[int], stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "second", stub_ports[1:])
    _, other_secret = inference_key(org, endpoint_names=["chat"])
    key = {"Idempotency-Key": "order-1"}
    first = gateway.post(secret, {"model": "chat", "prompt": "hello"}, **key)

    other_key = gateway.post(other_secret, {"model": "chat", "prompt": "hello"}, **key)
    other_endpoint = gateway.post(secret, {"model": "second", "prompt": "hello"}, **key)

    assert first.status_code == other_key.status_code == other_endpoint.status_code == 200
    assert "x-kvrun-idempotent-replay" not in other_key.headers
    assert "x-kvrun-idempotent-replay" not in other_endpoint.headers
    assert len(received(stubs[0])) == 2 and len(received(stubs[1])) == 1


def test_an_idempotency_key_sent_again_with_another_body_is_refused(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    key = {"Idempotency-Key": "order-1"}
    first = gateway.post(secret, {"model": "chat", "prompt": "hello"}, **key)

    changed = gateway.post(secret, {"model": "chat", "prompt": "goodbye"}, **key)

    assert (first.status_code, changed.status_code) == (200, 422)
    error = changed.json()["error"]
    assert error["code"] == "idempotency_key_reused" and "different body" in error["message"]
    assert first.headers["x-request-id"] in error["message"]
    assert len(received(stubs[0])) == 1


def test_a_request_refused_by_a_limit_or_left_by_its_client_frees_its_idempotency_key(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    _, secret = inference_key(org, requests_per_minute=1)
    _, other = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200
    body = {"model": "chat", "prompt": "slow"}

    refused = [gateway.post(secret, body, **{"Idempotency-Key": "limited"}) for _ in range(2)]
    gateway.run(raw_client(gateway, other, body, leave_when=engine_received(stub_ports[0], 2),
                           headers={"idempotency-key": "left"}))
    retried = gateway.post(other, body, **{"Idempotency-Key": "left"})

    # Refused twice by the limit, never by the key: the first refusal freed it.
    assert [response.status_code for response in refused] == [429, 429]
    assert retried.status_code == 200 and "x-kvrun-idempotent-replay" not in retried.headers
    assert len(received(stubs[0])) == 3


def test_a_request_the_engine_failed_frees_its_idempotency_key_for_the_retry(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    body, key = {"model": "chat", "prompt": "crash"}, {"Idempotency-Key": "order-1"}

    failed = gateway.post(secret, body, **key)
    retried = gateway.post(secret, body, **key)

    assert (failed.status_code, retried.status_code) == (502, 502)
    assert retried.json()["error"]["code"] == "engine_error"  # ran again, not a 409
    assert len(received(stubs[0])) == 2


def test_the_idempotency_key_of_a_request_whose_gateway_died_is_free_once_its_lease_ends(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str
) -> None:
    key = APIKey.objects.get(organization=org)
    body = orjson.dumps({"model": "chat", "prompt": "hello"})
    # What a gateway killed in the middle of the request left behind, its lease running.
    claim = Claim.of(organization_id=ORGANIZATION, api_key_id=key.id,
                     endpoint_id=str(stub_endpoint.id), key="order-1", body=body,
                     request_id="req_dead")
    redis_client().set(claim.name, claim.running(), px=lease_ms())

    clash = gateway.post(secret, body, **{"Idempotency-Key": "order-1"})
    redis_client().pexpire(claim.name, 100)  # no renewal came: the lease ends
    retried = wait_until(lambda: gateway.post(secret, body, **{"Idempotency-Key": "order-1"})
                         .status_code == 200, 10, interval=0.2)

    assert clash.status_code == 409 and "req_dead" in clash.json()["error"]["message"]
    assert retried


def test_a_request_whose_lease_lapsed_does_not_settle_the_retry_s_key() -> None:
    api_key_id = uuid4()  # a key of this test's own: the claims outlive it in Redis
    first = Claim.of(organization_id=ORGANIZATION, api_key_id=api_key_id, endpoint_id="e",
                     key="order-1", body=b"{}", request_id="req_first")
    retry = Claim.of(organization_id=ORGANIZATION, api_key_id=api_key_id, endpoint_id="e",
                     key="order-1", body=b"{}", request_id="req_retry")

    async def lapse_then_settle(redis: Redis) -> bytes | None:
        store = Idempotency(redis, ttl_seconds=60, kept_bytes_per_organization=2**20,
                            kept_bytes_in_all=2**30)
        assert await store.reserve(first) is None
        await redis.delete(first.name)  # its lease ran out while it ran
        assert await store.reserve(retry) is None
        await store.settle(first, succeeded=False, answer=None)
        return await redis.get(retry.name)

    assert asyncio.run(with_redis(lapse_then_settle)) == retry.running()


def test_an_answer_too_large_to_keep_is_not_replayed() -> None:
    claim = Claim.of(organization_id=ORGANIZATION, api_key_id=uuid4(), endpoint_id="e",
                     key="order-1", body=b"{}", request_id="req_large")

    async def settle_then_repeat(redis: Redis) -> str:
        store = Idempotency(redis, ttl_seconds=60, kept_bytes_per_organization=2**20,
                            kept_bytes_in_all=2**30)
        assert await store.reserve(claim) is None
        await store.settle(claim, succeeded=True, answer=b"x" * (MAX_KEPT_BYTES + 1))
        with pytest.raises(GatewayError) as repeat:
            await store.reserve(claim)
        return f"{repeat.value.status} {repeat.value.message}"

    assert asyncio.run(with_redis(settle_then_repeat)).startswith("409 A request with this "
                                                        "Idempotency-Key (req_large) answered "
                                                        "more than 64 KiB")


@pytest.mark.parametrize("budget", ["organisation", "all"])
def test_answers_are_kept_up_to_a_budget_and_past_it_a_repeat_is_a_409(budget: str) -> None:
    organization, answer = uuid4(), b"x" * 1000
    claims = [Claim.of(organization_id=organization, api_key_id=uuid4(), endpoint_id="e",
                       key=f"order-{n}", body=b"{}", request_id=f"req_{n}") for n in range(4)]
    elsewhere = Claim.of(organization_id=uuid4(), api_key_id=uuid4(), endpoint_id="e",
                         key="order-0", body=b"{}", request_id="req_elsewhere")

    async def fill_then_repeat(redis: Redis) -> list[str]:
        await redis.delete(f"kvrun:idem-kept:all:{int(time.time()) // 60}")  # an earlier run's
        # Both budgets are 3,000 bytes in turn: this organisation's, or all of them together.
        store = Idempotency(redis, ttl_seconds=60,
                            kept_bytes_per_organization=3000 if budget == "organisation"
                            else 10**9, kept_bytes_in_all=3000 if budget == "all" else 10**9)
        for claim in [*claims, elsewhere]:
            assert await store.reserve(claim) is None
            await store.settle(claim, succeeded=True, answer=answer)
        outcomes = []
        for claim in [*claims, elsewhere]:
            try:
                outcomes.append((await store.reserve(claim) or b"").decode()[:3])
            except GatewayError as refused:
                outcomes.append(f"{refused.status} {refused.message}")
        return outcomes

    # A window of every organisation's answers that no other test keeps any in.
    with time_machine.travel(datetime(2020, 1, 1, 0, 10 if budget == "all" else 0,
                                      tzinfo=UTC), tick=False):
        outcomes = asyncio.run(with_redis(fill_then_repeat))

    assert outcomes[:3] == ["xxx"] * 3  # 3,000 bytes: the budget, kept and replayed
    assert outcomes[3] == ("409 A request with this Idempotency-Key (req_3) succeeded, but "
                           "its answer was not kept: kept answers (this organisation's, or "
                           "every one's) were at their budget; it runs only once. Send a new "
                           "Idempotency-Key to run another request.")
    # Another organisation's budget is its own; every organisation's is shared.
    assert outcomes[4] == ("xxx" if budget == "organisation" else
                           "409 A request with this Idempotency-Key (req_elsewhere) succeeded, "
                           "but its answer was not kept: kept answers (this organisation's, or "
                           "every one's) were at their budget; it runs only once. Send a new "
                           "Idempotency-Key to run another request.")
