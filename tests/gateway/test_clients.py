"""Clients as they are: one that reads slowly, one that leaves mid-stream or before any
usage, and what each is billed; a stream's trace and an answer's record written before the
client has what they bill.

The gateway's ASGI app driven in this process, in front of scripted stand-in engines
(tests.stub_upstream); the same against a real vLLM engine is in tests/e2e."""


import httpx
import orjson
import pytest
from django.test import override_settings
from redis.asyncio import Redis

from accounts.models import Organization
from billing import usage_stream
from billing.models import UsageRecord
from endpoints.models import Endpoint
from kvrun.common.redis import redis_client
from tests.gateway.helpers import (
    InProcessGateway,
    engine_received,
    nothing_held,
    raw_client,
    stored,
    with_redis,
)

# e2e: the stand-in engines are processes of their own.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("usage_stream")]


def test_a_client_that_reads_slowly_is_not_the_gateway_s_overhead(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    frames = gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "hello",
                                                      "stream": True}, reading_seconds=0.3))

    assert len(frames) == 5  # four chunks, then [DONE]
    assert stored(1)
    record = UsageRecord.objects.get()
    assert record.duration_ms >= 1500
    # Were the client's 1.5 s of reading counted, the overhead would be more than that; the
    # gateway's own work is about a millisecond (bench/gateway.py measures it).
    assert record.gateway_overhead_ms < 1500


# No lease renewal during the stream (every lease/6 s): a renewal writes every running trace
# as it is, so a stream slowed by a busy machine had more writes.
@override_settings(KVRUN_GATEWAY_TRACE_LAG_TOKENS=3, KVRUN_GATEWAY_LEASE_SECONDS=3600)
def test_a_stream_s_trace_holds_what_its_client_has_received_before_it_has_it(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    seen = []  # at each event with a token: tokens received, tokens traced, whether the last

    async def watch(redis: Redis) -> list[bytes]:
        request_id = b""

        async def on_frame(message: dict) -> None:
            nonlocal request_id
            if message["type"] == "http.response.start":
                request_id = dict(message["headers"])[b"x-request-id"]
            elif b'"choices":[{' in message.get("body", b""):
                trace = await redis.hget(usage_stream.ADMITTED, request_id)
                seen.append((len(seen) + 1, orjson.loads(trace)["completion_tokens"],
                             b'"finish_reason":"length"' in message["body"]))
        return await raw_client(gateway, secret, {"model": "chat", "prompt": "steady",
                                                  "stream": True}, on_frame=on_frame)

    gateway.run(with_redis(watch))

    assert len(seen) == 200 and seen[-1] == (200, 200, True)
    assert all(received - 3 <= traced <= received for received, traced, _ in seen), seen
    # Written once two tokens behind (half the lag, without waiting), or at three: not with
    # each token.
    assert 40 <= len({traced for _, traced, _ in seen}) <= 110


@override_settings(KVRUN_GATEWAY_GATHER_SECONDS=5)  # the record is written 5 s later
def test_an_answer_is_in_its_trace_before_its_client_has_it(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "hello"})

    # What a crash now would bill: the whole answer, there before the answer left.
    trace = orjson.loads(redis_client().hget(usage_stream.ADMITTED,
                                             response.headers["x-request-id"]))
    assert (trace["prompt_tokens"], trace["completion_tokens"], trace["cached_tokens"]) == (
        7, 4, 3)
    assert redis_client().xlen(usage_stream.STREAM) == 0  # the record is on its way


def test_a_client_that_leaves_mid_stream_is_recorded_with_what_it_got(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str
) -> None:
    frames = gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "slow",
                                                       "stream": True}, after_frames=3))

    assert len(frames) == 3
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.client_disconnected) == (499, True)
    assert 3 <= record.completion_tokens < 20 and record.prompt_tokens == 7
    gateway.stop()
    assert nothing_held(gateway, org)


def test_a_client_that_leaves_before_any_usage_is_billed_for_its_prompt(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str,
    stub_ports: list[int], stubs: list[httpx.Client]
) -> None:
    frames = gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "slow"},
                                     leave_when=engine_received(stub_ports[0], 1)))

    assert frames == []  # gone before the slow answer was ready
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.client_disconnected) == (499, True)
    # No usage came back, so the engine's tokenizer counted the prompt.
    assert (record.prompt_tokens, record.completion_tokens) == (1, 0)
    gateway.stop()
    assert nothing_held(gateway, org)
