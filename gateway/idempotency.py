"""`Idempotency-Key`: a request repeated with the same key does not run (or bill) again.

A key belongs to the API key that sent it and the endpoint it names, and it remembers a
digest of the request body: the same key with another body is a 422, never someone else's
answer. The first request reserves the key in Redis (SET NX) as a lease that its gateway
renews while it runs (the usage sink), so the key of a request whose gateway died is free
again within a minute; while it runs, a repeat is a 409. When it succeeds, a non-streamed
answer of up to MAX_KEPT_BYTES is kept for KVRUN_IDEMPOTENCY_HOURS and a repeat gets it
again, marked with `x-kvrun-idempotent-replay`; a streamed or larger answer is not kept, so
a repeat is a 409 naming the first request. When it fails, the key is released so that the
client's retry runs.

The answers kept share the Redis that carries the broker and the usage stream, so each
organisation keeps at most KVRUN_IDEMPOTENCY_KEPT_MIB_PER_ORGANIZATION of them a window of
KVRUN_IDEMPOTENCY_HOURS, and all of them together KVRUN_IDEMPOTENCY_KEPT_MIB, counted in the
same atomic step that keeps one: an answer past either is not kept (a repeat is a 409 that
says so). A kept answer outlives its window by at most one more, so kept answers never hold
more than twice a budget.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from billing.usage_stream import lease_ms
from gateway.errors import GatewayError

MAX_KEY_LENGTH = 255
# Answers are kept in the Redis that also carries the broker and the usage ledger: a bound
# on each, well above an ordinary completion's few kilobytes.
MAX_KEPT_BYTES = 64 * 1024
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# The outcome replaces the claim only while it is this request's: a request whose lease ran
# out must not free (or answer for) the retry that took the key since. An answer (ARGV[4]
# bytes) is kept only while its organisation's window (KEYS[2]) and every organisation's
# together (KEYS[3]) stay within their budgets (ARGV[5], ARGV[7]); else the outcome without
# it (ARGV[6]) is.
SETTLE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('DEL', KEYS[1]) end
local size = tonumber(ARGV[4])
if size > 0 then
  local over = false
  for index, budget in ipairs({ARGV[5], ARGV[7]}) do
    local used = redis.call('INCRBY', KEYS[index + 1], size)
    if used == size then redis.call('EXPIRE', KEYS[index + 1], 2 * tonumber(ARGV[3])) end
    if used > tonumber(budget) then over = true end
  end
  if over then
    redis.call('DECRBY', KEYS[2], size)
    redis.call('DECRBY', KEYS[3], size)
    return redis.call('SET', KEYS[1], ARGV[6], 'EX', ARGV[3])
  end
end
return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
"""


def validate(key: str) -> str:
    if len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise GatewayError(400, f"Idempotency-Key must be at most {MAX_KEY_LENGTH} printable "
                           "characters.", code="invalid_request", param="Idempotency-Key")
    return key


@dataclass(frozen=True)
class Claim:
    """One request's hold on an Idempotency-Key."""

    name: str
    organization_id: str
    request_id: str
    body_digest: str

    @classmethod
    def of(cls, *, organization_id: object, api_key_id: object, endpoint_id: str, key: str,
           body: bytes, request_id: str, anthropic: bool = False) -> Claim:
        # An Anthropic request's key is its own: its body may be an OpenAI chat's too, and
        # the answer kept for one would be replayed to the other in the wrong shape.
        scope = hashlib.sha256(f"{api_key_id}:{endpoint_id}:{key}".encode()
                               + (b":messages" if anthropic else b"")).hexdigest()
        return cls(name=f"kvrun:idem:{scope}", organization_id=str(organization_id),
                   request_id=request_id, body_digest=hashlib.sha256(body).hexdigest())

    def running(self) -> bytes:
        return orjson.dumps({"state": "running", "request_id": self.request_id,
                             "body_digest": self.body_digest})

    def renew(self, pipe: Pipeline) -> None:
        """Queue on `pipe` the renewal of the running request's lease; a no-op once the
        request has settled, whichever reaches Redis first."""
        pipe.eval(RENEW, 1, self.name, self.running(), lease_ms())


class Idempotency:
    def __init__(self, redis: Redis, *, ttl_seconds: int, kept_bytes_per_organization: int,
                 kept_bytes_in_all: int) -> None:
        self._redis = redis
        self._ttl_seconds = ttl_seconds
        self._kept_bytes_per_organization = kept_bytes_per_organization
        self._kept_bytes_in_all = kept_bytes_in_all
        self._settle = redis.register_script(SETTLE)

    async def reserve(self, claim: Claim) -> bytes | None:
        """Reserve the key for this request. Returns a kept answer to replay, or None when
        the request should run; raises 409 while the first request runs or when its answer
        was not kept, and 422 when the first request had another body."""
        if await self._redis.set(claim.name, claim.running(), nx=True, px=lease_ms()):
            return None
        held = await self._redis.get(claim.name)
        if held is None:  # the first one ended and freed the key just now
            return await self.reserve(claim)
        first: dict[str, Any] = orjson.loads(held)
        if first["body_digest"] != claim.body_digest:
            raise GatewayError(422, f"This Idempotency-Key was used by request "
                               f"{first['request_id']} with a different body; a key stands "
                               "for one request. Send a new Idempotency-Key for a new request.",
                               code="idempotency_key_reused", param="Idempotency-Key")
        if first["state"] == "done" and first["body"] is not None:
            return first["body"].encode()
        if first["state"] == "running":
            doing = "is still running"
        elif first["streamed"]:
            doing = "was streamed, and a stream cannot be replayed"
        elif first.get("past_budget"):
            doing = ("succeeded, but its answer was not kept: kept answers (this "
                     "organisation's, or every one's) were at their budget")
        else:
            doing = f"answered more than {MAX_KEPT_BYTES // 1024} KiB, which is not kept"
        raise GatewayError(409, f"A request with this Idempotency-Key ({first['request_id']}) "
                           f"{doing}; it runs only once. Send a new Idempotency-Key to run "
                           "another request.", code="idempotency_key_reused",
                           param="Idempotency-Key")

    async def settle(self, claim: Claim, *, succeeded: bool, answer: bytes | None) -> None:
        """Keep what a repeat will get: the answer of a successful request (None when it
        was streamed), or the key freed when the request failed or never ran."""
        outcome = without = b""
        kept = None
        if succeeded:
            kept = (answer.decode() if answer is not None and len(answer) <= MAX_KEPT_BYTES
                    else None)
            done = {"state": "done", "request_id": claim.request_id,
                    "body_digest": claim.body_digest, "streamed": answer is None}
            outcome = orjson.dumps({**done, "body": kept})
            without = orjson.dumps({**done, "body": None, "past_budget": True})
        window = int(time.time()) // self._ttl_seconds
        await self._settle(
            keys=[claim.name, f"kvrun:idem-kept:{claim.organization_id}:{window}",
                  f"kvrun:idem-kept:all:{window}"],
            args=[claim.running(), outcome, self._ttl_seconds,
                  len(answer) if kept is not None and answer is not None else 0,
                  self._kept_bytes_per_organization, without, self._kept_bytes_in_all])
