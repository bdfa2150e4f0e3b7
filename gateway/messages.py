"""Anthropic's Messages API (`POST /v1/messages`), which vLLM serves beside OpenAI's: its
usage in the ledger's terms and the relay of its event stream (its errors' shape:
GatewayError.anthropic_body).

Requests go through the same admission, limits, cache salt, holds and metering as chat;
only what the client reads differs. The stream's usage comes whole in its `message_delta`
event only: until then each content delta the client receives counts as one token. A delta
holds one token or more, so a stream cut by a crash may be billed fewer tokens than its
client got (beside the trace's lag, KVRUN_GATEWAY_TRACE_LAG_TOKENS, as for any stream).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from gateway.asgi import Send
from gateway.errors import GatewayError, engine_message
from gateway.exchange import Exchange
from gateway.sink import UsageSink
from gateway.streams import ended_early, engine_lines, start_stream


def ledger_usage(usage: object) -> dict[str, Any]:
    """Anthropic's usage as the ledger counts it (Exchange.take_usage), with only the fields
    it holds: the prompt is its input, cache read and cache creation tokens together, as vLLM
    splits them. A part that is not a whole number of tokens or below zero makes the prompt
    one the ledger refuses (counted as none, and logged), as any impossible figure."""
    if not isinstance(usage, dict):
        return {}
    found: dict[str, Any] = {}
    if "input_tokens" in usage:
        parts = [usage.get(name) or 0 for name in ("input_tokens", "cache_read_input_tokens",
                                                   "cache_creation_input_tokens")]
        found["prompt_tokens"] = sum(parts) if all(
            isinstance(part, int) and not isinstance(part, bool) and part >= 0
            for part in parts) else -1
        found["prompt_tokens_details"] = {"cached_tokens": usage.get("cache_read_input_tokens")
                                          or 0}
    if "output_tokens" in usage:
        found["completion_tokens"] = usage["output_tokens"]
    return found


async def relay_stream(exchange: Exchange, response: aiohttp.ClientResponse, send: Send,
                       sink: UsageSink) -> None:
    """Pass the engine's events through as they arrive, each whole in one write. The trace
    (UsageSink.write_ahead) holds the prompt from `message_start`, and a token for each
    content delta, before the client has the event; `message_delta` brings the engine's own
    count, which is final. An engine's `error` event reaches the client rewritten, as an
    OpenAI stream's error does."""
    await start_stream(exchange, send)
    failure: GatewayError | None = None
    stopped = False
    deltas = 0  # content deltas sent to the client
    reported: dict[str, Any] = {}
    pending: list[bytes] = []
    try:
        async for line in engine_lines(exchange, response):
            pending.append(line)
            if line.strip():
                continue  # an event ends at a blank line
            sent, event, pending = b"\n".join(pending) + b"\n", _event_in(pending), []
            if event is None:
                failure = GatewayError(502, "The engine sent an event that is not one of "
                                       "Anthropic's; the text so far is all there is.",
                                       code="engine_error")
                break
            kind = event["type"]
            if kind in ("message_start", "message_delta"):
                reported.update(ledger_usage(event.get("usage") or (
                    event.get("message") or {}).get("usage")))
            elif kind == "content_block_delta":
                deltas += 1
                exchange.mark_first_token()
            elif kind == "error":
                refused = engine_message(500, str((event.get("error") or {}).get("message")))
                exchange.status, exchange.error_code = refused.status, refused.code or ""
                sent = refused.anthropic_event(exchange.request_id)
            if reported:
                counted = reported.get("completion_tokens", 0)
                final = kind == "message_delta" and "completion_tokens" in reported
                exchange.take_usage({**reported, "completion_tokens": counted if final else max(
                    counted if isinstance(counted, int) else 0, deltas)})
            if kind in ("message_start", "content_block_delta", "message_delta"):
                await sink.write_ahead(exchange, last=kind == "message_delta")
            await send({"type": "http.response.body", "body": sent, "more_body": True})
            if kind in ("message_stop", "error"):
                stopped = True
                break
    except GatewayError as broken:
        failure = broken
    if failure is None and not stopped and not exchange.disconnected:
        failure = ended_early()
    if failure is not None:
        exchange.status, exchange.error_code = failure.status, failure.code or ""
        await send({"type": "http.response.body",
                    "body": failure.anthropic_event(exchange.request_id), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _event_in(lines: list[bytes]) -> dict[str, Any] | None:
    """The event's data, where its lines hold one with a type (a keep-alive comment holds
    none: {"type": ""}); None where they hold one of another shape. An engine runs weights
    its tenant chose, so its events are checked, not trusted."""
    data = [line[6:] for line in lines if line.startswith(b"data: ")]
    if not data:
        return {"type": ""}
    try:
        event = orjson.loads(data[0])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str) or not all(
            isinstance(event.get(name, {}), dict) for name in ("message", "usage", "error")):
        return None
    return event
