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
"""

from __future__ import annotations

import hashlib
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
# out must not free (or answer for) the retry that took the key since.
SETTLE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('DEL', KEYS[1]) end
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
    request_id: str
    body_digest: str

    @classmethod
    def of(cls, *, api_key_id: object, endpoint_id: str, key: str, body: bytes,
           request_id: str) -> Claim:
        scope = hashlib.sha256(f"{api_key_id}:{endpoint_id}:{key}".encode()).hexdigest()
        return cls(name=f"kvrun:idem:{scope}", request_id=request_id,
                   body_digest=hashlib.sha256(body).hexdigest())

    def running(self) -> bytes:
        return orjson.dumps({"state": "running", "request_id": self.request_id,
                             "body_digest": self.body_digest})

    def renew(self, pipe: Pipeline) -> None:
        """Queue on `pipe` the renewal of the running request's lease; a no-op once the
        request has settled, whichever reaches Redis first."""
        pipe.eval(RENEW, 1, self.name, self.running(), lease_ms())


class Idempotency:
    def __init__(self, redis: Redis, *, ttl_seconds: int) -> None:
        self._redis = redis
        self._ttl_seconds = ttl_seconds
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
        else:
            doing = f"answered more than {MAX_KEPT_BYTES // 1024} KiB, which is not kept"
        raise GatewayError(409, f"A request with this Idempotency-Key ({first['request_id']}) "
                           f"{doing}; it runs only once. Send a new Idempotency-Key to run "
                           "another request.", code="idempotency_key_reused",
                           param="Idempotency-Key")

    async def settle(self, claim: Claim, *, succeeded: bool, answer: bytes | None) -> None:
        """Keep what a repeat will get: the answer of a successful request (None when it
        was streamed), or the key freed when the request failed or never ran."""
        outcome = b""
        if succeeded:
            kept = (answer.decode() if answer is not None and len(answer) <= MAX_KEPT_BYTES
                    else None)
            outcome = orjson.dumps({"state": "done", "request_id": claim.request_id,
                                    "body_digest": claim.body_digest, "body": kept,
                                    "streamed": answer is None})
        await self._settle(keys=[claim.name],
                           args=[claim.running(), outcome, self._ttl_seconds])
