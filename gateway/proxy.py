"""Requests to engines and their answers back: the least busy ready replica, the server-sent
event relay, and the client that leaves early, whose engine request is then aborted.

Engines are reached over pooled keep-alive connections (aiohttp). Time spent waiting on the
engine is counted apart, so that the gateway's overhead is its own work only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson
from django.conf import settings

from endpoints.models import CacheIsolation
from gateway import messages, observed
from gateway.affinity import prefix_key
from gateway.asgi import JSON, Receive, Send, respond
from gateway.directory import Upstream, choose_upstream, mark_down
from gateway.errors import GatewayError, engine_message, from_engine
from gateway.exchange import Exchange
from gateway.protocol import ENGINE_PATHS, NOTHING_GENERATED, POOLED
from gateway.sink import UsageSink
from gateway.streams import ended_early, engine_lines, read_within, start_stream, too_large
from kvrun.common.digests import cache_salt

logger = logging.getLogger(__name__)

# Idle engine connections are dropped before the engine would close them (its keep-alive,
# engine.supervisor.KEEP_ALIVE_SECONDS).
POOLED_IDLE_SECONDS = 4
DONE = b"data: [DONE]\n\n"


class Proxy:
    def __init__(self, sink: UsageSink) -> None:
        self.sink = sink
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=POOLED_IDLE_SECONDS),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=settings.KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS,
                sock_read=settings.KVRUN_GATEWAY_UPSTREAM_TIMEOUT_SECONDS),
            auto_decompress=False,
        )

    async def close(self) -> None:
        await self.session.close()

    async def forward(self, exchange: Exchange, payload: dict[str, Any], receive: Receive,
                      send: Send) -> bytes | None:
        """Send the request to a replica and the answer to the client; returns the answer
        body when it was not streamed. The tenant's cache salt (the organisation's, or the
        key's where the endpoint isolates keys) replaces any the client sent, and OpenAI
        streams always carry running usage upstream, for metering (Anthropic's carry theirs
        at their end: gateway.messages)."""
        identity, route = exchange.identity, exchange.route
        assert identity is not None and route is not None
        client_options = payload.get("stream_options") or {}
        salt = cache_salt(identity.organization_id,
                          identity.id if route.cache_isolation == CacheIsolation.KEY else None)
        payload["cache_salt"] = salt
        # Each adapter's prefixes are cached apart (vLLM hashes blocks with the adapter), so
        # each has its own place on the ring; the model's stay where they were.
        ring_salt = f"{salt}:{route.adapter}" if route.adapter else salt
        affinity = (prefix_key(payload, salt=ring_salt)
                    if route.prefix_affinity and len(route.upstreams) > 1 else None)
        anthropic = exchange.anthropic
        if exchange.stream and not anthropic:
            payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        upstream_body = orjson.dumps(payload)
        watcher = asyncio.get_running_loop().create_task(
            _watch_disconnect(receive, exchange, asyncio.current_task()))
        try:
            response = await self._connect(exchange, upstream_body, affinity)
            async with response:
                if exchange.stream and response.status == 200 and anthropic:
                    await messages.relay_stream(exchange, response, send, self.sink)
                    return None
                if exchange.stream and response.status == 200:
                    await _relay_stream(
                        exchange, response, send, self.sink,
                        wants_usage=bool(client_options.get("include_usage")),
                        wants_running=bool(client_options.get("continuous_usage_stats")))
                    return None
                limit = settings.KVRUN_GATEWAY_MAX_ANSWER_BYTES
                waited = time.perf_counter()
                try:
                    body = await read_within(response.content, limit)
                except aiohttp.ClientError:
                    if exchange.disconnected:
                        return None
                    raise GatewayError(502, "The engine dropped the connection before it "
                                       "answered; retry.", code="engine_error") from None
                finally:
                    exchange.upstream_seconds += time.perf_counter() - waited
                if body is None:
                    # Closed, not read to its end: the engine stops sending. Its work is
                    # recorded as far as it can be known without the answer: the prompt.
                    response.close()
                    exchange.take_usage(
                        {"prompt_tokens": await self.count_prompt_tokens(exchange, payload)})
                    raise too_large(limit, "answer", "send fewer inputs at a time, or ask for "
                                    '"encoding_format": "base64"' if exchange.operation in POOLED
                                    else 'stream it ("stream": true) or ask for less '
                                    "(max_tokens, n, logprobs)")
                if response.status != 200:
                    raise from_engine(response.status, body)
                usage = _usage_in(body)
                exchange.take_usage(messages.ledger_usage(usage) if anthropic else usage)
                await self.sink.write_ahead(exchange, last=True)  # billed before delivered
                await respond(send, exchange, 200, body, [JSON])
                return body
        except asyncio.CancelledError:
            if not exchange.disconnected:
                raise
            # The client left while the engine had not answered yet (a non-streamed answer
            # comes whole): the cancelled request closed the engine connection.
            task = asyncio.current_task()
            assert task is not None  # this coroutine runs as a task
            task.uncancel()
            if exchange.response is not None:
                exchange.response.close()
            return None
        finally:
            watcher.cancel()
            exchange.response = None
            if exchange.upstream is not None:
                exchange.upstream.in_flight -= 1

    async def _connect(self, exchange: Exchange, body: bytes, affinity: int | None
                       ) -> aiohttp.ClientResponse:
        """The engine's response headers from the replica its prompt's `affinity` picks, or
        the least busy ready one. A replica that refuses the connection, or does not accept
        it within KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS, was sent nothing: the next one is
        tried. One that refused is passed over for a few seconds; one that was slow, no."""
        route = exchange.route
        assert route is not None
        path = ENGINE_PATHS[exchange.operation]
        tried: set[Upstream] = set()
        slow = False
        while (upstream := choose_upstream(route, tried=tried, key=affinity)) is not None:
            if affinity is not None and not tried and upstream is not route.ring.owner(affinity):
                observed.SPILLS.labels(route.organization_slug, route.endpoint_name).inc()
            tried.add(upstream)
            upstream.in_flight += 1
            upstream.served += 1
            exchange.upstream = upstream
            waited = time.perf_counter()
            try:
                exchange.response = await self.session.post(
                    upstream.base_url + path, data=body, ssl=upstream.ssl_context,
                    server_hostname=upstream.server_hostname,
                    headers={"Authorization": upstream.authorization,
                             "Content-Type": "application/json",
                             "X-Request-Id": exchange.request_id})
            except aiohttp.ClientConnectorError as error:
                if isinstance(error, aiohttp.ClientSSLError):  # not the engine it should be
                    logger.warning("%s: %s refused: %r", exchange.request_id,
                                   upstream.base_url, error)
                upstream.in_flight -= 1
                exchange.upstream = None
                mark_down(upstream)
                continue
            except aiohttp.ConnectionTimeoutError:
                upstream.in_flight -= 1
                exchange.upstream = None
                slow = True
                continue
            except (aiohttp.ClientError, TimeoutError) as error:
                logger.warning("%s: %s failed before it answered: %r", exchange.request_id,
                               upstream.base_url, error)
                raise GatewayError(502, "The engine did not answer; retry.",
                                   code="engine_error") from None
            finally:
                exchange.upstream_seconds += time.perf_counter() - waited
            return exchange.response
        why = (f"accepted the connection within "
               f"{settings.KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS:g} s: it is overloaded" if slow
               else "accepted the request; kvrun is restarting it")
        raise GatewayError(503, f"No replica of {route.name!r} {why}. Retry in a few seconds.",
                           code="engine_unavailable", headers=[(b"retry-after", b"5")])

    async def count_prompt_tokens(self, exchange: Exchange, payload: dict[str, Any]) -> int:
        """The last resort when a client left before any usage arrived: the engine's own
        tokenizer counts the prompt it was sent (an Anthropic one, by the engine's own
        count_tokens: its system prompt and tools too, which /tokenize does not read). The
        inputs of an embedding, score or rerank count as estimated."""
        assert exchange.upstream is not None and exchange.route is not None
        if exchange.operation in NOTHING_GENERATED:
            # /tokenize reads one prompt, not a batch of inputs; a count consumes nothing.
            return exchange.estimated_prompt_tokens
        asked = {"model": exchange.route.name}
        anthropic = exchange.anthropic
        path, answer = ("/v1/messages/count_tokens", "input_tokens") if anthropic else (
            "/tokenize", "count")
        for field in ("messages", "system", "tools") if anthropic else ("messages", "prompt"):
            if field in payload:
                asked[field] = payload[field]
        waited = time.perf_counter()
        try:
            upstream = exchange.upstream
            async with self.session.post(
                    upstream.base_url + path, json=asked, ssl=upstream.ssl_context,
                    server_hostname=upstream.server_hostname,
                    headers={"Authorization": upstream.authorization}) as response:
                counted = await response.json()
                return exchange.counted(counted.get(answer) if isinstance(counted, dict)
                                        else None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            logger.warning("could not count the prompt tokens of %s", exchange.request_id)
            return 0
        finally:
            exchange.upstream_seconds += time.perf_counter() - waited


async def _relay_stream(exchange: Exchange, response: aiohttp.ClientResponse, send: Send,
                        sink: UsageSink, *, wants_usage: bool, wants_running: bool) -> None:
    """Pass server-sent events through as they arrive. Usage figures are taken from every
    chunk (the engine sends running usage) and shown only as the client asked; the trace
    holds them before the client has the chunk (UsageSink.write_ahead), all of them before a
    chunk that ends a choice. A stream held for a cold start has had its headers already."""
    await start_stream(exchange, send)
    failure: GatewayError | None = None
    done = False
    try:
        async for line in engine_lines(exchange, response):
            if not line.startswith(b"data: "):
                continue
            data = line[6:].rstrip()
            if data == b"[DONE]":
                done = True
                break
            try:
                sent, last = _relayed(exchange, orjson.loads(data), data, wants_usage=wants_usage,
                                      wants_running=wants_running)
            except (ValueError, TypeError, AttributeError):  # not an event of OpenAI's shape
                failure = GatewayError(502, "The engine sent an event that is not one of "
                                       "OpenAI's; the text so far is all there is.",
                                       code="engine_error")
                break
            if sent is not None:
                await sink.write_ahead(exchange, last=last)
                await send({"type": "http.response.body", "body": b"data: " + sent + b"\n\n",
                            "more_body": True})
    except GatewayError as broken:
        failure = broken
    if failure is None and not done and not exchange.disconnected:
        failure = ended_early()
    if failure is not None:
        exchange.status, exchange.error_code = failure.status, failure.code or ""
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + orjson.dumps({"error": failure.as_dict()}) + b"\n\n"})
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


def _usage_in(body: bytes) -> object:
    """The usage of a whole answer; None when the engine's answer is not a JSON object."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return answer.get("usage") if isinstance(answer, dict) else None


def _relayed(exchange: Exchange, chunk: Any, data: bytes, *, wants_usage: bool,
             wants_running: bool) -> tuple[bytes | None, bool]:
    """What to send the client of one of the engine's events (None: nothing), and whether
    it ends a choice. An engine runs weights its tenant chose, so an event of another shape
    raises TypeError, AttributeError or ValueError rather than passing as one."""
    if not isinstance(chunk, dict):
        raise TypeError("an event is a JSON object")
    if "error" in chunk:
        detail = chunk["error"] or {}
        error = engine_message(int(detail.get("code") or 500), str(detail.get("message")))
        exchange.status, exchange.error_code = error.status, error.code or ""
        return orjson.dumps({"error": error.as_dict()}), False
    sent = _client_chunk(exchange, chunk, data, wants_usage=wants_usage,
                         wants_running=wants_running)
    return sent, any(choice.get("finish_reason") for choice in chunk.get("choices") or ())


def _client_chunk(exchange: Exchange, chunk: dict[str, Any], data: bytes, *, wants_usage: bool,
                  wants_running: bool) -> bytes | None:
    """The chunk as the client asked for it (None: not sent), noting usage and first token."""
    usage = chunk.get("usage")
    exchange.take_usage(usage)
    choices = chunk.get("choices")
    if not choices:  # the closing usage chunk
        return data if wants_usage else None
    if exchange.ttft_ms is None and any(_first_token_in(choice) for choice in choices):
        exchange.mark_first_token()
    if "usage" not in chunk or wants_running:
        return data
    if wants_usage:
        chunk["usage"] = None
    else:
        del chunk["usage"]
    return orjson.dumps(chunk)


async def _watch_disconnect(receive: Receive, exchange: Exchange,
                            proxy: asyncio.Task[Any] | None) -> None:
    """Wait for the client to leave; then drop the engine connection, which makes vLLM abort
    the request instead of generating for no one: close the response being read, or cancel
    the request still waiting for one."""
    while (await receive())["type"] != "http.disconnect":
        pass
    exchange.disconnected = True
    if exchange.response is not None:
        exchange.response.close()
    elif proxy is not None:
        proxy.cancel()


def _first_token_in(choice: dict[str, Any]) -> bool:
    """Whether a choice's chunk carries generated output: text, or a delta's content, a
    reasoning model's thinking (`reasoning`; `reasoning_content` in older engines) or a tool
    call, any of which may come first."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content")
                or delta.get("tool_calls"))
