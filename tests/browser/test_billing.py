"""The usage and billing pages in a real Chromium: the month so far and its charts, a
finalised invoice, the rows behind one of its lines, and the page at phone width."""

from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from accounts.models import Organization, User
from billing.invoicing import lines_for_month, month_bounds, month_of
from billing.models import GPUPrice
from billing.rollup import do_roll_up_usage, mark_stale_hours
from endpoints.models import Node, Replica, State
from front.templatetags.units import cents
from tests.billing.helpers import finalize_at, ready_for, run_replica
from tests.factories import demo_endpoint

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_billing_pages_show_the_month_its_invoices_and_the_rows_behind_a_line(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    organization = Organization.objects.get()
    endpoint = demo_endpoint(organization)
    replica = Replica.objects.create(endpoint=endpoint)
    GPUPrice.objects.create(gpu_type=endpoint.gpu_type, hourly_price_usd=Decimal("2.5"),
                            effective_from=timezone.now() - timedelta(days=400))
    now = timezone.now()
    this_month = month_bounds(month_of(now))[0]
    last_month = month_bounds(month_of(this_month - timedelta(days=1)))[0]
    ready_for(endpoint, laptop, last_month + timedelta(days=9, hours=8), hours=10)
    finalize_at(this_month + timedelta(hours=2))
    started = now - timedelta(hours=1)
    run_replica(replica, laptop, [(started, State.SCHEDULING), (started, State.STARTING),
                                (started, State.LOADING), (started, State.READY)])
    do_roll_up_usage()

    page.get_by_role("navigation", name="Main").get_by_role(
        "link", name="Usage & billing").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Usage & billing")
    # An hour at $2.50 (less, in a month's first hour).
    so_far = sum(line.amount_cents for line in lines_for_month(
        organization_id=organization.id, month=month_of(now)))
    assert 0 < so_far <= 250
    expect(page.get_by_test_id("month-so-far")).to_have_text(cents(so_far))
    expect(page.locator("#daily-charts canvas")).to_have_count(2)
    shot("billing")

    page.get_by_role("link", name=f"{last_month:%B %Y}").click()
    # 10 h ready at $2.50, and 10 s starting and 20 s loading at a cent each (rounded once a
    # line); 5 s stopping round to nothing.
    expect(page.get_by_test_id("invoice-total")).to_have_text("$25.02")
    expect(page.get_by_role("table")).to_contain_text("chat: CPU only, ready")
    shot("billing-invoice")

    page.get_by_role("row", name="chat: CPU only, ready").get_by_role(
        "link", name="What's behind it").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("chat: CPU only, ready")
    expect(page.get_by_role("table")).to_contain_text(
        f"{last_month + timedelta(days=9, hours=8, seconds=30):%Y-%m-%d %H:%M:%S}")
    shot("billing-invoice-line")

    # A budget below what the month has cost, set to stop: the endpoints stop at once and
    # every page says why and how to lift it.
    page.goto(f"{live_server.url}/orgs/{organization.slug}/billing/")
    page.get_by_label("Monthly limit (USD)").fill("1.00")
    page.get_by_label("At 100 %").select_option("stop")
    page.get_by_role("button", name="Set a budget").click()
    expect(page.get_by_test_id("billing-hold")).to_contain_text(
        "monthly budget of $1.00 is reached")
    expect(page.get_by_test_id("budget-events")).to_contain_text("endpoints stopped")
    shot("billing-budget")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Endpoints").click()
    expect(page.get_by_test_id("billing-hold")).to_contain_text("raise the budget")
    shot("billing-budget-endpoints")

    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{live_server.url}/orgs/{organization.slug}/billing/")
    expect(page.locator("#daily-charts canvas")).to_have_count(2)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    shot("billing-phone")


def test_an_operator_sees_the_rollup_s_lag_in_the_console(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    endpoint = demo_endpoint(Organization.objects.get())
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    mark_stale_hours(records=[(endpoint.id, hour), (endpoint.id, hour + timedelta(hours=1))])
    User.objects.create_superuser(email="operator@example.com", password="console 2026 pass")
    page.goto(f"{live_server.url}/admin/login/?next=/admin/billing/rollupstate/")
    page.get_by_label("Email").fill("operator@example.com")
    page.get_by_label("Password").fill("console 2026 pass")
    page.get_by_role("button", name="Log in").click()

    row = page.locator("#result_list tbody tr")
    expect(row).to_have_count(1)
    expect(row.locator("td.field-oldest_stale_hour")).to_have_text(f"{hour:%Y-%m-%d %H:00} UTC")
    expect(row.locator("td.field-stale_hours")).to_have_text("2")
    expect(row.locator("td.field-batches")).to_have_text("10,000 stale hours")
    shot("console-rollup-state")
