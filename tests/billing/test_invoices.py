"""Monthly invoices: priced at each hour's price, final after the grace period, once, with
late usage as an adjustment on the next invoice."""

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.core.exceptions import ValidationError

from accounts.models import APIKey, Organization
from billing.invoicing import do_finalize_due_invoices, draft_lines
from billing.models import GPUPrice, Invoice, InvoiceLine, TokenPrice
from billing.rollup import do_roll_up_usage
from endpoints.models import Endpoint, Node, Replica
from tests.billing.helpers import finalize_at, ready_for, record
from tests.factories import demo_endpoint, inference_key, organization_with_owner
from tests.helpers import at_once

JAN = date(2026, 1, 1)
FEB = date(2026, 2, 1)
FEB_1 = datetime(2026, 2, 1, tzinfo=UTC)
MAR_1 = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.fixture
def key(org: Organization) -> APIKey:
    return inference_key(org)[0]


def lines_of(invoice: Invoice) -> list[tuple]:
    return list(invoice.lines.values_list("description", "quantity", "unit_price_usd",
                                          "amount_cents"))


def test_a_month_s_invoice_bills_each_phase_at_its_price_and_tokens_at_theirs(
        cpu_endpoint: Endpoint, cpu_node: Node, key: APIKey) -> None:
    TokenPrice.objects.create(
        model=cpu_endpoint.model, prompt_per_million_usd=Decimal("1.00"),
        cached_per_million_usd=Decimal("0.50"), completion_per_million_usd=Decimal("2.00"),
        effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 10, 8, tzinfo=UTC), hours=10)
    record(cpu_endpoint, key, datetime(2026, 1, 10, 9, tzinfo=UTC), prompt_tokens=3_000_000,
           cached_tokens=1_000_000, completion_tokens=1_500_000)

    assert finalize_at(FEB_1 + timedelta(hours=1, seconds=1)) == 1

    invoice = Invoice.objects.get()
    assert (invoice.month, invoice.number) == (
        JAN, f"KVR-202601-{cpu_endpoint.organization.slug}")
    assert lines_of(invoice) == [
        ("chat: CPU only, starting", Decimal("0.002778"), Decimal("0.4"), 0),
        ("chat: CPU only, loading", Decimal("0.005556"), Decimal("0.4"), 0),
        ("chat: CPU only, ready", Decimal("10"), Decimal("0.4"), 400),
        ("chat: CPU only, stopping", Decimal("0.001389"), Decimal("0.4"), 0),
        ("chat: prompt tokens", Decimal("2"), Decimal("1"), 200),
        ("chat: cached prompt tokens", Decimal("1"), Decimal("0.5"), 50),
        ("chat: completion tokens", Decimal("1.5"), Decimal("2"), 300),
    ]
    assert invoice.total_cents == 950


def test_an_embedding_or_reranking_endpoint_s_tokens_are_a_kind_of_their_own(
        cpu_endpoint: Endpoint, org: Organization, key: APIKey) -> None:
    # Beside a chat endpoint whose tokens have no price: only theirs are billed.
    for slug, name in (("kvrun-demo-embed", "embed"), ("kvrun-demo-rerank", "rerank")):
        endpoint = demo_endpoint(org, name=name, model=slug)
        Replica.objects.create(endpoint=endpoint)
        TokenPrice.objects.create(model=endpoint.model, prompt_per_million_usd=Decimal("0.02"),
                                  effective_from=datetime(2025, 1, 1, tzinfo=UTC))
        record(endpoint, key, datetime(2026, 1, 10, 9, tzinfo=UTC), prompt_tokens=50_000_000)

    finalize_at(FEB_1 + timedelta(hours=1, seconds=1))

    invoice = Invoice.objects.get()
    assert lines_of(invoice) == [
        ("embed: embedded tokens", Decimal("50"), Decimal("0.02"), 100),
        ("rerank: scored tokens", Decimal("50"), Decimal("0.02"), 100)]
    assert list(invoice.lines.values_list("kind", flat=True)) == [
        "embedded_tokens", "scored_tokens"]


def test_only_the_billed_phases_are_on_the_invoice(cpu_endpoint: Endpoint, cpu_node: Node,
                                                   settings: object) -> None:
    settings.KVRUN_BILLED_PHASES = ["ready"]
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 10, 8, tzinfo=UTC), hours=2.5)

    finalize_at(FEB_1 + timedelta(hours=2))

    assert lines_of(Invoice.objects.get()) == [
        ("chat: CPU only, ready", Decimal("2.5"), Decimal("0.4"), 100)]


def test_an_hour_runs_at_the_price_in_effect_when_it_ran(cpu_endpoint: Endpoint,
                                                         cpu_node: Node) -> None:
    GPUPrice.objects.create(gpu_type=cpu_endpoint.gpu_type,
                            hourly_price_usd=Decimal("1.0000"),
                            effective_from=datetime(2026, 1, 15, tzinfo=UTC))
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 14, 21, 59, 30, tzinfo=UTC), hours=4)
    finalize_at(FEB_1 + timedelta(hours=2))

    ready = [line for line in lines_of(Invoice.objects.get()) if "ready" in line[0]]
    assert ready == [("chat: CPU only, ready", Decimal("2"), Decimal("0.4"), 80),
                     ("chat: CPU only, ready", Decimal("2"), Decimal("1"), 200)]


@pytest.mark.parametrize(("effective_from", "message"), [
    (datetime(2026, 1, 1, tzinfo=UTC), "cannot start in the past"),
    (datetime(2027, 1, 1, 0, 30, tzinfo=UTC), "start of a UTC hour"),
])
def test_a_price_cannot_start_in_the_past_or_mid_hour(cpu_endpoint: Endpoint,
                                                      effective_from: datetime,
                                                      message: str) -> None:
    price = GPUPrice(gpu_type=cpu_endpoint.gpu_type, hourly_price_usd=Decimal("9"),
                     effective_from=effective_from)

    with pytest.raises(ValidationError, match=message):
        price.full_clean()


def test_the_month_stays_a_draft_through_its_grace_period_and_is_finalised_once(
        cpu_endpoint: Endpoint, cpu_node: Node) -> None:
    ready_for(cpu_endpoint, cpu_node, datetime(2026, 1, 31, 22, tzinfo=UTC), hours=1)

    assert finalize_at(FEB_1 + timedelta(minutes=59)) == 0
    with time_machine.travel(FEB_1 + timedelta(minutes=59), tick=False):
        assert sum(line.amount_cents for line in draft_lines(
            organization_id=cpu_endpoint.organization_id, month=JAN)) == 40
    assert finalize_at(FEB_1 + timedelta(hours=1)) == 1
    assert finalize_at(FEB_1 + timedelta(hours=2)) == 0

    assert Invoice.objects.count() == 1 and InvoiceLine.objects.count() == 4


@pytest.mark.django_db(transaction=True)
def test_two_workers_finalising_at_once_store_one_invoice(cpu_node: Node,
                                                          org: Organization) -> None:
    endpoint = demo_endpoint(org)
    Replica.objects.create(endpoint=endpoint)
    ready_for(endpoint, cpu_node, datetime(2026, 1, 5, tzinfo=UTC), hours=3)
    with time_machine.travel(FEB_1 + timedelta(hours=2), tick=False):
        do_roll_up_usage()
    def finalize() -> int:
        with time_machine.travel(FEB_1 + timedelta(hours=2), tick=False):
            return do_finalize_due_invoices()

    finalized = at_once(finalize, finalize)

    assert sorted(finalized) == [0, 1]
    assert Invoice.objects.count() == 1
    assert InvoiceLine.objects.count() == 4


def test_usage_that_arrives_after_finalisation_is_one_adjustment_line_next_month(
        cpu_endpoint: Endpoint, cpu_node: Node, key: APIKey) -> None:
    TokenPrice.objects.create(model=cpu_endpoint.model,
                              completion_per_million_usd=Decimal("100"),
                              effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    record(cpu_endpoint, key, datetime(2026, 1, 20, tzinfo=UTC), completion_tokens=10_000)
    finalize_at(FEB_1 + timedelta(hours=2))
    january = Invoice.objects.get(month=JAN)
    january_lines = lines_of(january)

    record(cpu_endpoint, key, datetime(2026, 1, 31, 23, 59, tzinfo=UTC),
           completion_tokens=2_500)
    record(cpu_endpoint, key, datetime(2026, 2, 10, tzinfo=UTC), completion_tokens=1_000)
    finalize_at(MAR_1 + timedelta(hours=2))
    finalize_at(datetime(2026, 4, 1, 2, tzinfo=UTC))

    february = Invoice.objects.get(month=FEB)
    assert lines_of(february) == [
        ("chat: completion tokens", Decimal("0.001"), Decimal("100"), 10),
        ("Adjustment for January 2026: chat: completion tokens, recorded after its invoice",
         Decimal("0.0025"), Decimal("100"), 25)]
    adjustment = february.lines.get(adjustment=True)
    assert adjustment.usage_month == JAN
    assert lines_of(Invoice.objects.get(month=JAN)) == january_lines
    assert Invoice.objects.count() == 2  # nothing more to bill in March


def test_an_adjustment_is_billed_even_without_usage_in_the_next_month(
        cpu_endpoint: Endpoint, key: APIKey) -> None:
    TokenPrice.objects.create(model=cpu_endpoint.model,
                              completion_per_million_usd=Decimal("100"),
                              effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    record(cpu_endpoint, key, datetime(2026, 1, 20, tzinfo=UTC), completion_tokens=10_000)
    finalize_at(FEB_1 + timedelta(hours=2))
    record(cpu_endpoint, key, datetime(2026, 1, 21, tzinfo=UTC), completion_tokens=10_000)

    assert finalize_at(MAR_1 + timedelta(hours=2)) == 1

    february = Invoice.objects.get(month=FEB)
    assert [(line.adjustment, line.usage_month, line.amount_cents)
            for line in february.lines.all()] == [(True, JAN, 100)]
    assert february.total_cents == 100


def test_a_price_change_of_one_kind_leaves_the_others_one_line_each(
        cpu_endpoint: Endpoint, key: APIKey) -> None:
    for completion, since in ((2, datetime(2025, 1, 1, tzinfo=UTC)),
                              (3, datetime(2026, 1, 15, tzinfo=UTC))):
        TokenPrice.objects.create(model=cpu_endpoint.model, prompt_per_million_usd=Decimal(1),
                                  completion_per_million_usd=Decimal(completion),
                                  effective_from=since)
    for day in (10, 20):
        record(cpu_endpoint, key, datetime(2026, 1, day, tzinfo=UTC), prompt_tokens=1_000_000,
               completion_tokens=0)
    finalize_at(FEB_1 + timedelta(hours=2))
    record(cpu_endpoint, key, datetime(2026, 1, 31, 23, 59, tzinfo=UTC), prompt_tokens=0,
           completion_tokens=100_000)

    finalize_at(MAR_1 + timedelta(hours=2))

    assert lines_of(Invoice.objects.get(month=JAN)) == [
        ("chat: prompt tokens", Decimal(2), Decimal(1), 200)]
    # Only what arrived late is adjusted: the prompt tokens are not credited back.
    assert lines_of(Invoice.objects.get(month=FEB)) == [
        ("Adjustment for January 2026: chat: completion tokens, recorded after its invoice",
         Decimal("0.1"), Decimal(3), 30)]


def test_an_organisation_with_the_longest_slug_is_invoiced(cpu_node: Node) -> None:
    organization = organization_with_owner("A" * 50 + " Laboratories of Inference")
    endpoint = demo_endpoint(organization)
    Replica.objects.create(endpoint=endpoint)
    ready_for(endpoint, cpu_node, datetime(2026, 1, 10, 8, tzinfo=UTC), hours=1)

    assert finalize_at(FEB_1 + timedelta(hours=2)) == 1

    assert Invoice.objects.get().number == f"KVR-202601-{organization.slug}"


def test_tokens_are_billed_per_adapter_and_adjusted_per_adapter(
        cpu_endpoint: Endpoint, key: APIKey) -> None:
    TokenPrice.objects.create(model=cpu_endpoint.model,
                              completion_per_million_usd=Decimal("100"),
                              effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    for adapter, tokens in (("", 10_000), ("legal", 20_000), ("legal", 5_000),
                            ("support", 1_000)):
        record(cpu_endpoint, key, datetime(2026, 1, 20, tzinfo=UTC), completion_tokens=tokens,
               adapter=adapter)
    finalize_at(FEB_1 + timedelta(hours=2))

    january = Invoice.objects.get(month=JAN)
    assert lines_of(january) == [
        ("chat: completion tokens", Decimal("0.01"), Decimal("100"), 100),
        ("chat:legal: completion tokens", Decimal("0.025"), Decimal("100"), 250),
        ("chat:support: completion tokens", Decimal("0.001"), Decimal("100"), 10)]
    assert list(january.lines.values_list("adapter", flat=True)) == ["", "legal", "support"]

    record(cpu_endpoint, key, datetime(2026, 1, 31, tzinfo=UTC), completion_tokens=2_000,
           adapter="legal")
    finalize_at(MAR_1 + timedelta(hours=2))

    assert lines_of(Invoice.objects.get(month=FEB)) == [
        ("Adjustment for January 2026: chat:legal: completion tokens, recorded after its "
         "invoice", Decimal("0.002"), Decimal("100"), 20)]
