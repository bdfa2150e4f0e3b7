"""Anthropic's Messages API (`POST /v1/messages`), which vLLM serves beside OpenAI's: its
usage in the ledger's terms and the relay of its event stream (its errors' shape:
GatewayError.anthropic_body).

Requests go through the same admission, limits, cache salt, holds and metering as chat;
only what the client reads differs. The stream's usage comes whole in its `message_delta`
event only: until then each content delta the client receives counts as one token, so a
crash bills at least what the client got (a delta holds one token or more).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from gateway.asgi import Send, response_headers
from gateway.errors import GatewayError, engine_message
from gateway.exchange import Exchange
from gateway.sink import UsageSink
from gateway.streams import EVENT_STREAM, ended_early, engine_lines


def ledger_usage(usage: object) -> dict[str, Any] | None:
    """Anthropic's usage as the ledger counts it (Exchange.take_usage): the prompt is its
    input, cache read and cache creation tokens together, as vLLM splits them."""
    if not isinstance(usage, dict):
        return None
    parts = [usage.get(name) or 0 for name in ("input_tokens", "cache_read_input_tokens",
                                               "cache_creation_input_tokens")]
    whole = all(isinstance(part, int) and not isinstance(part, bool) for part in parts)
    return {"prompt_tokens": sum(parts) if whole else usage.get("input_tokens"),
            "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": {"cached_tokens": usage.get("cache_read_input_tokens")
                                      or 0}}


async def relay_stream(exchange: Exchange, response: aiohttp.ClientResponse, send: Send,
                       sink: UsageSink) -> None:
    """Pass the engine's events through as they arrive. The trace (UsageSink.write_ahead)
    holds the prompt from `message_start` and a token a content delta before the client
    has the delta, and the engine's own count from `message_delta`, which ends the answer."""
    if not exchange.response_started:
        exchange.response_started = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": response_headers(exchange, [EVENT_STREAM,
                                                           (b"cache-control", b"no-cache")])})
    failure: GatewayError | None = None
    stopped = False
    received = 0  # content deltas sent to the client
    reported: dict[str, Any] = {}
    try:
        async for line in engine_lines(exchange, response):
            if line.startswith(b"data: "):
                try:
                    event = orjson.loads(line[6:])
                    kind = event["type"]
                except (ValueError, TypeError, KeyError):
                    failure = GatewayError(502, "The engine sent an event that is not one of "
                                           "Anthropic's; the text so far is all there is.",
                                           code="engine_error")
                    break
                if kind == "message_start":
                    reported = ledger_usage((event.get("message") or {}).get("usage")) or {}
                elif kind == "message_delta":
                    reported = ledger_usage(event.get("usage")) or reported
                elif kind == "content_block_delta":
                    received += 1
                    exchange.mark_first_token()
                elif kind == "message_stop":
                    stopped = True
                elif kind == "error":
                    detail = event.get("error") or {}
                    refused = engine_message(500, str(detail.get("message")))
                    exchange.status, exchange.error_code = refused.status, refused.code or ""
                if reported:
                    counted = reported.get("completion_tokens")
                    exchange.take_usage({**reported, "completion_tokens": max(
                        counted if isinstance(counted, int) else 0, received)})
                if kind in ("message_start", "content_block_delta", "message_delta"):
                    await sink.write_ahead(exchange, last=kind == "message_delta")
            await send({"type": "http.response.body", "body": line + b"\n", "more_body": True})
    except GatewayError as broken:
        failure = broken
    if failure is None and not stopped and not exchange.disconnected and not (
            exchange.error_code):
        failure = ended_early()
    if failure is not None:
        exchange.status, exchange.error_code = failure.status, failure.code or ""
        await send({"type": "http.response.body", "body": failure.anthropic_event(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
