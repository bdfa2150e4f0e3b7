"""The floor for any gateway in Python on this machine, for the gateway benchmark: a bare ASGI
app that forwards each request's bytes to one upstream and relays the answer's bytes as they
come, with the gateway's own HTTP client settings (aiohttp, an unbounded pool of kept
connections, TLS to the upstream) under the same server. No keys, no limits, no metering,
no parsing.

    FLOOR_UPSTREAM=https://127.0.0.1:P python -m uvicorn bench.floor_forwarder:app --port Q

The upstream's certificate is not checked: a check is made once per pooled connection, so
its cost is not a request's, and the floor needs none of kvrun's authority.
"""

import os
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

UPSTREAM = os.environ.get("FLOOR_UPSTREAM", "")
_session: aiohttp.ClientSession | None = None


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    global _session
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                context = ssl.create_default_context()
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                    limit=0, ssl=context))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if _session is not None:
                    await _session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http" or _session is None:
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    async with _session.post(f"{UPSTREAM}{scope['path']}", data=body,
                             headers={"content-type": "application/json"}) as response:
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type",
                                 response.headers.get("content-type", "").encode())]})
        async for chunk in response.content.iter_any():
            await send({"type": "http.response.body", "body": chunk,
                        "more_body": True})
    await send({"type": "http.response.body", "body": b""})
