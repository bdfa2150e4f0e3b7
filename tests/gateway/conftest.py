import asyncio
import threading
from collections.abc import Iterator

import pytest

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
