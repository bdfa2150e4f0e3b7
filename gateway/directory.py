"""What the gateway knows without asking the database on every request: API keys and each
organisation's endpoints with their ready replicas, held in memory for a few seconds.

A miss reads through the same selectors the REST API uses (on Django's thread, via
sync_to_async); concurrent misses for one entry share one read. While the database cannot be
reached, what was known is served on (a restart of PostgreSQL does not stop inference).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any
from uuid import UUID

from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError, close_old_connections

from accounts import tokens
from accounts.principals import KeyIdentity
from accounts.selectors import key_identity_from_database
from endpoints.models import DesiredState, State
from endpoints.selectors import (
    endpoints_for_gateway,
    median_start_seconds,
    progress_of,
    start_counted_from,
)
from endpoints.states import COMING_UP
from engine import tasks
from engine.tls import EngineAddress
from fleet.certificates import authority_certificate_pem, engine_address
from gateway.affinity import Ring
from gateway.errors import GatewayError
from kvrun.common.digests import secret_digest

logger = logging.getLogger(__name__)

# Bound on remembered keys, so that a flood of made-up keys cannot grow memory without end.
MAX_REMEMBERED_KEYS = 100_000
# Replicas come and go; past this many remembered upstreams the memory is started afresh.
MAX_REMEMBERED_UPSTREAMS = 10_000
# While the database cannot be reached, what was known before is served, and asked for again
# this often.
STALE_RETRY_SECONDS = 1.0
# A replica that refused a connection is tried last for this long.
DOWN_SECONDS = 5.0


@dataclass(eq=False)
class Upstream:
    """One ready engine replica, with the gateway's own count of requests in flight to it."""

    replica_id: str
    address: EngineAddress
    in_flight: int = 0
    served: int = 0
    down_until: float = 0.0
    # What every request to it carries, made once: where, its key, and how its certificate
    # is checked (aiohttp's `ssl` and `server_hostname`).
    base_url: str = field(init=False)
    authorization: str = field(init=False)
    ssl_context: ssl.SSLContext | bool = field(init=False)
    server_hostname: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.base_url = self.address.base_url
        self.authorization = self.address.authorization
        self.ssl_context = self.address.ssl_context() or True
        self.server_hostname = self.address.host_name or None


@dataclass(frozen=True)
class Route:
    endpoint_id: str
    name: str
    organization_slug: str
    state: str
    progress: dict[str, Any]
    created: int
    context_length: int
    concurrency: int
    cache_isolation: str
    prefix_affinity: bool
    # Its model's tokenizer has a chat template; without one only completions work.
    chat_template: bool = True
    task: str = tasks.GENERATE  # what its engines serve (engine.tasks.OPERATIONS)
    # Every engine serving it was started with a tool-call parser (without one an engine
    # takes no tools), and a reasoning parser (engine.parsers).
    tools: bool = False
    reasoning: bool = False
    # Scaled to zero, or may be: a request waits for its cold start (gateway.hold).
    scales_to_zero: bool = False
    desired_replicas: int = 1
    cold_start_eta_s: float | None = None  # the median start of this model on this node type
    starting_since: float | None = None  # when its replica starting now was asked for (epoch)
    upstreams: tuple[Upstream, ...] = field(default=())
    ring: Ring = field(default=Ring(points=(), owners=()))
    # A LoRA adapter's route is named `<endpoint>:<adapter>`: its endpoint's, with only the
    # replicas whose engines serve the adapter.
    adapter: str = ""

    @property
    def endpoint_name(self) -> str:
        return self.name.removesuffix(f":{self.adapter}") if self.adapter else self.name


@dataclass(frozen=True)
class _ReplicaRow:
    replica_id: str
    address: EngineAddress
    adapters: tuple[str, ...] = ()


def read_endpoints(organization_id: UUID, *, fresh_connection: bool = True
                   ) -> list[tuple[Route, tuple[_ReplicaRow, ...]]]:
    """Each endpoint as a route still without upstreams, and its ready replicas. On a fresh
    connection unless the caller's thread keeps one (gateway.hold's watch)."""
    if fresh_connection:
        close_old_connections()  # this thread serves no Django request that would do it
    rows = []
    authority = None  # read once, where a replica serves TLS
    for endpoint in endpoints_for_gateway(organization_id=organization_id):
        scales_to_zero = (endpoint.min_replicas == 0 and endpoint.state != State.FAILED
                          and endpoint.desired_state == DesiredState.RUNNING)
        starting = [start_counted_from(replica).timestamp()
                    for replica in endpoint.replicas.all() if replica.state in COMING_UP]
        # Prefetched by endpoints_for_gateway, to an attribute the model does not declare.
        # Prompts and engine keys cross a network over TLS only: a replica whose engine
        # serves without a certificate (started before engines had one) only on loopback.
        ready = [replica for replica in endpoint.ready_replicas  # type: ignore[attr-defined]
                 if replica.tls or ipaddress.ip_address(replica.node.address).is_loopback]
        # What the engines serving now were started with; with none, what the next will be.
        started = ready or [endpoint.model]
        route = Route(endpoint_id=str(endpoint.id), name=endpoint.name,
                      organization_slug=endpoint.organization.slug, state=endpoint.state,
                      progress=progress_of(endpoint=endpoint, replicas=endpoint.replicas.all()),
                      created=int(endpoint.created_at.timestamp()),
                      context_length=endpoint.context_length,
                      concurrency=endpoint.concurrency,
                      cache_isolation=endpoint.cache_isolation,
                      prefix_affinity=endpoint.prefix_affinity,
                      chat_template=endpoint.model.chat_template,
                      task=endpoint.model.task,
                      tools=all(engine.tool_call_parser for engine in started),
                      reasoning=all(engine.reasoning_parser for engine in started),
                      scales_to_zero=scales_to_zero, desired_replicas=endpoint.desired_replicas,
                      cold_start_eta_s=median_start_seconds(
                          model_id=endpoint.model_id, gpu_type_id=endpoint.gpu_type_id)
                      if scales_to_zero else None,
                      starting_since=min(starting, default=None))
        if authority is None and any(replica.tls for replica in ready):
            authority = authority_certificate_pem()
        replicas = tuple(_ReplicaRow(
            replica_id=str(replica.id),
            address=engine_address(replica=replica, authority_pem=authority),
            adapters=tuple(replica.adapters)) for replica in ready)
        rows.append((route, replicas))
        for adapter in endpoint.adapters.all():
            rows.append((replace(route, name=f"{endpoint.name}:{adapter.name}",
                                 adapter=adapter.name),
                         tuple(row for row in replicas if adapter.name in row.adapters)))
    return rows


def _read_key(digest: str) -> KeyIdentity | None:
    close_old_connections()
    # Straight from the database, not through the shared key cache: an entry here then
    # outlives a change by at most this process's own TTL.
    return key_identity_from_database(digest=digest)


class Directory:
    def __init__(self, *, key_seconds: float, route_seconds: float) -> None:
        self._key_seconds = key_seconds
        self._route_seconds = route_seconds
        self._keys: dict[str, tuple[float, KeyIdentity | None]] = {}
        self._routes: dict[UUID, tuple[float, dict[str, Route]]] = {}
        self._upstreams: dict[str, Upstream] = {}
        self._loading: dict[object, asyncio.Future[Any]] = {}

    async def identity(self, secret: str) -> KeyIdentity | None:
        """The usable key for `secret`, or None (unknown, revoked or expired)."""
        if not secret.startswith(tokens.API_KEY_PREFIX):
            return None
        digest = secret_digest(secret)
        entry = self._keys.get(digest)
        if entry is None or entry[0] <= time.monotonic():
            try:
                identity = await self._once(("key", digest),
                                            lambda: sync_to_async(_read_key)(digest))
                seconds = self._key_seconds
            except (OperationalError, InterfaceError) as exc:
                identity, seconds = _stale(entry, exc), STALE_RETRY_SECONDS
            if len(self._keys) >= MAX_REMEMBERED_KEYS:
                self._keys.clear()
            self._keys[digest] = (time.monotonic() + seconds, identity)
        else:
            identity = entry[1]
        return identity if identity is not None and identity.is_usable() else None

    def knows(self, secret: str) -> bool:
        """Whether `secret` is a usable key this process already holds: its address's failed
        attempts with other keys (a shared NAT, a proxy) do not stop it."""
        entry = self._keys.get(secret_digest(secret)) if secret.startswith(
            tokens.API_KEY_PREFIX) else None
        return (entry is not None and entry[0] > time.monotonic() and entry[1] is not None
                and entry[1].is_usable())

    def forget_key(self, digest: str) -> None:
        self._keys.pop(digest, None)

    async def routes(self, organization_id: UUID, *, max_age: float | None = None
                     ) -> dict[str, Route]:
        """The organisation's endpoints by name, read at most `max_age` seconds ago (by
        default, the route cache's time)."""
        entry = self._routes.get(organization_id)
        oldest = time.monotonic() + self._route_seconds - (
            self._route_seconds if max_age is None else max_age)
        if entry is not None and entry[0] > oldest:
            return entry[1]
        try:
            rows = await self._once(("routes", organization_id),
                                    lambda: sync_to_async(read_endpoints)(organization_id))
        except (OperationalError, InterfaceError) as exc:
            routes = _stale(entry, exc)
            self._routes[organization_id] = (time.monotonic() + STALE_RETRY_SECONDS, routes)
            return routes
        routes = {route.name: self._with_upstreams(route, replicas) for route, replicas in rows}
        self._routes[organization_id] = (time.monotonic() + self._route_seconds, routes)
        return routes

    async def refresh_routes(self, organization_id: UUID, *,
                             run: Callable[..., Awaitable[Any]]) -> bool:
        """Read the organisation's endpoints afresh through `run` (it runs read_endpoints and
        its arguments on a thread that keeps its connection), joining no read begun earlier;
        returns whether the read was made (False while the database cannot be reached)."""
        try:
            rows = await run(read_endpoints, organization_id, fresh_connection=False)
        except (OperationalError, InterfaceError):
            return False
        self._routes[organization_id] = (time.monotonic() + self._route_seconds, {
            route.name: self._with_upstreams(route, replicas) for route, replicas in rows})
        return True

    def known_routes(self) -> list[Route]:
        """Every route this process has read and still keeps."""
        return [route for _, routes in list(self._routes.values()) for route in routes.values()]

    def _with_upstreams(self, route: Route, replicas: tuple[_ReplicaRow, ...]) -> Route:
        """The route with its replicas as upstreams; a replica keeps its upstream (and so
        its in-flight count) from one refresh to the next."""
        upstreams = []
        for replica in replicas:
            upstream = self._upstreams.get(replica.replica_id)
            if upstream is None or upstream.address != replica.address:
                if len(self._upstreams) >= MAX_REMEMBERED_UPSTREAMS:
                    self._upstreams.clear()
                upstream = Upstream(replica_id=replica.replica_id, address=replica.address)
                self._upstreams[replica.replica_id] = upstream
            upstreams.append(upstream)
        return replace(route, upstreams=tuple(upstreams), ring=Ring.of(upstreams))

    async def _once(self, key: object, load: Callable[[], Awaitable[Any]]) -> Any:
        pending = self._loading.get(key)
        if pending is None:
            pending = asyncio.ensure_future(load())
            self._loading[key] = pending
            pending.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(pending)


def _stale(entry: tuple[float, Any] | None, error: Exception) -> Any:
    """What was known before the database became unreachable, or a 503 if nothing was."""
    if entry is None:
        raise GatewayError(503, "kvrun cannot reach its database right now; retry in a few "
                           "seconds.", code="service_unavailable",
                           headers=[(b"retry-after", b"5")]) from error
    logger.warning("database unreachable (%s); serving what was known before", error)
    return entry[1]


def choose_upstream(route: Route, *, tried: set[Upstream], key: int | None = None
                    ) -> Upstream | None:
    """The replica for a request not yet tried for it: by its prompt's `key` on the route's
    ring where it has one (gateway.affinity), else, or when every replica is past its load
    bound, the ready replica with the fewest requests in flight; replicas that recently
    refused a connection come last. Ties go round-robin."""
    if key is not None:
        chosen = route.ring.choose(key, upstreams=route.upstreams, tried=tried,
                                   concurrency=route.concurrency)
        if chosen is not None:
            return chosen
    candidates = [upstream for upstream in route.upstreams if upstream not in tried]
    if not candidates:
        return None
    now = time.monotonic()
    return min(candidates, key=lambda u: (u.down_until > now, u.in_flight, u.served))


def mark_down(upstream: Upstream) -> None:
    upstream.down_until = time.monotonic() + DOWN_SECONDS
