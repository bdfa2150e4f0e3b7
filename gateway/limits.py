"""Per-key requests and tokens per minute, and per-organisation requests in flight, in Redis.

One Lua script checks all three, takes the request's share of each, traces the request
for the usage ledger (billing.usage_stream) and counts it in its endpoint's activity
(scaling.activity), atomically and in the one round trip admission
costs, so gateways on many hosts share the limits exactly. Minutes are sliding windows (this
minute's count plus the last minute's, weighted by how much of it still overlaps).

Tokens are reserved at admission, as many as the request may consume (gateway.protocol), so
that requests running at once cannot together pass the limit; its release settles the
reservation against what it really used. In-flight slots are leases: the gateway holding one
renews it (the usage sink), and a slot not renewed for a lease (usage_stream.lease_ms), whose
gateway died, no longer counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from uuid import UUID

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from accounts.principals import KeyIdentity
from billing.usage_stream import ADMITTED, ADMITTED_SEEN, lease_ms
from gateway.errors import GatewayError
from scaling import activity

WINDOW_MS = 60_000
COUNTER_TTL_MS = 2 * WINDOW_MS

ADMIT = """
local now = tonumber(ARGV[1])
local rpm, tpm, concurrent = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local overlap = tonumber(ARGV[5]) / 1000000
local request_id, reserve = ARGV[6], tonumber(ARGV[7])
local lease, counter_ttl = tonumber(ARGV[8]), tonumber(ARGV[9])
local rc = tonumber(redis.call('GET', KEYS[1]) or '0')
local rp = tonumber(redis.call('GET', KEYS[2]) or '0')
local tc = tonumber(redis.call('GET', KEYS[3]) or '0')
local tp = tonumber(redis.call('GET', KEYS[4]) or '0')
if rpm > 0 and rc + rp * overlap + 1 > rpm then return {1, rc, rp, tc, tp, 0} end
if tpm > 0 and tc + tp * overlap + reserve > tpm then return {2, rc, rp, tc, tp, 0} end
local in_flight = 0
if concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - lease)
  in_flight = redis.call('ZCARD', KEYS[5])
  if in_flight >= concurrent then return {3, rc, rp, tc, tp, in_flight} end
  redis.call('ZADD', KEYS[5], now, request_id)
  redis.call('PEXPIRE', KEYS[5], lease)
  in_flight = in_flight + 1
end
if rpm > 0 then
  rc = redis.call('INCR', KEYS[1])
  if rc == 1 then redis.call('PEXPIRE', KEYS[1], counter_ttl) end
end
if tpm > 0 then
  tc = redis.call('INCRBY', KEYS[3], reserve)
  redis.call('PEXPIRE', KEYS[3], counter_ttl)
end
redis.call('HSET', KEYS[7], request_id, ARGV[10])
redis.call('ZADD', KEYS[6], now, request_id)
redis.call('ZADD', KEYS[8], now, request_id)
redis.call('PEXPIRE', KEYS[8], lease)
redis.call('SET', KEYS[9], now, 'PX', tonumber(ARGV[11]))
return {0, rc, rp, tc, tp, in_flight}
"""

ALLOWED, REQUESTS, TOKENS, CONCURRENCY = 0, 1, 2, 3


def counter_name(identity: KeyIdentity, kind: str, window: int) -> str:
    """The key's count of `kind` ("req" or "tok") in minute `window`."""
    return f"kvrun:rl:{identity.id}:{kind}:{window}"


def in_flight_name(organization_id: UUID | str) -> str:
    return f"kvrun:inflight:{organization_id}"


@dataclass(frozen=True)
class Admission:
    """A request let in: its rate-limit headers and its hold on the limits."""

    request_id: str
    identity: KeyIdentity
    headers: list[tuple[bytes, bytes]]
    window: int  # the minute it was admitted in
    reserved_tokens: int  # 0 when the key has no token limit
    in_flight_set: str | None
    endpoint_id: str  # empty when Redis was unreachable at admission: nothing to give back

    def renew(self, pipe: Pipeline, *, now_ms: int) -> None:
        """Queue on `pipe` the renewal of the request's in-flight leases."""
        endpoint_in_flight = activity.in_flight_name(self.endpoint_id) if self.endpoint_id else None
        for name in filter(None, (self.in_flight_set, endpoint_in_flight)):
            pipe.zadd(name, {self.request_id: now_ms}, xx=True)
            # The set lives as long as a lease from its last renewal, or its slots would go
            # with it while their requests still run.
            pipe.pexpire(name, lease_ms())

    def release(self, pipe: Pipeline, *, tokens: int, now_ms: int) -> None:
        """Queue on `pipe` the end of the request's hold: its in-flight slot given back, its
        end as its endpoint's last request (idle time counts from there: a long generation is
        not idle), and its reservation settled against the `tokens` it used. While the minute
        it was admitted in still counts, the difference goes there; after that a request that
        used more than it reserved has the excess counted in the current minute."""
        if self.in_flight_set:
            pipe.zrem(self.in_flight_set, self.request_id)
        if self.endpoint_id:
            pipe.zrem(activity.in_flight_name(self.endpoint_id), self.request_id)
            pipe.set(activity.last_request_name(self.endpoint_id), now_ms,
                     px=activity.LAST_REQUEST_TTL_MS)
        if not self.reserved_tokens:
            return
        difference = tokens - self.reserved_tokens
        window = now_ms // WINDOW_MS
        if window <= self.window + 1:
            window = self.window
        else:
            difference = max(0, difference)
        counter = counter_name(self.identity, "tok", window)
        if difference:
            pipe.incrby(counter, difference)
            pipe.pexpire(counter, COUNTER_TTL_MS)


def seconds_until_room(*, current: int, previous: int, limit: int, elapsed_ms: int,
                       needed: int = 1) -> int:
    """Whole seconds until a sliding-window count first leaves room for `needed` more
    units, if nothing else arrives meanwhile."""
    room = limit - needed
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

    async def admit(self, *, identity: KeyIdentity, endpoint_id: str, request_id: str,
                    now_ms: int, tokens: int, trace: bytes) -> Admission:
        """Take a slot for the request and reserve its `tokens`, leave its `trace` (the
        encoded report of the request as if interrupted) for the usage ledger and count it in
        flight to its endpoint; or raise a 429 that says which limit and when to retry."""
        window, elapsed = divmod(now_ms, WINDOW_MS)
        overlap = (WINDOW_MS - elapsed) * 1_000_000 // WINDOW_MS
        rpm, tpm = identity.requests_per_minute, identity.tokens_per_minute
        concurrent = identity.max_concurrent_requests
        # A request may take a whole minute's tokens, never more: it must be admissible once
        # the window is empty.
        reserve = min(tokens, tpm)
        in_flight = in_flight_name(identity.organization_id)
        endpoint_in_flight = activity.in_flight_name(endpoint_id)
        verdict, rc, rp, tc, tp, busy = await self._admit(
            keys=[counter_name(identity, "req", window), counter_name(identity, "req", window - 1),
                  counter_name(identity, "tok", window), counter_name(identity, "tok", window - 1),
                  in_flight, ADMITTED_SEEN, ADMITTED, endpoint_in_flight,
                  activity.last_request_name(endpoint_id)],
            args=[now_ms, rpm, tpm, concurrent, overlap, request_id, reserve, lease_ms(),
                  COUNTER_TTL_MS, trace, activity.LAST_REQUEST_TTL_MS])
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
            return Admission(request_id=request_id, identity=identity, headers=headers,
                             window=window, reserved_tokens=reserve if tpm else 0,
                             in_flight_set=in_flight if concurrent else None,
                             endpoint_id=endpoint_id)
        if verdict == REQUESTS:
            wait = seconds_until_room(current=rc, previous=rp, limit=rpm, elapsed_ms=elapsed)
            message = (f"This API key's limit of {rpm} requests per minute is used up; retry "
                       f"in {wait} s, or ask an admin to raise the key's requests_per_minute.")
            kind = "requests"
        elif verdict == TOKENS:
            wait = seconds_until_room(current=tc, previous=tp, limit=tpm, elapsed_ms=elapsed,
                                      needed=reserve)
            room = max(0, tpm - math.ceil(tc + tp * weight))
            message = (f"This API key's limit of {tpm} tokens per minute has room for {room} "
                       f"now, and this request may use {reserve} (its prompt and max_tokens, "
                       f"or the endpoint's whole context when max_tokens is not set). Retry "
                       f"in {wait} s, set a lower max_tokens, or ask an admin to raise the "
                       "key's tokens_per_minute.")
            kind = "tokens"
        else:
            wait = 1
            message = (f"Your organisation already has {busy} requests in flight, its limit; "
                       "retry when one finishes, or send fewer at once.")
            kind = "requests"
        raise GatewayError(429, message, code="rate_limit_exceeded", kind=kind,
                           headers=[(b"retry-after", str(wait).encode()), *headers])
