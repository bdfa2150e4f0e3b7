"""A key's requests and tokens per minute and an organisation's requests in flight, held
across gateways, and the trace each running request keeps for the ledger.

The gateway's ASGI app driven in this process, in front of scripted stand-in engines
(tests.stub_upstream); the same against a real vLLM engine is in tests/e2e."""

import asyncio

import httpx
import orjson
import pytest
from django.test import override_settings

from accounts.models import Organization
from billing import usage_stream
from billing.models import UsageRecord
from endpoints.models import Endpoint
from kvrun.common.redis import redis_client
from tests.factories import inference_key
from tests.gateway.helpers import InProcessGateway, received, stored
from tests.helpers import wait_until

# e2e: the stand-in engines are processes of their own.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("usage_stream")]


def test_a_key_has_a_request_limit_per_minute(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization
) -> None:
    _, secret = inference_key(org, requests_per_minute=2)

    responses = [gateway.post(secret, {"model": "chat", "prompt": "hello"}) for _ in range(3)]

    assert [r.status_code for r in responses] == [200, 200, 429]
    refused = responses[2]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "2 requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert responses[0].headers["x-ratelimit-remaining-requests"] == "1"
    gateway.stop()
    assert stored(2)
    assert UsageRecord.objects.count() == 2  # the refused one ran nowhere and is not billed


def test_limits_hold_across_two_gateways_under_concurrent_requests(
    gateway: InProcessGateway, gateway_loop: asyncio.AbstractEventLoop, stub_endpoint: Endpoint,
    org: Organization, stubs: list[httpx.Client]
) -> None:
    _, secret = inference_key(org, requests_per_minute=10)
    second = InProcessGateway(gateway_loop)  # another web process: its own memory and Redis
    body = {"model": "chat", "prompt": "hello"}

    async def burst() -> list[httpx.Response]:
        return await asyncio.gather(*(app.send(secret, body) for app in (gateway, second)
                                      for _ in range(15)))
    try:
        statuses = [response.status_code for response in gateway.run(burst())]
    finally:
        second.stop()

    assert (statuses.count(200), statuses.count(429)) == (10, 20)
    assert len(received(stubs[0])) == 10


def test_a_key_has_a_token_limit_per_minute(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization
) -> None:
    _, secret = inference_key(org, tokens_per_minute=10)

    first = gateway.post(secret, {"model": "chat", "prompt": "hello"})  # 7 + 4 tokens
    assert first.status_code == 200
    # The tokens are counted once the sink has sent the request's release.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "x"}).status_code
                      == 429, 5)
    refused = gateway.post(secret, {"model": "chat", "prompt": "hello"})

    assert refused.json()["error"]["type"] == "tokens"
    assert "10 tokens per minute" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


def test_streams_that_are_still_running_count_against_the_token_limit(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, stubs: list[httpx.Client]
) -> None:
    _, secret = inference_key(org, tokens_per_minute=50)
    body = {"model": "chat", "prompt": "slow", "stream": True, "max_tokens": 20}
    running = [gateway.submit(gateway.send(secret, body)) for _ in range(2)]
    assert wait_until(lambda: len(received(stubs[0])) == 2, 5, interval=0.02)

    # Each reserved its prompt (one token) and its 20: 42 of the 50.
    refused = gateway.post(secret, body)

    assert refused.status_code == 429, refused.text
    assert "has room for 8 now, and this request may use 21" in refused.json()["error"]["message"]
    assert [call.result(10).status_code for call in running] == [200, 200]
    assert len(received(stubs[0])) == 2


@override_settings(KVRUN_GATEWAY_LEASE_SECONDS=3.0)  # renewed every 0.5 s
def test_a_running_request_s_trace_is_renewed_with_its_usage_and_cleared_at_its_end(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    gateway.post(secret, {"model": "chat", "prompt": "hello"})  # the sink now renews often
    running = gateway.submit(gateway.send(secret, {"model": "chat", "prompt": "slow",
                                                   "stream": True}))

    def stream_traces() -> list[dict]:
        traces = map(orjson.loads, redis_client().hvals(usage_stream.ADMITTED))
        return [trace for trace in traces if trace["stream"]]
    assert wait_until(lambda: any(trace["completion_tokens"] >= 3 for trace in stream_traces()),
                      5, interval=0.05)
    [trace] = stream_traces()
    response = running.result(10)

    assert (trace["status_code"], trace["error_code"]) == (502, "gateway_interrupted")
    assert trace["request_id"] == response.headers["x-request-id"]
    assert trace["prompt_tokens"] == 7  # the engine's figure, once it has sent one
    assert stored(2)
    assert redis_client().hlen(usage_stream.ADMITTED) == 0
    assert redis_client().zcard(usage_stream.ADMITTED_SEEN) == 0
    assert UsageRecord.objects.get(request_id=trace["request_id"]).status_code == 200


def test_an_organisation_has_a_limit_on_requests_in_flight(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, stubs: list[httpx.Client]
) -> None:
    Organization.objects.filter(id=org.id).update(max_concurrent_requests=1)
    _, secret = inference_key(org)
    slow = gateway.submit(gateway.send(secret, {"model": "chat", "prompt": "slow"}))
    assert wait_until(lambda: received(stubs[0]), 5, interval=0.02)  # admitted, at the engine

    refused = gateway.post(secret, {"model": "chat", "prompt": "hello"})
    assert slow.result(10).status_code == 200
    # The slot comes back once the sink has sent the slow request's release.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"})
                      .status_code == 200, 5)

    assert refused.status_code == 429
    assert "1 requests in flight" in refused.json()["error"]["message"]
