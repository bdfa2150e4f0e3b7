"""An ASGI middleware that vLLM's API server loads (`--middleware`) so that every path, not
only `/v1`, demands the engine's key: vLLM itself checks `VLLM_API_KEY` under `/v1` alone,
and `/invocations`, `/tokenize`, `/metrics` and others answer anyone who reaches the port.
`/health` stays open for liveness checks. Pure Python; the engine's process imports it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

OPEN_PATHS = frozenset({"/health"})
REFUSED = (b'{"error": {"message": "This engine needs its key.", "type": '
           b'"invalid_api_key", "code": 401}}')

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RequireEngineKey:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.expected = f"Bearer {os.environ.get('VLLM_API_KEY', '')}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": REFUSED})
