"""`Idempotency-Key`: a request repeated with the same key does not run (or bill) again.

The first request with a key reserves it in Redis (SET NX). While it runs, a repeat is a 409.
When it succeeds, a non-streamed answer is kept and a repeat gets it again, marked with
`x-kvrun-idempotent-replay`; a streamed one cannot be replayed, so a repeat is a 409 naming
the first request. When it fails, the key is released so that the client's retry runs.
"""

from __future__ import annotations

import hashlib

import orjson
from redis.asyncio import Redis

from gateway.errors import GatewayError

MAX_KEY_LENGTH = 255


def _name(organization_id: object, key: str) -> str:
    return f"kvrun:idem:{organization_id}:{hashlib.sha256(key.encode()).hexdigest()}"


def validate(key: str) -> str:
    if len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise GatewayError(400, f"Idempotency-Key must be at most {MAX_KEY_LENGTH} printable "
                           "characters.", code="invalid_request", param="Idempotency-Key")
    return key


class Idempotency:
    def __init__(self, redis: Redis, *, ttl_seconds: int) -> None:
        self._redis = redis
        self._ttl = ttl_seconds

    async def reserve(self, *, organization_id: object, key: str, request_id: str) -> bytes | None:
        """Reserve `key` for this request. Returns a stored answer to replay, or None when
        the request should run; raises 409 while the first request runs or after a stream."""
        name = _name(organization_id, key)
        claim = orjson.dumps({"state": "running", "request_id": request_id})
        if await self._redis.set(name, claim, nx=True, ex=self._ttl):
            return None
        held = await self._redis.get(name)
        first = orjson.loads(held) if held else {"state": "running", "request_id": "unknown"}
        if first["state"] == "done" and first.get("body") is not None:
            return first["body"].encode()
        doing = "is still running" if first["state"] == "running" else "was streamed"
        raise GatewayError(409, f"A request with this Idempotency-Key ({first['request_id']}) "
                           f"{doing}; it runs only once. Send a new Idempotency-Key to run "
                           "another request.", code="idempotency_key_reused",
                           param="Idempotency-Key")

    async def settle(self, *, organization_id: object, key: str, request_id: str,
                     succeeded: bool, body: bytes | None) -> None:
        """Keep the outcome of a successful request; release the key of a failed one."""
        name = _name(organization_id, key)
        if not succeeded:
            await self._redis.delete(name)
            return
        outcome = {"state": "done", "request_id": request_id,
                   "body": body.decode() if body is not None else None}
        await self._redis.set(name, orjson.dumps(outcome), ex=self._ttl)
