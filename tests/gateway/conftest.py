import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from accounts.models import Organization
from endpoints.models import Endpoint
from tests.factories import inference_key, ready_endpoint
from tests.gateway.helpers import InProcessGateway


@pytest.fixture(scope="session")
def gateway_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


@pytest.fixture
def gateway(gateway_loop: asyncio.AbstractEventLoop,
            transactional_db: None) -> Iterator[InProcessGateway]:
    # Transactional: the gateway reads keys and routes on a thread of its own, which must
    # see what the test wrote.
    app = InProcessGateway(gateway_loop)
    yield app
    app.stop()


@pytest.fixture
def stubs(stub_ports: list[int]) -> Iterator[list[httpx.Client]]:
    """Clients of the stand-in engines, with what they were sent forgotten."""
    clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}") for port in stub_ports]
    for client in clients:
        client.delete("/_requests")
    yield clients
    for client in clients:
        client.close()


@pytest.fixture
def endpoint(org: Organization, stub_ports: list[int]) -> Endpoint:
    return ready_endpoint(org, "chat", stub_ports[:1])


@pytest.fixture
def secret(org: Organization) -> str:
    return inference_key(org)[1]
