import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal

import httpx
import pytest

from accounts.models import Organization
from billing.models import GPUPrice
from endpoints.models import Endpoint, GPUType, Node, Replica
from engine.processes import dying_with_parent, free_port
from kvrun.launcher import wait_until_listening
from tests.factories import demo_endpoint
from tests.helpers import stop

WEBHOOK_SECRET = "whsec_kvrun_test"


@pytest.fixture
def cpu_endpoint(cpu_node: Node, org: Organization) -> Endpoint:
    endpoint = demo_endpoint(org)
    Replica.objects.create(endpoint=endpoint)
    cpu = GPUType.objects.get(slug="cpu")
    GPUPrice.objects.create(gpu_type=cpu, hourly_price_usd=Decimal("0.4000"),
                            effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    return endpoint


@pytest.fixture(scope="session")
def localstripe_url() -> Iterator[str]:
    """A local Stripe stand-in (localstripe), for the whole session."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "localstripe", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=dying_with_parent)
    wait_until_listening(process, port)
    yield f"http://127.0.0.1:{port}"
    stop(process)


@pytest.fixture
def stripe_on(localstripe_url: str, settings: object) -> str:
    """kvrun configured for the stand-in, which starts each test empty."""
    settings.STRIPE_SECRET_KEY = "sk_test_kvrun"
    settings.STRIPE_API_BASE = localstripe_url
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    httpx.delete(f"{localstripe_url}/_config/data").raise_for_status()
    return localstripe_url
