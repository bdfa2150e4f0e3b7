"""An engine's answer as the gateway reads it: a whole body within the gateway's limit, or a
stream of server-sent event lines, each line's wait counted as the engine's time."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
from django.conf import settings

from gateway.asgi import Send, response_headers
from gateway.errors import GatewayError
from gateway.exchange import Exchange

EVENT_STREAM = (b"content-type", b"text/event-stream")


class AnswerTooLarge(Exception):
    """One line of an engine's stream is longer than the gateway holds in memory."""


async def read_within(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body; None as soon as it is longer than `limit` bytes."""
    parts, size = [], 0
    async for part in content.iter_any():
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)


async def engine_lines(exchange: Exchange, response: aiohttp.ClientResponse
                       ) -> AsyncIterator[bytes]:
    """The stream's lines as they arrive; ends with the stream, or where the client has left
    and the stream broke. Raises GatewayError (502) for a stream that broke, or a line longer
    than KVRUN_GATEWAY_MAX_ANSWER_BYTES."""
    limit = settings.KVRUN_GATEWAY_MAX_ANSWER_BYTES
    lines = _lines(response.content, limit)
    while True:
        waited = time.perf_counter()
        try:
            line = await lines.__anext__()
        except StopAsyncIteration:
            return
        except AnswerTooLarge:
            response.close()
            raise too_large(limit, "stream has an event that",
                            "ask for less in each chunk (n, logprobs)") from None
        except (aiohttp.ClientError, TimeoutError):
            if exchange.disconnected:
                return
            raise GatewayError(502, "The engine stopped answering in mid-stream; the text so "
                               "far is all there is.", code="engine_error") from None
        finally:
            exchange.upstream_seconds += time.perf_counter() - waited
        yield line


async def start_stream(exchange: Exchange, send: Send) -> None:
    """The stream's response headers, unless a hold for a cold start has sent them."""
    if not exchange.response_started:
        exchange.response_started = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": response_headers(exchange, [EVENT_STREAM,
                                                           (b"cache-control", b"no-cache")])})


def ended_early() -> GatewayError:
    return GatewayError(502, "The engine ended the stream early.", code="engine_error")


def too_large(limit: int, what: str, advice: str) -> GatewayError:
    return GatewayError(502, f"The engine's {what} is larger than the gateway's limit of "
                        f"{limit} bytes; {advice}.", code="answer_too_large")


async def _lines(content: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The stream's lines, each as long as it is up to `limit` bytes (aiohttp's own readline
    gives up at 128 KiB, which one event of a long answer with logprobs can pass)."""
    pending = bytearray()
    async for part in content.iter_any():
        pending += part
        if b"\n" in part:
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield bytes(line)
        if len(pending) > limit:
            raise AnswerTooLarge
    if pending:
        yield bytes(pending)
