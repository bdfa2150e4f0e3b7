"""The gateway's limits and error mapping, directly against Redis and vLLM's error bodies."""

import asyncio
import time
from uuid import uuid4

import orjson
import pytest
from django.conf import settings
from redis.asyncio import Redis

from accounts.principals import KeyIdentity
from gateway.errors import GatewayError, from_engine
from gateway.limits import (
    COUNTER_TTL_MS,
    STALE_AFTER_MS,
    WINDOW_MS,
    Limiter,
    counter_names,
    in_flight_name,
    seconds_until_room,
)


def identity(**limits: int) -> KeyIdentity:
    return KeyIdentity(id=uuid4(), organization_id=uuid4(), scope="inference", expires_at=None,
                       revoked=False, **limits)


def admit_all(key: KeyIdentity, times: int, now_ms: int) -> list[int]:
    async def run() -> list[int]:
        redis = Redis.from_url(settings.REDIS_URL)
        limiter = Limiter(redis)
        statuses = []
        for number in range(times):
            try:
                await limiter.admit(identity=key, request_id=f"r{number}", now_ms=now_ms)
                statuses.append(200)
            except GatewayError as error:
                statuses.append(error.status)
        await redis.aclose()
        return statuses
    return asyncio.run(run())


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


def test_the_request_limit_counts_this_and_last_minute() -> None:
    key = identity(requests_per_minute=4)
    minute = (int(time.time() * 1000) // WINDOW_MS + 10) * WINDOW_MS  # a clean window

    assert admit_all(key, 5, minute) == [200, 200, 200, 200, 429]
    # Half-way through the next minute the last one still weighs 2 of its 4.
    assert admit_all(key, 3, minute + WINDOW_MS + WINDOW_MS // 2) == [200, 200, 429]


def test_a_slot_held_by_a_dead_gateway_expires() -> None:
    key = identity(max_concurrent_requests=1)
    now = int(time.time() * 1000)
    assert admit_all(key, 2, now) == [200, 429]

    assert admit_all(key, 1, now + STALE_AFTER_MS + 1) == [200]


def test_no_limit_means_no_counting() -> None:
    key = identity()
    assert admit_all(key, 3, int(time.time() * 1000)) == [200, 200, 200]

    async def held() -> int:
        redis = Redis.from_url(settings.REDIS_URL)
        count = await redis.zcard(in_flight_name(key.organization_id))
        await redis.aclose()
        return count
    assert asyncio.run(held()) == 0


def test_a_release_gives_the_slot_back_and_counts_the_tokens_in_the_admitted_window() -> None:
    key = identity(tokens_per_minute=100, max_concurrent_requests=1)
    now = int(time.time() * 1000)

    async def admit_and_release() -> tuple[int, int, int]:
        redis = Redis.from_url(settings.REDIS_URL)
        admission = await Limiter(redis).admit(identity=key, request_id="r1", now_ms=now)
        pipe = redis.pipeline(transaction=False)
        admission.release(pipe, tokens=11)
        await pipe.execute()
        tokens_counter = counter_names(key, now // WINDOW_MS)[2]
        held = await redis.zcard(in_flight_name(key.organization_id))
        tokens = int(await redis.get(tokens_counter))
        ttl = await redis.pttl(tokens_counter)
        await redis.aclose()
        return held, tokens, ttl

    held, tokens, ttl = asyncio.run(admit_and_release())

    assert (held, tokens) == (0, 11)
    assert 0 < ttl <= COUNTER_TTL_MS


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


def test_an_engine_error_that_is_not_json_still_has_a_message() -> None:
    error = from_engine(502, b"<html>Bad gateway</html>")

    assert error.status == 502 and "Bad gateway" in error.message
