"""Requests to an endpoint scaled to zero: the first one wakes it, and each waits for its
replica instead of being refused.

A held stream gets its response headers at once and, every few seconds, an SSE comment line
with the start's stage and ETA (clients ignore comments); a request not streamed just waits.
Holds are bounded in time (KVRUN_GATEWAY_HOLD_SECONDS) and in count in this process, per
endpoint, per organisation and in all (KVRUN_GATEWAY_HOLD_MAX_REQUESTS…): past either the
answer is a 503 or a 429 with Retry-After from the ETA. A replica that no node online fits
fails its endpoint's held requests at the watch's next look (a 503 saying why). What they wait
on is read by one watch for the whole process (Watch). The ETA is the median time this model's
recent starts took on this kind of node (endpoints.selectors.median_start_seconds), less what
this start has taken.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar
from uuid import UUID

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from endpoints.models import State
from endpoints.selectors import HoldState, hold_states
from endpoints.services import do_wake_endpoint
from gateway import observed
from gateway.asgi import ClientGone, Receive, Send, response_headers
from gateway.directory import Directory, Route
from gateway.errors import GatewayError
from gateway.exchange import Exchange

# An organisation's routes are read again this often while its requests are held, changed or
# not: what a change the watch cannot see (a route's own fields) leaves stale, it mends.
SAFETY_REFRESH_SECONDS = 30.0
T = TypeVar("T")
logger = logging.getLogger(__name__)
# Retry-After of a request whose endpoint's replica no node can take now.
UNPLACED_RETRY_SECONDS = 60
# How often a held stream is told how the start is going.
COMMENT_SECONDS = 2.0
# Retry-After where no start of this model on this kind of node is known yet.
UNKNOWN_ETA_RETRY_SECONDS = 10


def eta_seconds(route: Route, *, now: float) -> float | None:
    """Seconds until the endpoint's replica is likely ready; None with no history to go by."""
    if route.cold_start_eta_s is None:
        return None
    taken = now - route.starting_since if route.starting_since is not None else 0.0
    return max(0.0, route.cold_start_eta_s - taken)


def retry_after(route: Route) -> bytes:
    eta = eta_seconds(route, now=time.time())
    return str(UNKNOWN_ETA_RETRY_SECONDS if eta is None else max(1, math.ceil(eta))).encode()


def _progress(route: Route) -> str:
    eta = eta_seconds(route, now=time.time())
    when = ("no start of this model on this kind of node is known yet to tell how long"
            if eta is None else f"ready in about {math.ceil(eta)} s")
    if route.desired_replicas == 0 or route.state == State.IDLE:  # read before the wake
        return f"asking for a replica (0%), {when}"
    stage = route.progress.get("stage") or route.state
    return f"{stage} ({route.progress.get('percent', 0)}%), {when}"


class Watch:
    """One watch, per process, of every endpoint that has requests held: every
    KVRUN_GATEWAY_HOLD_WATCH_SECONDS one query for all of them
    (endpoints.selectors.hold_states), however many requests or organisations wait; an
    organisation's routes are read again only when one of its
    endpoints changed. The watch, those reads and the wakes run on a thread of their own,
    over a connection it keeps: never on the thread that serves every tenant's keys and
    routes, nor on a fresh connection each."""

    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._watched: dict[str, _Watched] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvrun-hold-watch")
        self._task: asyncio.Task[None] | None = None

    def add(self, *, endpoint_id: str, organization_id: UUID) -> _Watched:
        """Watch the endpoint for one more request; `discard` when it stops waiting."""
        watched = self._watched.get(endpoint_id)
        if watched is None:
            watched = self._watched[endpoint_id] = _Watched(organization_id=organization_id)
        watched.waiting += 1
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return watched

    async def close(self) -> None:
        """Stop watching, and close the watch's connection."""
        if self._task is not None:
            self._task.cancel()
        await asyncio.get_running_loop().run_in_executor(self._thread, _close_connection)
        self._thread.shutdown()

    def discard(self, endpoint_id: str) -> None:
        watched = self._watched[endpoint_id]
        watched.waiting -= 1
        if not watched.waiting:
            del self._watched[endpoint_id]

    async def run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """function(*args, **kwargs) on the watch's thread; a connection that failed is
        dropped there, to be made again next time."""
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, partial(_on_kept_connection, function, *args, **kwargs))

    async def _run(self) -> None:
        while self._watched:
            try:
                await self._look()
            except Exception:  # the next look may fare better; the waiters wait on
                logger.exception("the watch of requests held at zero failed a look")
            await asyncio.sleep(settings.KVRUN_GATEWAY_HOLD_WATCH_SECONDS)

    async def _look(self) -> None:
        """Read what changed; for every organisation of an endpoint that changed (or whose
        routes were last read SAFETY_REFRESH_SECONDS ago), its routes afresh; then tell the
        endpoint's waiters. A change counts as seen only once its routes were read."""
        watched = dict(self._watched)
        try:
            states = await self.run(hold_states, endpoint_ids=list(watched))
        except (OperationalError, InterfaceError):
            return  # the database is away: what was read stands
        now = time.monotonic()
        changed = {endpoint_id: states.get(endpoint_id, GONE)
                   for endpoint_id, one in watched.items()
                   if states.get(endpoint_id, GONE).changed != one.seen
                   or now - one.read_at >= SAFETY_REFRESH_SECONDS}
        read = {}
        for organization_id in {watched[endpoint_id].organization_id for endpoint_id in changed}:
            read[organization_id] = await self._directory.refresh_routes(organization_id,
                                                                         run=self.run)
        for endpoint_id, state in changed.items():
            one = watched[endpoint_id]
            one.unplaced = state.unplaced
            if read[one.organization_id]:
                one.seen, one.read_at = state.changed, now
            await one.tell()


@dataclass(eq=False)
class _Watched:
    organization_id: UUID
    waiting: int = 0
    seen: tuple[object, ...] | None = None
    read_at: float = -math.inf
    unplaced: str = ""
    # Told of each look that found it changed: a waiter waits for a generation past the one
    # it last read at, so no telling between its read and its wait is missed.
    generation: int = 0
    _told: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def tell(self) -> None:
        async with self._told:
            self.generation += 1
            self._told.notify_all()

    async def told_since(self, generation: int) -> None:
        async with self._told:
            await self._told.wait_for(lambda: self.generation != generation)


# What the watch reads for an endpoint that is gone: a change, once.
GONE = HoldState(changed=("gone",), unplaced="")


def _on_kept_connection(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return function(*args, **kwargs)
    except (OperationalError, InterfaceError):
        connection.close()  # this thread's
        raise


def _close_connection() -> None:
    connection.close()  # this thread's: `connection` is looked up where it is called


class ColdStarts:
    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._watch = Watch(directory)
        self._held: Counter[str] = Counter()  # by endpoint
        self._held_by_organization: Counter[UUID] = Counter()
        self._waking: dict[str, asyncio.Future[bool]] = {}

    @property
    def held(self) -> int:
        """Requests held in this process."""
        return sum(self._held.values())

    async def close(self) -> None:
        await self._watch.close()

    def take_room(self, route: Route, *, organization_id: UUID) -> None:
        """Count a request as held for the endpoint, or refuse it with a 429 past a bound:
        KVRUN_GATEWAY_HOLD_MAX_REQUESTS for the endpoint, and _PER_ORGANIZATION and
        _PER_PROCESS. Counted at once, with no await between the check and the count, so that
        a burst cannot pass a bound; wait_for_replica gives the room back, and give_room where
        the request is refused before it waits."""
        held = self._held[route.endpoint_id]
        for waiting, most, who in (
                (held, settings.KVRUN_GATEWAY_HOLD_MAX_REQUESTS, "requests already wait for it"),
                (self._held_by_organization[organization_id],
                 settings.KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_ORGANIZATION,
                 "of this organisation's requests already wait for its endpoints"),
                (self.held, settings.KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_PROCESS,
                 "requests already wait for endpoints to start here")):
            if waiting >= most:
                wait = retry_after(route)
                raise GatewayError(
                    429, f"Endpoint {route.name!r} is starting from zero and {waiting} {who}, "
                    f"the most that may; retry in {wait.decode()} s.",
                    code="cold_start_queue_full", kind="requests",
                    headers=[(b"retry-after", wait)])
        self._held[route.endpoint_id] += 1
        self._held_by_organization[organization_id] += 1
        observed.HELD.inc()

    def give_room(self, endpoint_id: str, *, organization_id: UUID) -> None:
        self._held[endpoint_id] -= 1
        if not self._held[endpoint_id]:
            del self._held[endpoint_id]
        self._held_by_organization[organization_id] -= 1
        if not self._held_by_organization[organization_id]:
            del self._held_by_organization[organization_id]
        observed.HELD.dec()

    async def wait_for_replica(self, exchange: Exchange, receive: Receive, send: Send) -> Route:
        """Wake the exchange's endpoint if it is at zero and wait until it has a ready
        replica; returns the route with it. The request has taken its room (take_room),
        which this gives back. Raises GatewayError past the hold's time, at once if the
        endpoint's replica cannot be placed, or if the endpoint is stopped or deleted
        meanwhile, and ClientGone if the client leaves."""
        route = exchange.route
        assert route is not None and exchange.identity is not None
        organization_id, endpoint_id, name = (exchange.identity.organization_id,
                                               route.endpoint_id, route.name)
        started = time.perf_counter()
        deadline = started + settings.KVRUN_GATEWAY_HOLD_SECONDS
        left = asyncio.ensure_future(_client_left(receive))
        watched = self._watch.add(endpoint_id=endpoint_id, organization_id=organization_id)
        try:
            await self._wake(route)
            if exchange.stream:
                await send({"type": "http.response.start", "status": 200,
                            "headers": response_headers(exchange, [
                                (b"content-type", b"text/event-stream"),
                                (b"cache-control", b"no-cache"),
                                (b"x-kvrun-cold-start", b"true")])})
                exchange.response_started = True
            told = 0.0
            while True:
                generation = watched.generation
                # The watch reads the organisation's routes again when the endpoint changes;
                # until then they are served from memory.
                routes = await self._directory.routes(
                    organization_id, max_age=settings.KVRUN_GATEWAY_HOLD_SECONDS)
                found = routes.get(name)
                if found is None or found.endpoint_id != endpoint_id:
                    raise GatewayError(503, f"Endpoint {name!r} was deleted while this "
                                       "request waited for it.", code="endpoint_not_ready")
                route = found
                if route.upstreams:
                    if exchange.stream:
                        await _comment(send, f"ready after {time.perf_counter() - started:.1f} s")
                    return route
                if not route.scales_to_zero:
                    why = ("failed to start; its events in the dashboard say why"
                           if route.state == State.FAILED else "stopped")
                    raise GatewayError(503, f"Endpoint {name!r} was {why} while this "
                                       "request waited for it.", code="endpoint_not_ready")
                if watched.unplaced:
                    raise GatewayError(
                        503, f"Endpoint {name!r} cannot start now: {watched.unplaced}. Retry "
                        "later, or choose other hardware for it.",
                        code="cold_start_unplaceable",
                        headers=[(b"retry-after", str(UNPLACED_RETRY_SECONDS).encode())])
                if route.desired_replicas == 0:  # scaled to zero again since it was woken
                    await self._wake(route)
                now = time.perf_counter()
                if now >= deadline:
                    raise GatewayError(
                        503, f"Endpoint {route.name!r} did not start within the "
                        f"{settings.KVRUN_GATEWAY_HOLD_SECONDS:.0f} s a request waits for it: "
                        f"it is {_progress(route)}. Retry then.", code="cold_start_timeout",
                        headers=[(b"retry-after", retry_after(route))])
                if exchange.stream and now - told >= COMMENT_SECONDS:
                    await _comment(send, f"starting from zero: {_progress(route)}")
                    told = now
                changed = asyncio.ensure_future(watched.told_since(generation))
                try:
                    done, _ = await asyncio.wait([left, changed], timeout=min(
                        COMMENT_SECONDS, deadline - now), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if left in done:
                    exchange.disconnected = True
                    raise ClientGone
        finally:
            left.cancel()
            self._watch.discard(endpoint_id)
            self.give_room(endpoint_id, organization_id=organization_id)
            exchange.held_seconds = time.perf_counter() - started

    async def _wake(self, route: Route) -> None:
        """One wake at a time per endpoint from this process, however many requests wait."""
        pending = self._waking.get(route.endpoint_id)
        if pending is None:
            pending = asyncio.ensure_future(self._watch.run(
                do_wake_endpoint, endpoint_id=UUID(route.endpoint_id)))
            self._waking[route.endpoint_id] = pending
            pending.add_done_callback(lambda _: self._waking.pop(route.endpoint_id, None))
        try:
            await asyncio.shield(pending)
        except (OperationalError, InterfaceError) as error:  # PostgreSQL away: come back
            wait = retry_after(route)
            raise GatewayError(
                503, f"Endpoint {route.name!r} is scaled to zero and kvrun could not start it "
                f"just now (its database did not answer); retry in {wait.decode()} s.",
                code="cold_start_unavailable", headers=[(b"retry-after", wait)]) from error


async def _comment(send: Send, text: str) -> None:
    await send({"type": "http.response.body", "body": f": kvrun: {text}\n\n".encode(),
                "more_body": True})


async def _client_left(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
