"""The gateway's ASGI app in this process, as uvicorn runs it: on an event loop of its own
thread, its lifespan started and stopped around each test, called through httpx's ASGI
transport."""

import asyncio
import gc
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import httpx
import orjson
from django.conf import settings
from redis.asyncio import Redis

from accounts.models import Organization
from accounts.revocations import KEY_REVOKED_CHANNEL
from billing.ingestion import do_ingest_usage
from billing.models import UsageRecord
from gateway.app import Gateway
from gateway.directory import Upstream
from gateway.limits import in_flight_name
from kvrun.common.redis import redis_client
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


def events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def engine_received(port: int, count: int) -> Callable[[], Awaitable[bool]]:
    """Whether the stand-in engine on `port` has been sent `count` requests (for raw_client's
    leave_when)."""
    async def reached() -> bool:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as stub:
            return len((await stub.get("/_requests")).json()) >= count
    return reached


async def raw_client(gateway: InProcessGateway, secret: str, body: dict, *,
                     after_frames: int | None = None,
                     leave_when: Callable[[], Awaitable[bool]] | None = None,
                     reading_seconds: float = 0.0, upload_seconds: float = 0.0,
                     headers: dict[str, str] | None = None,
                     on_frame: Callable[[dict], Awaitable[None]] | None = None) -> list[bytes]:
    """Call the app as a client that takes `upload_seconds` to send its body, disconnects
    after `after_frames` body frames or once `leave_when()` is true, and takes
    `reading_seconds` to read each frame (a server's send blocks while its client does not
    read), calling `on_frame` with each message as it arrives; returns the body frames it
    got. httpx's transport can do none of it."""
    gone = asyncio.Event()
    frames: list[bytes] = []
    request = [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]

    async def receive() -> dict:
        if request:
            await asyncio.sleep(upload_seconds)
            return request.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set():
            return  # as a server does: nothing reaches a client that has left
        if on_frame is not None:
            await on_frame(message)
        if message["type"] == "http.response.body" and message.get("body"):
            await asyncio.sleep(reading_seconds)
            frames.append(message["body"])
            if after_frames is not None and len(frames) >= after_frames:
                gone.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"authorization", f"Bearer {secret}".encode()),
                         *((name.encode(), value.encode())
                           for name, value in (headers or {}).items())]}
    call = asyncio.ensure_future(gateway.app(scope, receive, send))
    if leave_when is not None:
        while not await leave_when():
            await asyncio.sleep(0.01)
        gone.set()
    await call
    return frames


def documented_cache_salt(organization_id: object, key_id: object = None) -> str:
    """kvrun.common.digests' formula, worked out here apart from it: the first 32 hex digits of
    HMAC-SHA256(pepper, "cache-salt:<organisation id>"), with ":key:<key id>" after it where
    an endpoint keeps keys apart."""
    message = (f"cache-salt:{organization_id}" + (f":key:{key_id}" if key_id else "")).encode()
    return hmac.new(settings.KVRUN_KEY_PEPPER.encode(), message, hashlib.sha256).hexdigest()[:32]


def nothing_held(gateway: InProcessGateway, organization: Organization) -> bool:
    """No request of the organisation still counts as in flight, in Redis or in the
    gateway's own count per replica (call once the gateway has stopped)."""
    held = redis_client().zcard(in_flight_name(organization.id))
    return held == 0 and not any(gateway.upstreams_in_flight(organization.id).values())
