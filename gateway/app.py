"""kvrun's OpenAI-compatible gateway: a lean ASGI app that serves /v1/* beside Django.

This module is the app's lifespan (start, background tasks, stop) and its routing: who is
calling, which endpoint they may reach, and what happens to every admitted request at its
end. The hot path never waits on the ORM: keys and routes come from memory
(gateway.directory), limits are one Redis script (gateway.limits), the engine is reached by
gateway.proxy, and the usage record leaves through a batched sink (gateway.sink) after the
client has its answer.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from typing import Any

import orjson
from django.conf import settings
from redis.asyncio import Redis
from redis.exceptions import RedisError

from accounts.models import Scope
from accounts.principals import KeyIdentity
from accounts.revocations import KEY_REVOKED_CHANNEL
from billing.usage_stream import MOST_TOKENS
from endpoints.states import ASKED_FOR, State
from gateway import idempotency, observed
from gateway.asgi import (
    JSON,
    ASGIScope,
    ClientGone,
    Receive,
    Send,
    header,
    read_body,
    require_method,
    respond,
    send_error,
)
from gateway.directory import Directory, Route
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from gateway.guard import AuthFailures
from gateway.hold import ColdStarts
from gateway.limits import WINDOW_MS, Admission, Limiter
from gateway.protocol import (
    CHATS,
    COUNT_TOKENS,
    NOTHING_GENERATED,
    OPERATIONS,
    POOLED,
    estimated_prompt_tokens,
    model_entry,
    parse_request,
    pooled_estimate,
    require_task,
    require_tool_parser,
    sequences,
    tokens_to_reserve,
)
from gateway.proxy import Proxy
from gateway.sink import UsageSink
from kvrun.common.clients import client_address_from

logger = logging.getLogger(__name__)


class Gateway:
    def __init__(self) -> None:
        self._started = False
        self._start_lock = asyncio.Lock()
        self._background: list[asyncio.Task[None]] = []

    # --- lifespan ---------------------------------------------------------------------------

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
            self.redis = Redis.from_url(settings.REDIS_URL, **settings.REDIS_OPTIONS)
            self.directory = Directory(key_seconds=settings.KVRUN_API_KEY_CACHE_SECONDS,
                                       route_seconds=settings.KVRUN_GATEWAY_ROUTE_CACHE_SECONDS)
            self.limiter = Limiter(self.redis)
            self.auth_failures = AuthFailures(
                per_minute=settings.KVRUN_GATEWAY_FAILED_AUTHENTICATIONS_PER_MINUTE)
            self.idempotency = idempotency.Idempotency(
                self.redis, ttl_seconds=settings.KVRUN_IDEMPOTENCY_HOURS * 3600,
                kept_bytes_per_organization=(
                    settings.KVRUN_IDEMPOTENCY_KEPT_MIB_PER_ORGANIZATION * 2**20),
                kept_bytes_in_all=settings.KVRUN_IDEMPOTENCY_KEPT_MIB * 2**20)
            self.sink = UsageSink(self.redis)
            self.sink.start()
            self.proxy = Proxy(self.sink)
            self.cold_starts = ColdStarts(self.directory)
            observed.IN_FLIGHT.directories.add(self.directory)
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
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        await self.sink.close()
        await self.proxy.close()
        await self.cold_starts.close()
        observed.IN_FLIGHT.directories.discard(self.directory)
        await self.redis.aclose()
        self._started = False

    async def _follow_revocations(self) -> None:
        """Forget a revoked key the moment it is revoked anywhere, not a cache TTL later.
        The subscription waits for messages without end, so its client has no read timeout
        (the cache TTL still bounds how long a revoked key lives)."""
        listener = Redis.from_url(settings.REDIS_URL,
                                  socket_connect_timeout=settings.KVRUN_REDIS_TIMEOUT_SECONDS)
        try:
            while True:
                try:
                    async with listener.pubsub() as pubsub:
                        await pubsub.subscribe(KEY_REVOKED_CHANNEL)
                        async for message in pubsub.listen():
                            if message["type"] == "message":
                                self.directory.forget_key(message["data"].decode())
                except (RedisError, OSError):
                    await asyncio.sleep(1.0)
        finally:
            await listener.aclose()

    # --- routing ----------------------------------------------------------------------------

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if not self._started:
            await self.start()
        path, method = scope["path"], scope["method"]
        exchange = Exchange(request_id=f"req_{uuid.uuid4().hex}",
                            operation=OPERATIONS.get(path, ""),
                            started_ms=time.time_ns() // 1_000_000,
                            anthropic=path.startswith("/v1/messages"))
        send = exchange.waiting_on_client(send)
        try:
            if path == "/v1/models" or path.startswith("/v1/models/"):
                require_method(method, "GET")
                await self._models(exchange, scope, send, path[len("/v1/models/"):])
            elif exchange.operation:
                require_method(method, "POST")
                await self._complete(exchange, scope, receive, send)
            else:
                raise GatewayError(404, f"Unknown path {path}; kvrun serves "
                                   f"{', '.join(OPERATIONS)} and /v1/models.",
                                   code="unknown_url")
        except GatewayError as error:
            await send_error(send, exchange, error)
        except ClientGone:
            pass

    async def _authenticate(self, scope: ASGIScope) -> KeyIdentity:
        scheme, _, secret = header(scope, b"authorization").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            secret = header(scope, b"x-api-key")  # where Anthropic's clients send it
        if not secret.strip():
            raise GatewayError(401, "You didn't provide an API key. Send 'Authorization: Bearer "
                               "kvr_…' (or 'x-api-key: kvr_…') with an inference key from the "
                               "dashboard.", code="invalid_api_key")
        secret = secret.strip()
        client = scope.get("client") or ("", 0)
        address = client_address_from(remote_addr=client[0],
                                      forwarded_for=header(scope, b"x-forwarded-for"))
        # The address first: it is rarely blocked, and a key's digest is work.
        if (wait := self.auth_failures.seconds_blocked(address)) and not self.directory.knows(
                secret):
            raise GatewayError(429, "Too many requests with unknown, revoked or expired API keys "
                               f"came from your address; retry in {wait} s with a valid key.",
                               code="rate_limit_exceeded", kind="requests",
                               headers=[(b"retry-after", str(wait).encode())])
        identity = await self.directory.identity(secret)
        if identity is None:
            self.auth_failures.record(address)
            shown = f"{secret[:8]}…{secret[-4:]}" if len(secret) > 12 else "…"
            raise GatewayError(401, f"Incorrect API key provided: {shown}. It is unknown, "
                               "revoked or expired; create a key in the dashboard.",
                               code="invalid_api_key")
        if identity.scope != Scope.INFERENCE:
            raise GatewayError(403, "This API key has the manage scope; the OpenAI-compatible "
                               "API takes keys with the inference scope.",
                               code="insufficient_scope")
        if identity.billing_hold:  # a budget reached or a payment overdue: the message says
            raise GatewayError(402, identity.billing_hold, code="billing_hold",
                               kind="insufficient_quota")
        return identity

    async def _models(self, exchange: Exchange, scope: ASGIScope, send: Send, one: str) -> None:
        identity = await self._authenticate(scope)
        routes = await self.directory.routes(identity.organization_id)
        # An endpoint at zero is listed: a request to it wakes it.
        listed = [model_entry(route) for name, route in sorted(routes.items())
                  if (route.upstreams or route.scales_to_zero) and _allowed(identity, name)]
        if one:
            found = [entry for entry in listed if entry["id"] == one]
            if not found:
                raise _model_not_found(one)
            body = orjson.dumps(found[0])
        else:
            body = orjson.dumps({"object": "list", "data": listed})
        await respond(send, exchange, 200, body, [JSON])

    async def _complete(self, exchange: Exchange, scope: ASGIScope, receive: Receive,
                        send: Send) -> None:
        identity = await self._authenticate(scope)
        body = await read_body(scope, exchange.waiting_on_client(receive))
        payload = parse_request(body)
        route = await self._route(identity, payload["model"])
        require_task(exchange.operation, route)
        if exchange.operation in CHATS:
            if not route.chat_template:
                raise GatewayError(400, f"The model behind {route.name} has no chat template, "
                                   "so it cannot take chat messages; send a prompt to "
                                   "/v1/completions instead.", code="chat_template_missing")
            require_tool_parser(payload, route, anthropic=exchange.anthropic)
        exchange.identity, exchange.route = identity, route
        if exchange.operation in POOLED:  # answered whole, and only its inputs are read
            exchange.estimated_prompt_tokens, inputs = pooled_estimate(
                exchange.operation, payload, task=route.task)
        elif exchange.operation == COUNT_TOKENS:  # counted, not run: nothing to bill
            inputs = 1
        else:
            exchange.stream = bool(payload.get("stream"))
            exchange.estimated_prompt_tokens = estimated_prompt_tokens(payload)
            inputs = sequences(payload)
        exchange.most_tokens = min(MOST_TOKENS, route.context_length * inputs)
        key = header(scope, b"idempotency-key")
        if key:
            exchange.idempotency_key = idempotency.validate(key)
            exchange.idempotency = idempotency.Claim.of(
                organization_id=identity.organization_id, api_key_id=identity.id,
                endpoint_id=route.endpoint_id, key=key, body=body, request_id=exchange.request_id,
                anthropic=exchange.anthropic)
            replay = await self._reserve(exchange.idempotency)
            if replay is not None:
                await respond(send, exchange, 200, replay,
                              [JSON, (b"x-kvrun-idempotent-replay", b"true")])
                return
        if not route.upstreams:
            await self._take_cold_start_room(exchange)
        try:
            exchange.admission = await self._admit(exchange, payload)
        except BaseException:
            if not route.upstreams:
                self.cold_starts.give_room(route.endpoint_id,
                                           organization_id=identity.organization_id)
            raise
        self.sink.track(exchange)
        answer = None
        try:
            if not route.upstreams:
                exchange.route = await self.cold_starts.wait_for_replica(exchange, receive, send)
            answer = await self.proxy.forward(exchange, payload, receive, send)
        except GatewayError as error:
            exchange.status, exchange.error_code = error.status, error.code or ""
            await send_error(send, exchange, error)
        except asyncio.CancelledError:
            # The server is shutting down and its grace period is over: the usage so far
            # is still recorded.
            exchange.status, exchange.error_code = 503, "gateway_shutdown"
            raise
        except Exception:
            exchange.status, exchange.error_code = 500, "gateway_error"
            raise
        finally:
            await self._finish(exchange, payload, answer)

    async def _reserve(self, claim: idempotency.Claim) -> bytes | None:
        try:
            return await self.idempotency.reserve(claim)
        except (RedisError, OSError):
            raise GatewayError(503, "kvrun cannot make sure right now that a request with an "
                               "Idempotency-Key runs only once (its store is unreachable); "
                               "retry in a few seconds.", code="idempotency_unavailable",
                               headers=[(b"retry-after", b"5")]) from None

    async def _take_cold_start_room(self, exchange: Exchange) -> None:
        """The request's room among those held for its endpoint's cold start; a 429 frees
        its Idempotency-Key."""
        assert exchange.route is not None and exchange.identity is not None
        try:
            self.cold_starts.take_room(exchange.route,
                                       organization_id=exchange.identity.organization_id)
        except GatewayError as refusal:
            exchange.status = refusal.status
            await self._settle(exchange, answer=None)
            raise

    async def _admit(self, exchange: Exchange, payload: dict[str, Any]) -> Admission:
        """The request's admission under its key's limits; a 429 frees its Idempotency-Key.
        While Redis, where the limits live, cannot be reached, requests are let in
        unlimited: each endpoint has engines of its own, so a tenant over its limit for
        that while weighs on its own engines, and refusing every request would stop all."""
        assert exchange.identity is not None and exchange.route is not None
        try:
            return await self.limiter.admit(
                endpoint_id=exchange.route.endpoint_id,
                # Now, not when the request began: a body uploaded for minutes must not be
                # counted in a minute long gone.
                identity=exchange.identity, request_id=exchange.request_id,
                now_ms=time.time_ns() // 1_000_000,
                tokens=exchange.estimated_prompt_tokens
                if exchange.operation in NOTHING_GENERATED
                else tokens_to_reserve(payload, prompt_tokens=exchange.estimated_prompt_tokens,
                                       context_length=exchange.route.context_length),
                trace=exchange.interrupted_report().encode())
        except GatewayError as refusal:
            exchange.status = refusal.status
            await self._settle(exchange, answer=None)
            raise
        except (RedisError, OSError) as exc:
            logger.warning("limits unreachable (%s); %s admitted without them", exc,
                           exchange.request_id)
            return Admission(request_id=exchange.request_id, identity=exchange.identity,
                             headers=[], window=time.time_ns() // 1_000_000 // WINDOW_MS,
                             reserved_tokens=0, in_flight_set=None,
                             endpoint_id="")

    async def _route(self, identity: KeyIdentity, name: str) -> Route:
        routes = await self.directory.routes(identity.organization_id)
        route = routes.get(name)
        if route is None:
            raise _model_not_found(name)
        if not _allowed(identity, name):
            allowed = ", ".join(identity.endpoint_names)
            raise GatewayError(403, f"This API key may call only these endpoints: {allowed}. "
                               "Use a key without that restriction.", code="permission_denied")
        endpoint = routes[route.endpoint_name]
        if route.adapter and not route.upstreams and endpoint.upstreams:
            # Its endpoint serves, but no engine has loaded the adapter: no cold start to wait for.
            raise GatewayError(503, f"No replica of {route.endpoint_name!r} serves the adapter "
                               f"{route.adapter!r} yet: it was added moments ago, or its "
                               "replicas could not load it (the endpoint's events in the "
                               "dashboard say why). Retry in a few seconds.",
                               code="adapter_not_ready", headers=[(b"retry-after", b"5")])
        if not route.upstreams and not route.scales_to_zero:
            raise _not_ready(route)
        return route

    async def _finish(self, exchange: Exchange, payload: dict[str, Any],
                      answer: bytes | None) -> None:
        """Queue the usage record and the release of the limits, and keep the outcome for
        the Idempotency-Key; runs for every admitted request, however it ended."""
        if exchange.disconnected:
            exchange.status, exchange.error_code = 499, "client_disconnected"
            if not exchange.usage_seen and exchange.upstream is not None:
                exchange.prompt_tokens = exchange.counted(
                    await self.proxy.count_prompt_tokens(exchange, payload))
        self.sink.add(exchange)
        observed.observe(exchange)
        await self._settle(exchange, answer=answer)

    async def _settle(self, exchange: Exchange, *, answer: bytes | None) -> None:
        if exchange.idempotency is None:
            return
        try:
            await self.idempotency.settle(exchange.idempotency, answer=answer,
                                          succeeded=exchange.status == 200)
        except (RedisError, OSError) as exc:
            # The running key is a lease: a repeat may run again once it has expired.
            logger.warning("could not settle the Idempotency-Key of %s (%s)",
                           exchange.request_id, exc)


def _allowed(identity: KeyIdentity, name: str) -> bool:
    """A key restricted to endpoints calls those and their adapters; one restricted to
    `<endpoint>:<adapter>` calls that adapter."""
    return (not identity.endpoint_names or name in identity.endpoint_names
            or name.partition(":")[0] in identity.endpoint_names)


def _model_not_found(name: str) -> GatewayError:
    return GatewayError(404, f"The model {name!r} does not exist or you do not have access to "
                        "it. The model is the name of one of your endpoints; GET /v1/models "
                        "lists the ready ones.", code="model_not_found", param="model")


def _not_ready(route: Route) -> GatewayError:
    name = route.name
    if route.state in ASKED_FOR:
        stage, percent = route.progress.get("stage"), route.progress.get("percent")
        message = (f"Endpoint {name!r} is {route.state} ({stage}, {percent}%); "
                   "retry in a few seconds.")
    elif route.state == State.FAILED:
        message = (f"Endpoint {name!r} has failed; its events in the dashboard say why. "
                   "Start it again once the cause is fixed.")
    else:
        message = (f"Endpoint {name!r} is {route.state}; start it (Start on its page in the "
                   f"dashboard, or POST /api/v1/organizations/{route.organization_slug}/"
                   f"endpoints/{name}/start/) and retry.")
    return GatewayError(503, message, code="endpoint_not_ready",
                        headers=[(b"retry-after", b"5")])
