"""Raw ASGI for the gateway: reading a request, writing a response, and the headers that
every answer carries."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from django.conf import settings

from gateway.errors import GatewayError
from gateway.exchange import Exchange
from kvrun.common.middleware import body_too_large_message

ASGIScope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON = (b"content-type", b"application/json")


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


def header(scope: ASGIScope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


def require_method(method: str, allowed: str) -> None:
    if method != allowed:
        raise GatewayError(405, f"Use {allowed} on this path.", code="method_not_allowed",
                           headers=[(b"allow", allowed.encode())])


async def read_body(scope: ASGIScope, receive: Receive) -> bytes:
    """The whole request body; 413 as soon as it is known to be over the limit."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    too_large = GatewayError(413, body_too_large_message(limit), code="request_too_large")
    declared = header(scope, b"content-length")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
        if not message.get("more_body"):
            return b"".join(parts)


def response_headers(exchange: Exchange,
                     extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`extra`, then the request id, the gateway's overhead, how long the request waited for
    a cold start (a stream is told in its comment lines) and the rate-limit headers."""
    headers = [*extra, (b"x-request-id", exchange.request_id.encode()),
               (b"x-kvrun-overhead-ms", f"{exchange.overhead_ms():.3f}".encode())]
    if exchange.held_seconds:
        headers.append((b"x-kvrun-cold-start-ms", f"{exchange.held_seconds * 1000:.0f}".encode()))
    if exchange.admission is not None:
        headers += exchange.admission.headers
    return headers


async def respond(send: Send, exchange: Exchange, status: int, body: bytes,
                  extra: list[tuple[bytes, bytes]]) -> None:
    headers = response_headers(exchange, [*extra, (b"content-length", str(len(body)).encode())])
    exchange.response_started = True
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, exchange: Exchange, error: GatewayError) -> None:
    """The error as the response or, where a stream has had its headers already (one held
    for a cold start), as its last event before [DONE]: either way the client reads it."""
    anthropic = exchange.anthropic
    if not exchange.response_started:
        await respond(send, exchange, error.status,
                      error.anthropic_body(exchange.request_id) if anthropic else error.body(),
                      [JSON, *error.headers])
    elif exchange.stream and anthropic:
        await send({"type": "http.response.body", "more_body": False,
                    "body": error.anthropic_event(exchange.request_id)})
    elif exchange.stream:
        await send({"type": "http.response.body", "more_body": False,
                    "body": b"data: " + orjson.dumps({"error": error.as_dict()})
                    + b"\n\ndata: [DONE]\n\n"})
