"""The gateway's ASGI app in this process, as uvicorn runs it: on an event loop of its own
thread, its lifespan started and stopped around each test, called through httpx's ASGI
transport."""

import asyncio
import gc
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import httpx
import orjson
from django.conf import settings
from redis.asyncio import Redis

from accounts.revocations import KEY_REVOKED_CHANNEL
from billing.ingestion import do_ingest_usage
from billing.models import UsageRecord
from gateway.app import Gateway
from gateway.directory import Upstream
from kvrun.redis import redis_client
from tests.helpers import wait_until


class InProcessGateway:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopped = False
        subscribers = _revocation_subscribers()
        self.app = Gateway()
        self.run(self.app.start())
        # Started, as after uvicorn's lifespan, and listening for revocations.
        assert wait_until(lambda: _revocation_subscribers() > subscribers, 5, interval=0.01)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://gateway", timeout=30)

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> Future:
        """Run `coroutine` on the gateway's loop; its result comes later."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return self.submit(coroutine).result(timeout)

    async def send(self, secret: str | None, body: object, path: str = "/v1/completions",
                   **headers: str) -> httpx.Response:
        if secret:
            headers["Authorization"] = f"Bearer {secret}"
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        return await self.client.post(path, content=content, headers=headers)

    def post(self, secret: str | None, body: object, path: str = "/v1/completions",
             **headers: str) -> httpx.Response:
        return self.run(self.send(secret, body, path, **headers))

    def get(self, secret: str, path: str) -> httpx.Response:
        return self.run(self.client.get(path, headers={"Authorization": f"Bearer {secret}"}))

    def stop(self) -> None:
        """Shut down as uvicorn does after its last request: every usage report is written."""
        if not self._stopped:
            self._stopped = True
            self.run(self.client.aclose())
            self.run(self.app.stop())
            gc.unfreeze()  # the app froze the test process's heap, as it does a web process's

    def upstreams(self, organization_id: object) -> dict[str, Upstream]:
        """Each ready replica as this gateway sees it (its requests in flight, its tries)."""
        routes = self.run(self.app.directory.routes(organization_id))
        return {upstream.replica_id: upstream
                for route in routes.values() for upstream in route.upstreams}

    def upstreams_in_flight(self, organization_id: object) -> dict[str, int]:
        """Each ready replica's requests in flight, as this gateway counts them."""
        return {replica_id: upstream.in_flight
                for replica_id, upstream in self.upstreams(organization_id).items()}


def _revocation_subscribers() -> int:
    return dict(redis_client().pubsub_numsub(KEY_REVOKED_CHANNEL))[KEY_REVOKED_CHANNEL.encode()]


def stored(count: int, timeout: float = 5) -> bool:
    """Ingest the usage stream until `count` records are stored; False if they are not there
    in time."""
    def enough() -> bool:
        do_ingest_usage()
        return UsageRecord.objects.count() >= count
    return wait_until(enough, timeout, interval=0.05)


def received(stub: httpx.Client) -> list[dict]:
    """The requests a stand-in engine was sent."""
    return stub.get("/_requests").json()


async def with_redis(work: Callable[[Redis], Awaitable[Any]]) -> Any:
    """`work` done with a Redis client of its own, closed after."""
    redis = Redis.from_url(settings.REDIS_URL)
    try:
        return await work(redis)
    finally:
        await redis.aclose()
