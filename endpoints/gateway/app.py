"""kvrun's OpenAI-compatible gateway: a lean ASGI app that serves /v1/* beside Django.

The hot path never waits on the ORM: keys and routes come from memory (endpoints.gateway.
directory), limits are one Redis script, and the usage record leaves through a batched sink
after the client has its answer. Engines are reached over pooled aiohttp connections.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from django.conf import settings
from redis.asyncio import Redis
from redis.exceptions import RedisError

from accounts.models import Scope
from accounts.principals import KeyIdentity
from accounts.selectors import KEY_REVOKED_CHANNEL
from endpoints.gateway import idempotency
from endpoints.gateway.directory import Directory, Route, Upstream, choose_upstream, mark_down
from endpoints.gateway.errors import GatewayError, engine_message, from_engine
from endpoints.gateway.exchange import Exchange
from endpoints.gateway.limits import Limiter
from endpoints.gateway.sink import Release, UsageSink
from endpoints.models import State

logger = logging.getLogger(__name__)

ASGIScope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

OPERATIONS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}
CONNECT_TIMEOUT_SECONDS = 3.0
JSON = (b"content-type", b"application/json")
EVENT_STREAM = (b"content-type", b"text/event-stream")
DONE = b"data: [DONE]\n\n"
STARTING_STATES = {State.PENDING, State.SCHEDULING, State.STARTING, State.LOADING}


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Gateway:
    def __init__(self) -> None:
        self._started = False
        self._start_lock = asyncio.Lock()
        self._background: list[asyncio.Task[None]] = []

    # --- lifecycle -------------------------------------------------------------------------

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            self.redis = Redis.from_url(settings.REDIS_URL)
            self.directory = Directory(key_seconds=settings.KVRUN_API_KEY_CACHE_SECONDS,
                                       route_seconds=settings.KVRUN_GATEWAY_ROUTE_CACHE_SECONDS)
            self.limiter = Limiter(self.redis)
            self.idempotency = idempotency.Idempotency(
                self.redis, ttl_seconds=settings.KVRUN_IDEMPOTENCY_HOURS * 3600)
            self.sink = UsageSink(self.redis)
            self.sink.start()
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=CONNECT_TIMEOUT_SECONDS,
                    sock_read=settings.KVRUN_GATEWAY_UPSTREAM_TIMEOUT_SECONDS),
                auto_decompress=False,
            )
            self._background.append(asyncio.get_running_loop().create_task(
                self._follow_revocations()))
            # Django's start-up leaves a large heap that never changes; moving it out of the
            # collector's reach keeps full collections, and so the latency tail, short.
            gc.freeze()
            self._started = True

    async def stop(self) -> None:
        """After the server has finished its requests: write every usage record left."""
        if not self._started:
            return
        for task in self._background:
            task.cancel()
        await self.sink.close()
        await self.session.close()
        await self.redis.aclose()
        self._started = False

    async def _follow_revocations(self) -> None:
        """Forget a revoked key the moment it is revoked anywhere, not a cache TTL later."""
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(KEY_REVOKED_CHANNEL)
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            self.directory.forget_key(message["data"].decode())
            except (RedisError, OSError):
                await asyncio.sleep(1.0)

    # --- requests --------------------------------------------------------------------------

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if not self._started:
            await self.start()
        path, method = scope["path"], scope["method"]
        exchange = Exchange(request_id=f"req_{uuid.uuid4().hex}",
                            operation=OPERATIONS.get(path, ""),
                            started_ms=time.time_ns() // 1_000_000)
        try:
            if path == "/v1/models" or path.startswith("/v1/models/"):
                _require_method(method, "GET")
                await self._models(exchange, scope, send, path[len("/v1/models/"):])
            elif exchange.operation:
                _require_method(method, "POST")
                await self._complete(exchange, scope, receive, send)
            else:
                raise GatewayError(404, f"Unknown path {path}; kvrun serves /v1/chat/completions,"
                                   " /v1/completions and /v1/models.", code="unknown_url")
        except GatewayError as error:
            await _send_error(send, exchange, error)
        except ClientGone:
            pass

    async def _authenticate(self, scope: ASGIScope) -> KeyIdentity:
        header = _header(scope, b"authorization")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise GatewayError(401, "You didn't provide an API key. Send 'Authorization: Bearer "
                               "kvr_…' with an inference key from the dashboard.",
                               code="invalid_api_key")
        secret = secret.strip()
        identity = await self.directory.identity(secret)
        if identity is None:
            shown = f"{secret[:8]}…{secret[-4:]}" if len(secret) > 12 else "…"
            raise GatewayError(401, f"Incorrect API key provided: {shown}. It is unknown, "
                               "revoked or expired; create a key in the dashboard.",
                               code="invalid_api_key")
        if identity.scope != Scope.INFERENCE:
            raise GatewayError(403, "This API key has the manage scope; the OpenAI-compatible "
                               "API takes keys with the inference scope.",
                               code="insufficient_scope")
        return identity

    async def _models(self, exchange: Exchange, scope: ASGIScope, send: Send, one: str) -> None:
        identity = await self._authenticate(scope)
        routes = await self.directory.routes(identity.organization_id)
        listed = [_model_entry(route) for name, route in sorted(routes.items())
                  if route.upstreams and _allowed(identity, name)]
        if one:
            found = [entry for entry in listed if entry["id"] == one]
            if not found:
                raise _model_not_found(one)
            body = orjson.dumps(found[0])
        else:
            body = orjson.dumps({"object": "list", "data": listed})
        await _respond(send, exchange, 200, body, [JSON])

    async def _complete(self, exchange: Exchange, scope: ASGIScope, receive: Receive,
                        send: Send) -> None:
        identity = await self._authenticate(scope)
        payload = _parse(await _read_body(scope, receive))
        route = await self._route(identity, payload["model"])
        exchange.identity, exchange.route = identity, route
        exchange.stream = bool(payload.get("stream"))
        key = _header(scope, b"idempotency-key")
        if key:
            exchange.idempotency_key = idempotency.validate(key)
            replay = await self.idempotency.reserve(
                organization_id=identity.organization_id, key=key,
                request_id=exchange.request_id)
            if replay is not None:
                await _respond(send, exchange, 200, replay,
                               [JSON, (b"x-kvrun-idempotent-replay", b"true")])
                return
        try:
            exchange.admission = await self.limiter.admit(
                identity=identity, request_id=exchange.request_id, now_ms=exchange.started_ms)
        except GatewayError:
            await self._release_key(exchange, succeeded=False, body=None)
            raise
        body = None
        try:
            body = await self._proxy(exchange, payload, receive, send)
        except GatewayError as error:
            exchange.status, exchange.error_code = error.status, error.code or ""
            await _send_error(send, exchange, error)
        except asyncio.CancelledError:
            # The server is shutting down and its grace period is over: the usage so far
            # is still recorded.
            exchange.status, exchange.error_code = 503, "gateway_shutdown"
            raise
        except Exception:
            exchange.status, exchange.error_code = 500, "gateway_error"
            raise
        finally:
            await self._finish(exchange, payload, body)

    async def _route(self, identity: KeyIdentity, name: str) -> Route:
        route = (await self.directory.routes(identity.organization_id)).get(name)
        if route is None:
            raise _model_not_found(name)
        if not _allowed(identity, name):
            allowed = ", ".join(identity.endpoint_names)
            raise GatewayError(403, f"This API key may call only these endpoints: {allowed}. "
                               "Use a key without that restriction.", code="permission_denied")
        if not route.upstreams:
            raise _not_ready(route)
        return route

    async def _proxy(self, exchange: Exchange, payload: dict[str, Any], receive: Receive,
                     send: Send) -> bytes | None:
        """Send the request to a replica and the answer to the client; returns the answer
        body when it was not streamed."""
        assert exchange.identity is not None and exchange.route is not None
        client_options = payload.get("stream_options") or {}
        payload["cache_salt"] = cache_salt(exchange.identity.organization_id)
        if exchange.stream:
            payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        upstream_body = orjson.dumps(payload)
        watcher = asyncio.get_running_loop().create_task(
            _watch_disconnect(receive, exchange, asyncio.current_task()))
        try:
            response = await self._connect(exchange, upstream_body)
            async with response:
                if exchange.stream and response.status == 200:
                    await self._relay_stream(
                        exchange, response, send,
                        wants_usage=bool(client_options.get("include_usage")),
                        wants_running=bool(client_options.get("continuous_usage_stats")))
                    return None
                waited = time.perf_counter()
                try:
                    body = await response.read()
                except aiohttp.ClientError:
                    if exchange.disconnected:
                        return None
                    raise GatewayError(502, "The engine dropped the connection before it "
                                       "answered; retry.", code="engine_error") from None
                finally:
                    exchange.upstream_seconds += time.perf_counter() - waited
                if response.status != 200:
                    raise from_engine(response.status, body)
                exchange.take_usage(orjson.loads(body).get("usage"))
                await _respond(send, exchange, 200, body, [JSON])
                return body
        except asyncio.CancelledError:
            if not exchange.disconnected:
                raise
            # The client left while the engine had not answered yet (a non-streamed answer
            # comes whole): the cancelled request closed the engine connection.
            asyncio.current_task().uncancel()
            if exchange.response is not None:
                exchange.response.close()
            return None
        finally:
            watcher.cancel()
            exchange.response = None
            if exchange.upstream is not None:
                exchange.upstream.in_flight -= 1

    async def _connect(self, exchange: Exchange, body: bytes) -> aiohttp.ClientResponse:
        """The engine's response headers from the least busy ready replica; a replica that
        refuses the connection (nothing was sent) is skipped for the next one."""
        route = exchange.route
        assert route is not None
        path = "/v1/chat/completions" if exchange.operation == "chat.completions" else \
            "/v1/completions"
        tried: set[Upstream] = set()
        while (upstream := choose_upstream(route, tried=tried)) is not None:
            tried.add(upstream)
            upstream.in_flight += 1
            upstream.served += 1
            exchange.upstream = upstream
            waited = time.perf_counter()
            try:
                exchange.response = await self.session.post(
                    upstream.base_url + path, data=body,
                    headers={"Authorization": upstream.authorization,
                             "Content-Type": "application/json"})
            except aiohttp.ClientConnectorError:
                upstream.in_flight -= 1
                exchange.upstream = None
                mark_down(upstream)
                continue
            except (aiohttp.ClientError, TimeoutError):
                raise GatewayError(502, "The engine did not answer; retry.",
                                   code="engine_error") from None
            finally:
                exchange.upstream_seconds += time.perf_counter() - waited
            return exchange.response
        raise GatewayError(503, f"No replica of endpoint {route.name!r} accepted the request; "
                           "kvrun is restarting it. Retry in a few seconds.",
                           code="engine_unavailable", headers=[(b"retry-after", b"5")])

    async def _relay_stream(self, exchange: Exchange, response: aiohttp.ClientResponse,
                            send: Send, *, wants_usage: bool, wants_running: bool) -> None:
        """Pass server-sent events through as they arrive. Usage figures are taken from every
        chunk (the engine sends running usage) and shown only as the client asked."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": _headers(exchange, [EVENT_STREAM,
                                                   (b"cache-control", b"no-cache")])})
        failure: GatewayError | None = None
        lines = response.content.__aiter__()
        while True:
            waited = time.perf_counter()
            try:
                line = await lines.__anext__()
            except StopAsyncIteration:
                if not exchange.disconnected:
                    failure = GatewayError(502, "The engine ended the stream early.",
                                           code="engine_error")
                break
            except (aiohttp.ClientError, TimeoutError):
                if not exchange.disconnected:
                    failure = GatewayError(502, "The engine stopped answering in mid-stream; "
                                           "the text so far is all there is.",
                                           code="engine_error")
                break
            finally:
                exchange.upstream_seconds += time.perf_counter() - waited
            if not line.startswith(b"data: "):
                continue
            data = line[6:].rstrip()
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                detail = chunk["error"] or {}
                error = engine_message(int(detail.get("code") or 500), str(detail.get("message")))
                exchange.status, exchange.error_code = error.status, error.code or ""
                data = orjson.dumps({"error": error.as_dict()})
            else:
                data = _client_chunk(exchange, chunk, data, wants_usage=wants_usage,
                                     wants_running=wants_running)
            if data is not None:
                await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                            "more_body": True})
        if failure is not None:
            exchange.status, exchange.error_code = failure.status, failure.code or ""
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + orjson.dumps({"error": failure.as_dict()}) + b"\n\n"})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    async def _finish(self, exchange: Exchange, payload: dict[str, Any],
                      body: bytes | None) -> None:
        """Give the limit slot back and queue the usage record; runs for every admitted
        request, however it ended."""
        if exchange.disconnected:
            exchange.status, exchange.error_code = 499, "client_disconnected"
            if not exchange.usage_seen and exchange.upstream is not None:
                exchange.prompt_tokens = await self._count_prompt_tokens(exchange, payload)
        admission = exchange.admission
        assert admission is not None
        self.sink.add(record=exchange.record(), release=Release(
            request_id=exchange.request_id,
            tokens=exchange.prompt_tokens + exchange.completion_tokens,
            tokens_counter=admission.tokens_counter, in_flight_set=admission.in_flight_set))
        await self._release_key(exchange, succeeded=exchange.status == 200, body=body)

    async def _release_key(self, exchange: Exchange, *, succeeded: bool,
                           body: bytes | None) -> None:
        if exchange.idempotency_key and exchange.identity is not None:
            await self.idempotency.settle(
                organization_id=exchange.identity.organization_id, key=exchange.idempotency_key,
                request_id=exchange.request_id, succeeded=succeeded, body=body)

    async def _count_prompt_tokens(self, exchange: Exchange, payload: dict[str, Any]) -> int:
        """The last resort when a client left before any usage arrived: the engine's own
        tokenizer counts the prompt it was sent."""
        assert exchange.upstream is not None and exchange.route is not None
        asked = {"model": exchange.route.name}
        for field in ("messages", "prompt"):
            if field in payload:
                asked[field] = payload[field]
        try:
            async with self.session.post(
                    exchange.upstream.base_url + "/tokenize", json=asked,
                    headers={"Authorization": exchange.upstream.authorization}) as response:
                return int((await response.json()).get("count") or 0)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            logger.warning("could not count the prompt tokens of %s", exchange.request_id)
            return 0


# --- helpers -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=100_000)
def cache_salt(organization_id: object) -> str:
    """The organisation's vLLM cache salt: its cached prefixes are reused for it alone."""
    return hmac.new(settings.KVRUN_KEY_PEPPER.encode(), f"cache-salt:{organization_id}".encode(),
                    hashlib.sha256).hexdigest()[:32]


def _header(scope: ASGIScope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


def _require_method(method: str, allowed: str) -> None:
    if method != allowed:
        raise GatewayError(405, f"Use {allowed} on this path.", code="method_not_allowed",
                           headers=[(b"allow", allowed.encode())])


def _allowed(identity: KeyIdentity, name: str) -> bool:
    return not identity.endpoint_names or name in identity.endpoint_names


def _model_entry(route: Route) -> dict[str, Any]:
    return {"id": route.name, "object": "model", "created": route.created,
            "owned_by": route.organization_slug}


def _model_not_found(name: str) -> GatewayError:
    return GatewayError(404, f"The model {name!r} does not exist or you do not have access to "
                        "it. The model is the name of one of your endpoints; GET /v1/models "
                        "lists the ready ones.", code="model_not_found", param="model")


def _not_ready(route: Route) -> GatewayError:
    name = route.name
    if route.state in STARTING_STATES or route.state == State.READY:
        stage, percent = route.progress.get("stage"), route.progress.get("percent")
        message = (f"Endpoint {name!r} is {route.state} ({stage}, {percent}%); "
                   "retry in a few seconds.")
    elif route.state == State.FAILED:
        message = (f"Endpoint {name!r} has failed; its events in the dashboard say why. "
                   "Start it again once the cause is fixed.")
    else:
        message = (f"Endpoint {name!r} is {route.state}; start it (POST /api/v1/organizations/"
                   f"{route.organization_slug}/endpoints/{name}/start/) and retry.")
    return GatewayError(503, message, code="endpoint_not_ready",
                        headers=[(b"retry-after", b"5")])


async def _read_body(scope: ASGIScope, receive: Receive) -> bytes:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    too_large = GatewayError(413, f"The request body is larger than the limit of {limit} bytes; "
                             "send a shorter prompt.", code="request_too_large")
    declared = _header(scope, b"content-length")
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


def _parse(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"The request body is not valid JSON ({exc}); send a JSON "
                           "object.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise GatewayError(400, "The request body must be a JSON object.", code="invalid_json")
    if not isinstance(payload.get("model"), str) or not payload["model"]:
        raise GatewayError(400, "Say which endpoint to use: 'model' is the endpoint's name.",
                           code="invalid_request", param="model")
    if not isinstance(payload.get("stream", False), bool):
        raise GatewayError(400, "'stream' must be true or false.", code="invalid_request",
                           param="stream")
    if not isinstance(payload.get("stream_options") or {}, dict):
        raise GatewayError(400, "'stream_options' must be an object.", code="invalid_request",
                           param="stream_options")
    return payload


def _client_chunk(exchange: Exchange, chunk: dict[str, Any], data: bytes, *, wants_usage: bool,
                  wants_running: bool) -> bytes | None:
    """The chunk as the client asked for it (None: not sent), noting usage and first token."""
    usage = chunk.get("usage")
    exchange.take_usage(usage)
    choices = chunk.get("choices")
    if not choices:  # the closing usage chunk
        return data if wants_usage else None
    if exchange.ttft_ms is None and any(
            choice.get("text") or (choice.get("delta") or {}).get("content")
            for choice in choices):
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


def _headers(exchange: Exchange, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    headers = [*extra, (b"x-request-id", exchange.request_id.encode()),
               (b"x-kvrun-overhead-ms", f"{exchange.overhead_ms():.3f}".encode())]
    if exchange.admission is not None:
        headers += exchange.admission.headers
    return headers


async def _respond(send: Send, exchange: Exchange, status: int, body: bytes,
                   extra: list[tuple[bytes, bytes]]) -> None:
    headers = _headers(exchange, [*extra, (b"content-length", str(len(body)).encode())])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, exchange: Exchange, error: GatewayError) -> None:
    try:
        await _respond(send, exchange, error.status, error.body(), [JSON, *error.headers])
    except RuntimeError:
        pass  # the response had already started (a stream): its error frame was sent instead
