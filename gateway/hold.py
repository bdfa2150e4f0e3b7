"""Requests to an endpoint scaled to zero: the first one wakes it, and each waits for its
replica instead of being refused.

A held stream gets its response headers at once and, every few seconds, an SSE comment line
with the start's stage and ETA (clients ignore comments); a request not streamed just waits.
Holds are bounded in time (KVRUN_GATEWAY_HOLD_SECONDS) and in count per endpoint in this
process (KVRUN_GATEWAY_HOLD_MAX_REQUESTS): past either the answer is a 503 or a 429 with
Retry-After from the ETA. The ETA is the median time this model's recent starts took on this
kind of node (endpoints.selectors.median_start_seconds), less what this start has taken.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from uuid import UUID

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections

from endpoints.models import State
from endpoints.services import do_wake_endpoint
from gateway.asgi import ClientGone, Receive, Send, response_headers
from gateway.directory import Directory, Route
from gateway.errors import GatewayError
from gateway.exchange import Exchange

# How often a held request asks whether a replica is ready: a small share of a cold start.
POLL_SECONDS = 0.25
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


def _wake(endpoint_id: str) -> bool:
    close_old_connections()  # this thread serves no Django request that would do it
    return do_wake_endpoint(endpoint_id=UUID(endpoint_id))


class ColdStarts:
    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._held: Counter[str] = Counter()
        self._waking: dict[str, asyncio.Future[bool]] = {}

    def take_room(self, route: Route) -> None:
        """Count a request as held for the endpoint, or refuse it with a 429 past the bound.
        Counted at once, with no await between the check and the count, so that a burst
        cannot pass the bound; wait_for_replica gives the room back, and give_room where
        the request is refused before it waits."""
        held, most = self._held[route.endpoint_id], settings.KVRUN_GATEWAY_HOLD_MAX_REQUESTS
        if held >= most:
            wait = retry_after(route)
            raise GatewayError(
                429, f"Endpoint {route.name!r} is starting from zero and {held} requests already "
                f"wait for it, the most that may; retry in {wait.decode()} s.",
                code="cold_start_queue_full", kind="requests",
                headers=[(b"retry-after", wait)])
        self._held[route.endpoint_id] += 1

    def give_room(self, route: Route) -> None:
        self._held[route.endpoint_id] -= 1
        if not self._held[route.endpoint_id]:
            del self._held[route.endpoint_id]

    async def wait_for_replica(self, exchange: Exchange, receive: Receive, send: Send) -> Route:
        """Wake the exchange's endpoint if it is at zero and wait until it has a ready
        replica; returns the route with it. The request has taken its room (take_room),
        which this gives back. Raises GatewayError past the hold's time, or if the endpoint
        is stopped or deleted meanwhile, and ClientGone if the client leaves."""
        route = exchange.route
        assert route is not None and exchange.identity is not None
        started = time.perf_counter()
        deadline = started + settings.KVRUN_GATEWAY_HOLD_SECONDS
        left = asyncio.ensure_future(_client_left(receive))
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
                # Read at most once a poll for every request held for the organisation.
                routes = await self._directory.routes(exchange.identity.organization_id,
                                                      max_age=POLL_SECONDS)
                route = routes.get(route.name, route)
                if route.upstreams:
                    if exchange.stream:
                        await _comment(send, f"ready after {time.perf_counter() - started:.1f} s")
                    return route
                if route.name not in routes or not route.scales_to_zero:
                    why = ("deleted" if route.name not in routes else
                           "failed to start; its events in the dashboard say why"
                           if route.state == State.FAILED else "stopped")
                    raise GatewayError(503, f"Endpoint {route.name!r} was {why} while this "
                                       "request waited for it.", code="endpoint_not_ready")
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
                done, _ = await asyncio.wait([left], timeout=POLL_SECONDS)
                if done:
                    exchange.disconnected = True
                    raise ClientGone
        finally:
            left.cancel()
            self.give_room(route)
            exchange.held_seconds = time.perf_counter() - started

    async def _wake(self, route: Route) -> None:
        """One wake at a time per endpoint from this process, however many requests wait."""
        pending = self._waking.get(route.endpoint_id)
        if pending is None:
            pending = asyncio.ensure_future(sync_to_async(_wake)(route.endpoint_id))
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
