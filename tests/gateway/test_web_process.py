"""What needs a real web process: the gateway beside Django in uvicorn, usage kept through
SIGTERM, and the control worker's ingestion task."""

import signal
import threading
import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from billing.models import UsageRecord
from endpoints.models import Endpoint
from engine.processes import free_port
from tests.helpers import start_web, stop

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def call(base: str, secret: str, body: object) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", content=orjson.dumps(body), timeout=30,
                      headers={"Authorization": f"Bearer {secret}"})


def test_only_v1_reaches_the_gateway_and_no_engine_path_is_exposed(
    web: str, endpoint: Endpoint, secret: str
) -> None:
    auth = {"Authorization": f"Bearer {secret}"}

    assert call(web, secret, {"model": "chat", "prompt": "hello"}).status_code == 200
    assert httpx.get(f"{web}/health", headers=auth).status_code == 404
    assert httpx.get(f"{web}/metrics", headers=auth).status_code == 404
    assert httpx.get(f"{web}/healthz").json() == {"status": "ok"}


def test_usage_survives_a_web_process_told_to_stop(
    endpoint: Endpoint, secret: str, ingested: Callable[..., bool]
) -> None:
    port = free_port()
    web = start_web(port)
    base = f"http://127.0.0.1:{port}"
    answered: list[int] = []

    def send() -> None:
        try:
            answered.append(call(base, secret, {"model": "chat", "prompt": "slow"}).status_code)
        except httpx.TransportError:
            pass  # the server had stopped taking connections; nothing was admitted

    threads = [threading.Thread(target=send) for _ in range(12)]
    try:
        for thread in threads[:8]:
            thread.start()
        time.sleep(0.5)
        web.send_signal(signal.SIGTERM)  # 8 requests in flight
        for thread in threads[8:]:
            thread.start()
        for thread in threads:
            thread.join()
        assert web.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    finally:
        stop(web)

    assert answered.count(200) >= 8
    assert ingested(len(answered))
    assert UsageRecord.objects.count() == len(answered) == answered.count(200)
