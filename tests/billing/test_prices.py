"""Prices are versions: the one in effect is the one billed, and the one quoted."""

from datetime import timedelta
from decimal import Decimal

import pytest
import time_machine
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import Organization
from billing.models import GPUPrice
from billing.rollup import do_quote_prices_in_effect, hour_of
from endpoints.models import Endpoint, GPUType
from endpoints.services import do_load_catalogs

pytestmark = pytest.mark.django_db

SIZING = {"model": "kvrun-demo-tiny", "context_length": 2048, "concurrency": 4,
          "gpu_type": "cpu"}


def test_a_new_price_version_is_quoted_from_when_it_takes_effect(
        owner_api: APIClient, org: Organization, cpu_endpoint: Endpoint) -> None:
    cpu = GPUType.objects.get(slug="cpu")
    next_hour = hour_of(timezone.now()) + timedelta(hours=1)
    GPUPrice.objects.create(gpu_type=cpu, hourly_price_usd=Decimal("0.8"),
                            effective_from=next_hour)

    # The catalog lists $0.10; the version in effect since 2025 (the fixture's) is $0.40,
    # and the next one is not in effect yet.
    assert cpu.hourly_price_usd == Decimal("0.1")
    assert do_quote_prices_in_effect(now=timezone.now()) == 1
    assert owner_api.post("/api/v1/sizing/", SIZING, format="json").json()[
        "hourly_price_usd"] == "0.4000"

    with time_machine.travel(next_hour + timedelta(minutes=1)):
        assert do_quote_prices_in_effect(now=timezone.now()) == 1
        sized = owner_api.post("/api/v1/sizing/", SIZING, format="json").json()
        cost = owner_api.get(f"/api/v1/organizations/{org.slug}/endpoints/chat/cost/").json()

    assert sized["hourly_price_usd"] == "0.8000"
    assert cost["hourly_price_usd"] == "0.8000"
    # A catalog reload (every start) leaves the price to its versions.
    do_load_catalogs()
    assert GPUType.objects.get(slug="cpu").hourly_price_usd == Decimal("0.8")
