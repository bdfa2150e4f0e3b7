"""The usage and billing pages: the month so far and projected, invoices, the rows behind a
line, CSV; and each endpoint's cost on the endpoint pages."""

import csv
import io
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.test import Client
from django.utils import timezone

from accounts.models import Organization
from accounts.services import do_set_billing_hold
from billing.models import Budget, BudgetEvent, GPUPrice, TokenPrice
from billing.rollup import do_roll_up_usage
from endpoints.models import Endpoint, Node, Replica, State
from tests.billing.helpers import finalize_at, ready_for, record, run_replica
from tests.factories import demo_endpoint, inference_key

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 2, 10, 12, tzinfo=UTC)


@pytest.fixture
def billed(org: Organization, cpu_node: Node) -> Iterator[Endpoint]:
    """January final (10 h ready and 1,000 completion tokens); in February a replica ready
    since 10:00, at $0.40 an hour. The clock stays at NOW."""
    endpoint = demo_endpoint(org)
    replica = Replica.objects.create(endpoint=endpoint)
    GPUPrice.objects.create(gpu_type=endpoint.gpu_type, hourly_price_usd=Decimal("0.4"),
                            effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    TokenPrice.objects.create(model=endpoint.model, completion_per_million_usd=Decimal("100"),
                              effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    key, _ = inference_key(org)
    ready_for(endpoint, cpu_node, datetime(2026, 1, 10, 8, tzinfo=UTC), hours=10)
    record(endpoint, key, datetime(2026, 1, 10, 9, tzinfo=UTC), completion_tokens=1_000)
    finalize_at(datetime(2026, 2, 1, 2, tzinfo=UTC))
    started = NOW - timedelta(hours=2)
    run_replica(replica, cpu_node, [(started, State.SCHEDULING), (started, State.STARTING),
                                    (started, State.LOADING), (started, State.READY)])
    with time_machine.travel(NOW, tick=False):
        do_roll_up_usage()
        yield endpoint


def test_it_shows_the_month_so_far_its_projection_and_the_invoices(
        owner_client: Client, org: Organization, billed: Endpoint) -> None:
    response = owner_client.get(f"/orgs/{org.slug}/billing/")

    assert response.status_code == 200
    assert response.context["so_far_cents"] == 80
    # $0.40 an hour for the 444 hours from Feb 10 12:00 to the month's end.
    assert response.context["projected_cents"] == 80 + 17_760
    page = response.content.decode()
    assert "$0.80" in page and "$178.40" in page
    assert [(invoice.month.month, invoice.status, invoice.total_cents)
            for invoice in response.context["invoices"]] == [(2, "draft", 80),
                                                              (1, "final", 410)]
    daily = response.context["daily"]
    assert daily["gpu_hours"][-1] == 2.0 and sum(daily["gpu_hours"]) == 2.0


def test_an_invoice_lists_its_lines_and_each_shows_the_rows_behind_it(
        owner_client: Client, org: Organization, billed: Endpoint) -> None:
    invoice = owner_client.get(f"/orgs/{org.slug}/billing/2026-01/")
    lines = invoice.context["invoice"].lines
    ready = next(n for n, line in enumerate(lines, 1) if line.description.endswith("ready"))
    tokens = next(n for n, line in enumerate(lines, 1) if "tokens" in line.description)

    intervals = owner_client.get(f"/orgs/{org.slug}/billing/2026-01/lines/{ready}/")
    records = owner_client.get(f"/orgs/{org.slug}/billing/2026-01/lines/{tokens}/")

    assert invoice.status_code == 200
    assert b"$4.10" in invoice.content and f"KVR-202601-{org.slug}".encode() in invoice.content
    assert intervals.status_code == 200 and intervals.context["count"] == 1
    assert b"2026-01-10 08:00:30" in intervals.content
    assert records.status_code == 200
    assert [row.completion_tokens for row in records.context["rows"]] == [1_000]


def test_an_invoice_downloads_as_csv(owner_client: Client, org: Organization,
                                     billed: Endpoint) -> None:
    response = owner_client.get(f"/orgs/{org.slug}/billing/2026-01/csv/")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert sum(Decimal(row["amount_usd"]) for row in rows) == Decimal("4.10")
    assert all(re.fullmatch(r"-?\d+\.\d\d", row["amount_usd"]) for row in rows)  # cents shown
    assert {row["invoice"] for row in rows} == {f"KVR-202601-{org.slug}"}


def test_members_see_no_billing(member_client: Client, org: Organization,
                                billed: Endpoint) -> None:
    for path in ["billing/", "billing/2026-01/", "billing/2026-01/csv/",
                 "billing/2026-01/lines/1/"]:
        assert member_client.get(f"/orgs/{org.slug}/{path}").status_code == 403
    assert b"Usage &amp; billing" not in member_client.get(f"/orgs/{org.slug}/").content


def test_it_validates_ownership(owner_client: Client, other_org: Organization,
                                billed: Endpoint) -> None:
    assert owner_client.get(f"/orgs/{other_org.slug}/billing/").status_code == 404
    assert owner_client.get(f"/orgs/{other_org.slug}/billing/2026-01/").status_code == 404


@pytest.mark.parametrize("path", ["billing/2026-03/", "billing/2026-13/",
                                  "billing/2026-01/lines/99/", "billing/0001-01/",
                                  "billing/0001-01/csv/"])
def test_a_month_or_line_that_does_not_exist_is_a_404(owner_client: Client, org: Organization,
                                                      billed: Endpoint, path: str) -> None:
    assert owner_client.get(f"/orgs/{org.slug}/{path}").status_code == 404


def test_the_endpoint_pages_show_its_cost(owner_client: Client, org: Organization,
                                          billed: Endpoint) -> None:
    listed = owner_client.get(f"/orgs/{org.slug}/")
    detail = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/")

    assert listed.context["rows"][0]["month_cents"] == 80
    assert b"$0.80" in listed.content and b"Usage &amp; billing" in listed.content
    assert detail.context["month_cents"] == 80
    assert detail.context["costs"]["hour"].gpu_cost_usd == Decimal("0.4")


def test_an_owner_sets_a_budget_and_sees_the_thresholds_it_reached(
        owner_client: Client, org: Organization, billed: Endpoint) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/billing/budget/", {
        "monthly_limit_usd": "1.00", "thresholds": "50, 80%, 100", "action": "stop"})

    assert response.status_code == 302
    budget = Budget.objects.get(organization=org)
    assert (budget.monthly_limit_cents, budget.thresholds, budget.action) == (100, [50, 80, 100],
                                                                            "stop")
    # $0.80 spent and $0.40 an hour running: 80 % is reached at once, 100 % within the check.
    page = owner_client.get(f"/orgs/{org.slug}/billing/")
    assert [event.threshold for event in page.context["budget_events"]] == [80, 50]  # newest
    assert b"$1.00 a month" in page.content


def test_a_month_s_budget_events_come_a_page_at_a_time(owner_client: Client,
                                                       org: Organization) -> None:
    month = timezone.now().date().replace(day=1)
    Budget.objects.create(organization=org, monthly_limit_cents=100)
    BudgetEvent.objects.bulk_create([
        BudgetEvent(organization=org, month=month, threshold=50, limit_cents=100 + number,
                    spend_cents=50, projected_cents=60, at=timezone.now()) for number in range(25)])

    first = owner_client.get(f"/orgs/{org.slug}/billing/")
    second = owner_client.get(f"/orgs/{org.slug}/billing/?events=2")

    assert len(first.context["budget_events"]) == 20
    assert [event.limit_cents for event in second.context["budget_events"]] == [
        104, 103, 102, 101, 100]
    assert b"Events 1\xe2\x80\x9320 of 25" in first.content


@pytest.mark.parametrize(("thresholds", "phrase"), [
    ("50, 2000", "from 1 to 1000"),
    ("50, 8\u00b2", "Give whole percentages"),
    ("9" * 5000, "Give whole percentages"),
])
def test_a_budget_that_makes_no_sense_shows_the_error_next_to_its_field(
        owner_client: Client, org: Organization, billed: Endpoint, thresholds: str,
        phrase: str) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/billing/budget/", {
        "monthly_limit_usd": "5", "thresholds": thresholds, "action": "stop"})

    assert response.status_code == 400
    assert phrase in response.context["budget_form"].errors["thresholds"][0]
    assert not Budget.objects.exists()


def test_members_cannot_set_a_budget(member_client: Client, org: Organization,
                                     billed: Endpoint) -> None:
    response = member_client.post(f"/orgs/{org.slug}/billing/budget/", {
        "monthly_limit_usd": "5", "thresholds": "100", "action": "stop"})

    assert response.status_code == 403
    assert not Budget.objects.exists()


def test_every_page_of_a_held_organisation_says_why(member_client: Client, org: Organization,
                                                    billed: Endpoint) -> None:
    do_set_billing_hold(organization_id=org.id, reason="The monthly budget of $1.00 is reached.")

    response = member_client.get(f"/orgs/{org.slug}/")

    assert b"The monthly budget of $1.00 is reached." in response.content


def test_an_adapter_s_tokens_are_a_line_of_their_own_with_its_records(
        owner_client: Client, org: Organization, billed: Endpoint) -> None:
    key, _ = inference_key(org)
    for adapter, tokens in (("legal", 2_000), ("", 500)):
        record(billed, key, NOW - timedelta(hours=1), completion_tokens=tokens, adapter=adapter)
    with time_machine.travel(NOW, tick=False):
        do_roll_up_usage()
        rows = list(csv.DictReader(io.StringIO(owner_client.get(
            f"/orgs/{org.slug}/billing/2026-02/csv/").content.decode())))
        tokens = [(row["line"], row["endpoint"], row["adapter"], row["amount_usd"])
                  for row in rows if row["kind"] == "completion_tokens"]
        assert [line[1:] for line in tokens] == [("chat", "", "0.05"), ("chat", "legal", "0.20")]
        legal = owner_client.get(f"/orgs/{org.slug}/billing/2026-02/lines/{tokens[1][0]}/")

    assert [(row.adapter, row.completion_tokens) for row in legal.context["rows"]] == [
        ("legal", 2_000)]


def test_the_usage_page_splits_the_month_s_tokens_by_adapter(
        owner_client: Client, org: Organization, billed: Endpoint) -> None:
    key, _ = inference_key(org)
    for adapter, tokens in (("legal", 2_000), ("legal", 1_000), ("", 500)):
        record(billed, key, NOW - timedelta(hours=1), completion_tokens=tokens, adapter=adapter)
    with time_machine.travel(NOW, tick=False):
        do_roll_up_usage()
        response = owner_client.get(f"/orgs/{org.slug}/billing/")

    assert [(row["endpoint__name"], row["adapter"], row["requests"], row["completion_tokens"])
            for row in response.context["tokens_by_model"]] == [
        ("chat", "", 1, 500), ("chat", "legal", 2, 3_000)]
    assert "<code>chat:legal</code>" in response.content.decode()
