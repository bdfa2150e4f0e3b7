"""Prices by where an endpoint runs: a region's own price for endpoints that require the
region, the general price for the rest wherever they run, and the operator's own-node price
(nothing by default) for GPU time on an organisation's own nodes. Each is a version, quoted
as billed."""

import csv
import io
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

from accounts.models import Organization, User
from billing.invoicing import draft_lines
from billing.models import GPUPrice, Invoice
from billing.rollup import do_quote_prices_in_effect, hour_of
from billing.selectors import invoice_of, usage_behind
from endpoints.models import Endpoint, GPUType, Node, Region, RegionalPrice
from tests.billing.helpers import finalize_at, ready_for
from tests.factories import UserFactory

JAN = date(2026, 1, 1)
FEB_1 = datetime(2026, 2, 1, tzinfo=UTC)
SINCE_2025 = datetime(2025, 1, 1, tzinfo=UTC)

pytestmark = pytest.mark.django_db


@pytest.fixture
def eu() -> Region:
    return Region.objects.create(slug="eu-west", name="EU West")


def gpu_lines(month: date, organization: Organization) -> list[tuple]:
    return [(line.description, line.quantity, line.unit_price_usd, line.amount_cents)
            for line in draft_lines(organization_id=organization.id, month=month)
            if "ready" in line.description]


def test_an_endpoint_requiring_a_region_pays_its_price_and_the_rest_the_general_one(
        cpu_endpoint: Endpoint, cpu_node: Node, eu: Region, org: Organization) -> None:
    cpu = GPUType.objects.get(slug="cpu")
    GPUPrice.objects.create(gpu_type=cpu, region=eu, hourly_price_usd=Decimal("0.6"),
                            effective_from=datetime(2026, 1, 10, tzinfo=UTC))
    pinned = Endpoint.objects.create(**{
        field: getattr(cpu_endpoint, field) for field in (
            "organization", "model", "context_length", "concurrency", "gpu_type",
            "gpu_count", "hourly_price_usd")}, name="pinned", region=eu)
    pinned.replicas.create()
    # Both on the same node, the same hours: only the endpoint that required the region
    # pays its price, and only from its first version on.
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 9, 21, 59, 30, tzinfo=UTC), hours=4)
    ready_for(pinned, cpu_node, datetime(2026, 1, 9, 21, 59, 30, tzinfo=UTC), hours=4)

    assert finalize_at(FEB_1 - timedelta(minutes=1)) == 0  # rolled up, still a draft
    assert gpu_lines(JAN, org) == [
        ("chat: CPU only, ready", Decimal("4"), Decimal("0.4"), 160),
        ("pinned: CPU only, ready", Decimal("2"), Decimal("0.4"), 80),
        ("pinned: CPU only, ready", Decimal("2"), Decimal("0.6"), 120)]


def test_gpu_time_on_an_own_node_costs_nothing_until_the_operator_prices_it(
        cpu_endpoint: Endpoint, cpu_node: Node, org: Organization) -> None:
    Node.objects.filter(id=cpu_node.id).update(organization=org)
    cpu = GPUType.objects.get(slug="cpu")
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 9, 21, 59, 30, tzinfo=UTC), hours=4)
    GPUPrice.objects.create(gpu_type=cpu, own_nodes=True, hourly_price_usd=Decimal("0.05"),
                            effective_from=datetime(2026, 1, 20, tzinfo=UTC))
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 20, 0, 0, tzinfo=UTC), hours=2)

    assert finalize_at(FEB_1 + timedelta(hours=2)) == 1

    lines = Invoice.objects.get().lines.filter(description__contains="ready")
    assert [(line.description, line.quantity, line.unit_price_usd, line.amount_cents,
             line.own_node) for line in lines] == [
        ("chat: CPU only, ready, own nodes", Decimal("4"), Decimal("0"), 0, True),
        ("chat: CPU only, ready, own nodes", Decimal("2"), Decimal("0.05"), 10, True)]


def test_what_is_quoted_follows_the_version_in_effect_for_where_it_runs(
        cpu_endpoint: Endpoint, eu: Region, org: Organization) -> None:
    cpu = GPUType.objects.get(slug="cpu")
    next_hour = hour_of(timezone.now()) + timedelta(hours=1)
    GPUPrice.objects.create(gpu_type=cpu, region=eu, hourly_price_usd=Decimal("0.7"),
                            effective_from=next_hour)
    GPUPrice.objects.create(gpu_type=cpu, own_nodes=True, hourly_price_usd=Decimal("0.02"),
                            effective_from=next_hour)
    pinned = Endpoint.objects.filter(id=cpu_endpoint.id)
    pinned.update(region=eu)
    own = Endpoint.objects.create(
        organization=org, name="own", model=cpu_endpoint.model, context_length=2048,
        concurrency=4, gpu_type=cpu, gpu_count=1, own_nodes_only=True, hourly_price_usd=0)

    do_quote_prices_in_effect(now=timezone.now())
    assert pinned.get().hourly_price_usd == Decimal("0.4")  # the general one, until then
    assert not RegionalPrice.objects.exists()
    with time_machine.travel(next_hour + timedelta(minutes=1)):
        assert do_quote_prices_in_effect(now=timezone.now()) == 2

    assert RegionalPrice.objects.get().hourly_price_usd == Decimal("0.7")
    assert pinned.get().hourly_price_usd == Decimal("0.7")
    assert Endpoint.objects.get(id=own.id).hourly_price_usd == Decimal("0.02")
    assert GPUType.objects.get(slug="cpu").own_node_price_usd == Decimal("0.02")


def test_an_own_node_price_is_one_for_every_region(cpu_endpoint: Endpoint,
                                                   eu: Region) -> None:
    price = GPUPrice(gpu_type=GPUType.objects.get(slug="cpu"), own_nodes=True, region=eu,
                     hourly_price_usd=Decimal("1"),
                     effective_from=hour_of(timezone.now()) + timedelta(hours=1))

    with pytest.raises(ValidationError, match="one for every region: leave the region empty"):
        price.full_clean()


def test_versions_of_one_scope_start_once_and_scopes_stand_apart(eu: Region,
                                                                 cpu_endpoint: Endpoint) -> None:
    start = hour_of(timezone.now()) + timedelta(hours=1)
    cpu = GPUType.objects.get(slug="cpu")
    for scope in ({}, {"region": eu}, {"own_nodes": True}):
        GPUPrice.objects.create(gpu_type=cpu, hourly_price_usd=Decimal("1"),
                                effective_from=start, **scope)
    again = GPUPrice(gpu_type=cpu, region=eu, hourly_price_usd=Decimal("2"),
                     effective_from=start)

    with pytest.raises(ValidationError, match="already exists"):
        again.full_clean()
    assert GPUPrice.objects.filter(effective_from=SINCE_2025).count() == 1


def test_an_operator_adds_a_regional_and_an_own_node_price_in_the_console(
        client: Client, eu: Region, cpu_endpoint: Endpoint) -> None:
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    cpu = GPUType.objects.get(slug="cpu")
    start = hour_of(timezone.now()) + timedelta(hours=1)
    form = {"gpu_type": cpu.id, "hourly_price_usd": "0.9", "effective_from_0":
            f"{start:%Y-%m-%d}", "effective_from_1": f"{start:%H:%M:%S}"}

    refused = client.post("/admin/billing/gpuprice/add/", {**form, "region": eu.id,
                                                            "own_nodes": "on"})
    assert "leave the region empty" in str(refused.context["adminform"].form.errors)
    for scope in ({"region": eu.id}, {"own_nodes": "on"}):
        assert client.post("/admin/billing/gpuprice/add/", {**form, **scope}).status_code == 302

    assert sorted((str(price.region), price.own_nodes) for price in
                  GPUPrice.objects.filter(effective_from=start)) == [
        ("EU West", False), ("None", True)]
    listed = client.get("/admin/billing/gpuprice/")
    assert b"organisations&#x27; own nodes" in listed.content
    assert b"EU West" in listed.content


def test_own_and_shared_hours_are_lines_of_their_own_down_to_their_intervals_and_csv(
        cpu_endpoint: Endpoint, cpu_node: Node, org: Organization, owner: User) -> None:
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 9, 8, tzinfo=UTC), hours=3)
    Node.objects.filter(id=cpu_node.id).update(organization=org)
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 9, 12, tzinfo=UTC), hours=1)
    assert finalize_at(FEB_1 + timedelta(hours=2)) == 1
    invoice = invoice_of(organization=org, month=JAN)
    ready = [line for line in invoice.lines if line.phase == "ready"]

    assert [(line.own_node, line.quantity, line.amount_cents) for line in ready] == [
        (False, Decimal("3"), 120), (True, Decimal("1"), 0)]
    assert [[interval.own_node for interval in usage_behind(
        organization=org, line=line, billed_at=invoice.finalized_at)] for line in ready] == [
        [False], [True]]
    client = Client()
    client.force_login(owner)
    rows = list(csv.DictReader(io.StringIO(client.get(
        f"/orgs/{org.slug}/billing/2026-01/csv/").content.decode())))
    assert [(row["description"], row["own_nodes"]) for row in rows
            if row["phase"] == "ready"] == [("chat: CPU only, ready", "False"),
                                            ("chat: CPU only, ready, own nodes", "True")]
