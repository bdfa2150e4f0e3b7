"""The gateway's limits and error mapping, directly against Redis and vLLM's error bodies."""

import asyncio
import time
from uuid import uuid4

import orjson
import pytest
from redis.asyncio import Redis

from accounts.principals import KeyIdentity
from billing.usage_stream import ADMITTED, ADMITTED_SEEN, lease_ms
from gateway.errors import LONGEST_MESSAGE, GatewayError, from_engine
from gateway.limits import (
    COUNTER_TTL_MS,
    WINDOW_MS,
    Admission,
    Limiter,
    counter_name,
    in_flight_name,
    seconds_until_room,
)
from kvrun.common.redis import redis_client
from scaling import activity
from tests.gateway.helpers import with_redis

ENDPOINT = str(uuid4())


def identity(**limits: int) -> KeyIdentity:
    return KeyIdentity(id=uuid4(), organization_id=uuid4(), scope="inference", expires_at=None,
                       revoked=False, **limits)


def clean_minute() -> int:
    """The start of a minute no test has counted in yet."""
    return (int(time.time() * 1000) // WINDOW_MS + 10) * WINDOW_MS


def admit_all(key: KeyIdentity, times: int, now_ms: int, tokens: int = 1) -> list[int]:
    async def run(redis: Redis) -> list[int]:
        limiter = Limiter(redis)
        statuses = []
        for _ in range(times):
            try:
                await limiter.admit(identity=key, endpoint_id=ENDPOINT,
                                    request_id=f"r{uuid4().hex}", now_ms=now_ms,
                                    tokens=tokens, trace=b"{}")
                statuses.append(200)
            except GatewayError as error:
                statuses.append(error.status)
        return statuses
    return asyncio.run(with_redis(run))


def admit(key: KeyIdentity, now_ms: int, tokens: int = 1) -> Admission:
    return asyncio.run(with_redis(lambda redis: Limiter(redis).admit(
        identity=key, endpoint_id=ENDPOINT, request_id=f"r{uuid4().hex}", now_ms=now_ms,
        tokens=tokens, trace=b"{}")))


def settle(admission: Admission, *, tokens: int = 0, now_ms: int = 0, renew: bool = False) -> None:
    """Send the admission's renewal (at `now_ms`) or its release."""
    async def run(redis: Redis) -> None:
        pipe = redis.pipeline(transaction=True)
        if renew:
            admission.renew(pipe, now_ms=now_ms)
        else:
            admission.release(pipe, tokens=tokens, now_ms=now_ms)
        await pipe.execute()
    asyncio.run(with_redis(run))


def counted(key: KeyIdentity, kind: str, window: int) -> int:
    return int(asyncio.run(with_redis(lambda redis: redis.get(counter_name(key, kind, window))))
               or 0)


@pytest.mark.parametrize(("current", "previous", "limit", "elapsed_ms", "expected"), [
    (5, 0, 10, 0, 1),            # room now
    (0, 10, 10, 30_000, 1),      # last minute weighs only 5 of 10 by now: room
    (5, 10, 10, 30_000, 6),      # 5 + 10 x 0.5 is full; at 36 s it is 5 + 4
    (10, 0, 10, 15_000, 51),     # this minute is full: 45 s to its end, then 6 s more
    (10, 10, 10, 59_000, 7),     # last minute no longer counts once this one is over
])
def test_it_says_how_long_until_there_is_room(current: int, previous: int, limit: int,
                                              elapsed_ms: int, expected: int) -> None:
    assert seconds_until_room(current=current, previous=previous, limit=limit,
                              elapsed_ms=elapsed_ms) == expected


def test_the_wait_is_for_room_enough_for_the_whole_reservation() -> None:
    # 50 wanted of 100 with 40 used: room now. With 80 used: 45 s to this minute's end,
    # then 22.5 s more until the last minute's 80 weighs no more than 50.
    assert seconds_until_room(current=40, previous=0, limit=100, elapsed_ms=15_000,
                              needed=50) == 1
    assert seconds_until_room(current=80, previous=0, limit=100, elapsed_ms=15_000,
                              needed=50) == 45 + 23


def test_the_request_limit_counts_this_and_last_minute() -> None:
    key = identity(requests_per_minute=4)
    minute = clean_minute()

    assert admit_all(key, 5, minute) == [200, 200, 200, 200, 429]
    # Half-way through the next minute the last one still weighs 2 of its 4.
    assert admit_all(key, 3, minute + WINDOW_MS + WINDOW_MS // 2) == [200, 200, 429]


def test_a_slot_held_by_a_dead_gateway_is_free_within_a_minute() -> None:
    key = identity(max_concurrent_requests=1)
    now = int(time.time() * 1000)
    assert admit_all(key, 2, now) == [200, 429]

    assert lease_ms() <= WINDOW_MS
    assert admit_all(key, 1, now + lease_ms() + 1) == [200]


def test_a_slot_its_gateway_renews_stays_taken() -> None:
    key = identity(max_concurrent_requests=1)
    now = int(time.time() * 1000)
    running = admit(key, now)

    settle(running, renew=True, now_ms=now + lease_ms() - 1)

    assert admit_all(key, 1, now + lease_ms() + 1) == [429]
    settle(running, now_ms=now + lease_ms() + 2)
    assert admit_all(key, 1, now + lease_ms() + 3) == [200]


def test_a_renewal_keeps_the_in_flight_set_alive_as_long_as_its_slots() -> None:
    key = identity(max_concurrent_requests=1)
    now = int(time.time() * 1000)
    running = admit(key, now)
    name = in_flight_name(key.organization_id)
    asyncio.run(with_redis(lambda redis: redis.pexpire(name, 100)))  # nearly gone

    settle(running, renew=True, now_ms=now)

    assert asyncio.run(with_redis(lambda redis: redis.pttl(name))) > lease_ms() - 1000


def test_no_limit_means_no_counting() -> None:
    key = identity()
    assert admit_all(key, 3, int(time.time() * 1000)) == [200, 200, 200]

    held = asyncio.run(with_redis(lambda redis: redis.zcard(in_flight_name(key.organization_id))))
    assert held == 0


def test_admission_traces_the_request_for_the_ledger() -> None:
    now = int(time.time() * 1000)

    async def run(redis: Redis) -> tuple[object, object]:
        await Limiter(redis).admit(identity=identity(), endpoint_id=ENDPOINT,
                                   request_id="r-traced", now_ms=now,
                                   tokens=1, trace=b'{"request_id": "r-traced"}')
        traced = await redis.hget(ADMITTED, "r-traced"), await redis.zscore(ADMITTED_SEEN,
                                                                            "r-traced")
        await redis.hdel(ADMITTED, "r-traced")
        await redis.zrem(ADMITTED_SEEN, "r-traced")
        return traced

    assert asyncio.run(with_redis(run)) == (b'{"request_id": "r-traced"}', now)


def test_running_requests_hold_their_reservation_until_they_end() -> None:
    key = identity(tokens_per_minute=100)
    minute = clean_minute()
    first = admit(key, minute, tokens=60)

    # Nothing has ended yet, and 60 of the 100 are reserved.
    assert admit_all(key, 1, minute + 1, tokens=60) == [429]
    settle(first, tokens=10, now_ms=minute + 2)  # it used 10 of its 60

    assert counted(key, "tok", minute // WINDOW_MS) == 10
    assert admit_all(key, 1, minute + 3, tokens=60) == [200]


def test_a_request_reserves_at_most_the_whole_limit() -> None:
    key = identity(tokens_per_minute=100)

    assert admit_all(key, 2, clean_minute(), tokens=1_000) == [200, 429]


def test_a_request_that_outlasts_its_minute_counts_its_excess_when_it_ends() -> None:
    key = identity(tokens_per_minute=1_000)
    minute = clean_minute()
    long = admit(key, minute, tokens=50)

    settle(long, tokens=80, now_ms=minute + 3 * WINDOW_MS)

    assert counted(key, "tok", minute // WINDOW_MS + 3) == 30
    ttl = asyncio.run(with_redis(lambda redis: redis.pttl(
        counter_name(key, "tok", minute // WINDOW_MS + 3))))
    assert 0 < ttl <= COUNTER_TTL_MS


def test_a_release_gives_the_slot_back() -> None:
    key = identity(max_concurrent_requests=1)
    now = int(time.time() * 1000)

    settle(admit(key, now), tokens=11, now_ms=now)

    assert admit_all(key, 1, now) == [200]


def test_a_request_counts_in_flight_to_its_endpoint_until_its_release() -> None:
    # With no limit of the key's own: what the autoscaler reads is always kept.
    key, now = identity(), int(time.time() * 1000)
    redis = redis_client()
    in_flight = activity.in_flight_name(ENDPOINT)
    redis.delete(in_flight)

    running = admit(key, now)
    assert redis.zscore(in_flight, running.request_id) == now
    assert int(redis.get(activity.last_request_name(ENDPOINT))) == now
    settle(running, renew=True, now_ms=now + 5000)
    assert redis.zscore(in_flight, running.request_id) == now + 5000
    settle(running, tokens=3, now_ms=now + 6000)
    assert redis.zcard(in_flight) == 0
    # Its end is the endpoint's last request: idle time counts from there.
    assert int(redis.get(activity.last_request_name(ENDPOINT))) == now + 6000


@pytest.mark.parametrize(("status", "message", "expected"), [
    (400, "This model's maximum context length is 2048 tokens. However, your prompt contains "
          "3000 input tokens.", (400, "context_length_exceeded", "invalid_request_error")),
    (400, "max_tokens=5000 cannot be greater than max_model_len=2048.",
     (400, "context_length_exceeded", "invalid_request_error")),
    (400, "temperature must be non-negative", (400, "invalid_request", "invalid_request_error")),
    (404, "The model `x` does not exist.", (404, "model_not_found", "invalid_request_error")),
    (401, "Unauthorized", (502, "engine_unavailable", "server_error")),
    (500, "EngineCore encountered an issue.", (502, "engine_error", "server_error")),
])
def test_engine_errors_become_openai_errors(status: int, message: str,
                                            expected: tuple[int, str, str]) -> None:
    body = orjson.dumps({"error": {"message": message, "type": "BadRequestError",
                                   "param": None, "code": status}})

    error = from_engine(status, body)

    assert (error.status, error.code, error.kind) == expected
    assert set(orjson.loads(error.body())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("message", "readable"), [
    ("1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field "
     "required', 'input': '<dict of 2 items>'}", "Invalid request: messages: Field required."),
    ("2 validation errors:\n  {'type': 'float_parsing', 'loc': 'body.temperature', 'msg': "
     "'Input should be a valid number, unable to parse string as a number', 'input': 'hot'}\n"
     "  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': "
     "'<dict of 3 items>'}",
     "Invalid request: temperature: Input should be a valid number, unable to parse string as "
     "a number; messages: Field required."),
    ("You passed 2049 input tokens and requested 1 output tokens. However, the model's context "
     "length is only 2048 tokens. (parameter=input_tokens, value=2049)",
     "You passed 2049 input tokens and requested 1 output tokens. However, the model's context "
     "length is only 2048 tokens."),
    # vLLM's own checks put the exception in ctx, which is no literal.
    ("1 validation error:\n  {'type': 'value_error', 'loc': 'body.n', 'msg': 'Value error, n "
     "must be at least 1, got 0. (parameter=n, value=0)', 'input': 0, 'ctx': {'error': "
     "ValueError('n must be at least 1, got 0.')}}",
     "Invalid request: n: Value error, n must be at least 1, got 0."),
    ("1 validation error:\n  ...and 3 more errors", "Invalid request: ...and 3 more errors."),
    ("1 validation error:\n  " + "[" * 3000 + "]" * 3000, None),  # too deep to read: as it is
    ("1 validation error:", "1 validation error:"),
])
def test_engine_refusals_read_as_a_person_would_write_them(message: str,
                                                           readable: str | None) -> None:
    body = orjson.dumps({"error": {"message": message, "type": "Bad Request",
                                   "param": "messages", "code": 400}})

    shown = from_engine(400, body).message

    assert shown == readable if readable else len(shown) <= LONGEST_MESSAGE + 100


def test_a_long_engine_message_is_cut_before_it_is_read() -> None:
    # A request's own text echoed back, spaces and all: what is read is bounded.
    message = "bad key 'x" + " " * 400_000 + "' (parameter=logit_bias"
    body = orjson.dumps({"error": {"message": message, "code": 400}})

    shown = from_engine(400, body).message

    assert len(shown) == LONGEST_MESSAGE + 1 and shown.endswith("…")


def test_an_engine_error_that_is_not_json_still_has_a_message() -> None:
    error = from_engine(502, b"<html>Bad gateway</html>")

    assert error.status == 502 and "Bad gateway" in error.message
