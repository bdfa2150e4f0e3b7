"""What needs a real web process: the gateway beside Django in uvicorn, usage kept through
SIGTERM, and the control worker's ingestion task."""

import signal
import threading
from collections.abc import Callable

import httpx
import orjson
import pytest

from billing.models import UsageRecord
from endpoints.models import Endpoint
from engine.processes import free_port
from tests.gateway.helpers import received
from tests.helpers import start_web, stop, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def call(base: str, secret: str, body: object) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", content=orjson.dumps(body), timeout=30,
                      headers={"Authorization": f"Bearer {secret}"})


def test_only_v1_reaches_the_gateway_and_no_engine_path_is_exposed(
    web: str, stub_endpoint: Endpoint, secret: str
) -> None:
    auth = {"Authorization": f"Bearer {secret}"}

    assert call(web, secret, {"model": "chat", "prompt": "hello"}).status_code == 200
    assert httpx.get(f"{web}/health", headers=auth).status_code == 404
    # kvrun's own /metrics, which wants its scraper's token: an API key is refused.
    assert httpx.get(f"{web}/metrics", headers=auth).status_code == 401
    assert httpx.get(f"{web}/healthz").json() == {"status": "ok"}


def test_usage_survives_a_web_process_told_to_stop(
    stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client], ingested: Callable[..., bool]
) -> None:
    # Records wait 3 s in memory for others to join their write: only the flush at shutdown
    # can store those of the requests that end while the process stops.
    port = free_port()
    web = start_web(port, KVRUN_GATEWAY_GATHER_SECONDS="3")
    base = f"http://127.0.0.1:{port}"
    answered: dict[str, int] = {}  # request id: status, for every request that was answered

    def send() -> None:
        try:
            response = call(base, secret, {"model": "chat", "prompt": "slow"})
        except httpx.TransportError:
            return  # the server had stopped taking connections; the engine's list tells
        answered[response.headers["x-request-id"]] = response.status_code

    threads = [threading.Thread(target=send) for _ in range(12)]
    try:
        for thread in threads[:8]:
            thread.start()
        assert wait_until(lambda: len(received(stubs[0])) == 8, 10, interval=0.02)
        web.send_signal(signal.SIGTERM)  # 8 requests in flight at the engine
        for thread in threads[8:]:
            thread.start()
        for thread in threads:
            thread.join()
        assert web.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    finally:
        stop(web)

    # Every request the engine was sent, whatever its client saw, has its record.
    at_engine = {sent["request_id"] for sent in received(stubs[0])}
    assert len(at_engine) >= 8 and set(answered) <= at_engine
    assert ingested(len(at_engine))
    stored = dict(UsageRecord.objects.values_list("request_id", "status_code"))
    assert stored == {request_id: 200 for request_id in at_engine}
    assert set(answered.values()) == {200}
