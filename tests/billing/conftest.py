from datetime import UTC, datetime
from decimal import Decimal

import pytest

from accounts.models import Organization
from billing.models import GPUPrice
from endpoints.models import Endpoint, GPUType, Node, Replica
from tests.billing.helpers import demo_endpoint


@pytest.fixture
def cpu_endpoint(cpu_node: Node, org: Organization) -> Endpoint:
    endpoint = demo_endpoint(org)
    Replica.objects.create(endpoint=endpoint)
    cpu = GPUType.objects.get(slug="cpu")
    GPUPrice.objects.create(gpu_type=cpu, hourly_price_usd=Decimal("0.4000"),
                            effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    return endpoint
