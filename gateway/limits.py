"""Per-key requests and tokens per minute, and per-organisation requests in flight, in Redis.

One Lua script checks all three and takes a request slot atomically, so gateways on many
hosts share the limits exactly. Minutes are sliding windows (this minute's count plus the
last minute's, weighted by how much of it still overlaps). Tokens are known only when a
request ends: its Admission's release adds them then (the usage sink sends that release in
its next pipeline), and a key may start new requests while its window has room. In-flight
slots carry their start time, so a slot held by a gateway that died is dropped after
`STALE_AFTER_MS` instead of blocking the organisation for ever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from accounts.principals import KeyIdentity
from gateway.errors import GatewayError

WINDOW_MS = 60_000
COUNTER_TTL_MS = 2 * WINDOW_MS
STALE_AFTER_MS = 15 * WINDOW_MS

ADMIT = """
local now = tonumber(ARGV[1])
local rpm, tpm, concurrent = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local overlap = tonumber(ARGV[5]) / 1000000
local rc = tonumber(redis.call('GET', KEYS[1]) or '0')
local rp = tonumber(redis.call('GET', KEYS[2]) or '0')
local tc = tonumber(redis.call('GET', KEYS[3]) or '0')
local tp = tonumber(redis.call('GET', KEYS[4]) or '0')
if rpm > 0 and rc + rp * overlap + 1 > rpm then return {1, rc, rp, tc, tp, 0} end
if tpm > 0 and tc + tp * overlap >= tpm then return {2, rc, rp, tc, tp, 0} end
local in_flight = 0
if concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - tonumber(ARGV[7]))
  in_flight = redis.call('ZCARD', KEYS[5])
  if in_flight >= concurrent then return {3, rc, rp, tc, tp, in_flight} end
  redis.call('ZADD', KEYS[5], now, ARGV[6])
  redis.call('PEXPIRE', KEYS[5], tonumber(ARGV[7]))
  in_flight = in_flight + 1
end
if rpm > 0 then
  rc = redis.call('INCR', KEYS[1])
  if rc == 1 then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[8])) end
end
return {0, rc, rp, tc, tp, in_flight}
"""

ALLOWED, REQUESTS, TOKENS, CONCURRENCY = 0, 1, 2, 3


def counter_names(identity: KeyIdentity, window: int) -> tuple[str, str, str, str]:
    key = f"kvrun:rl:{identity.id}"
    return (f"{key}:req:{window}", f"{key}:req:{window - 1}",
            f"{key}:tok:{window}", f"{key}:tok:{window - 1}")


def in_flight_name(organization_id: object) -> str:
    return f"kvrun:inflight:{organization_id}"


@dataclass(frozen=True)
class Admission:
    """A request let in: its rate-limit headers and what its release must undo."""

    request_id: str
    headers: list[tuple[bytes, bytes]]
    tokens_counter: str | None  # where the request's tokens are added when it ends
    in_flight_set: str | None

    def release(self, pipe: Pipeline, *, tokens: int) -> None:
        """Queue on `pipe` the end of the request's hold on the limits: its in-flight slot
        given back, and its tokens counted in the window it was admitted in."""
        if self.in_flight_set:
            pipe.zrem(self.in_flight_set, self.request_id)
        if self.tokens_counter and tokens:
            pipe.incrby(self.tokens_counter, tokens)
            pipe.pexpire(self.tokens_counter, COUNTER_TTL_MS)


def seconds_until_room(*, current: int, previous: int, limit: int, elapsed_ms: int) -> int:
    """Whole seconds until a sliding-window count first leaves room for one more unit,
    if nothing else arrives meanwhile."""
    room = limit - 1
    if current <= room:
        if previous <= 0:
            return 1
        wait_ms = WINDOW_MS * (1 - (room - current) / previous) - elapsed_ms
    else:
        wait_ms = (WINDOW_MS - elapsed_ms) + WINDOW_MS * (1 - room / current)
    return max(1, math.ceil(wait_ms / 1000))


class Limiter:
    def __init__(self, redis: Redis) -> None:
        self._admit = redis.register_script(ADMIT)

    async def admit(self, *, identity: KeyIdentity, request_id: str, now_ms: int) -> Admission:
        """Take a slot for the request, or raise a 429 that says which limit and when to retry."""
        window, elapsed = divmod(now_ms, WINDOW_MS)
        overlap = (WINDOW_MS - elapsed) * 1_000_000 // WINDOW_MS
        req_now, req_before, tok_now, tok_before = counter_names(identity, window)
        in_flight = in_flight_name(identity.organization_id)
        rpm, tpm = identity.requests_per_minute, identity.tokens_per_minute
        concurrent = identity.max_concurrent_requests
        verdict, rc, rp, tc, tp, busy = await self._admit(
            keys=[req_now, req_before, tok_now, tok_before, in_flight],
            args=[now_ms, rpm, tpm, concurrent, overlap, request_id, STALE_AFTER_MS,
                  COUNTER_TTL_MS])
        weight = overlap / 1_000_000
        headers = []
        reset = f"{math.ceil((WINDOW_MS - elapsed) / 1000)}s".encode()
        if rpm:
            used = math.ceil(rc + rp * weight)
            headers += [(b"x-ratelimit-limit-requests", str(rpm).encode()),
                        (b"x-ratelimit-remaining-requests", str(max(0, rpm - used)).encode()),
                        (b"x-ratelimit-reset-requests", reset)]
        if tpm:
            used = math.ceil(tc + tp * weight)
            headers += [(b"x-ratelimit-limit-tokens", str(tpm).encode()),
                        (b"x-ratelimit-remaining-tokens", str(max(0, tpm - used)).encode()),
                        (b"x-ratelimit-reset-tokens", reset)]
        if verdict == ALLOWED:
            return Admission(request_id=request_id, headers=headers,
                             tokens_counter=tok_now if tpm else None,
                             in_flight_set=in_flight if concurrent else None)
        if verdict == REQUESTS:
            wait = seconds_until_room(current=rc, previous=rp, limit=rpm, elapsed_ms=elapsed)
            message = (f"This API key's limit of {rpm} requests per minute is used up; retry "
                       f"in {wait} s, or ask an admin to raise the key's requests_per_minute.")
            kind = "requests"
        elif verdict == TOKENS:
            wait = seconds_until_room(current=tc, previous=tp, limit=tpm, elapsed_ms=elapsed)
            message = (f"This API key's limit of {tpm} tokens per minute is used up; retry in "
                       f"{wait} s, or ask an admin to raise the key's tokens_per_minute.")
            kind = "tokens"
        else:
            wait = 1
            message = (f"Your organisation already has {busy} requests in flight, its limit; "
                       "retry when one finishes, or send fewer at once.")
            kind = "requests"
        raise GatewayError(429, message, code="rate_limit_exceeded", kind=kind,
                           headers=[(b"retry-after", str(wait).encode()), *headers])
