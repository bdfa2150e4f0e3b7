"""Scaling in a real Chromium against Django alone: an endpoint at zero in the list and on
its page with its replica timeline, its scaling settings changed there, and the wizard's
scale-to-zero price."""

from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from accounts.models import Organization
from endpoints.models import Endpoint, Node, State
from tests.browser.conftest import choose_the_demo_model
from tests.factories import endpoint_at_zero, replica_history

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_owner_sees_an_endpoint_at_zero_and_changes_how_it_scales(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    endpoint = endpoint_at_zero(Organization.objects.get(name="Engines"), "sleepy",
                                start_seconds=23, max_replicas=2)
    now = timezone.now()
    Endpoint.objects.filter(id=endpoint.id).update(created_at=now - timedelta(hours=6))
    for came, went in [(5 * 60, 50), (3 * 60, 2 * 60)]:  # minutes ago
        replica_history(endpoint, [(now - timedelta(minutes=came), State.STARTING),
                                   (now - timedelta(minutes=came - 1), State.READY),
                                   (now - timedelta(minutes=went), State.STOPPING),
                                   (now - timedelta(minutes=went - 1), State.STOPPED)])

    page.goto(f"{live_server.url}/orgs/engines/")
    expect(page.get_by_role("row", name="sleepy")).to_contain_text(
        "scaled to zero; a request wakes it in about 23 s")
    shot("endpoints-at-zero")

    page.get_by_role("link", name="sleepy").click()
    expect(page.get_by_test_id("idle")).to_contain_text("waits about 23 s")
    # The replica timeline draws the ledger: one replica, a second for an hour, none now.
    expect(page.get_by_test_id("replica-timeline").locator("canvas")).to_be_visible()
    drawn = page.request.get(f"{live_server.url}/orgs/engines/endpoints/sleepy/replicas/").json()
    assert (max(drawn["ready"]), drawn["ready"][-1]) == (2, 0)
    page.get_by_text("Autoscaling and scale to zero").click()
    # A range upside down is refused under its field, the settings still open as sent.
    page.get_by_label("Fewest replicas").fill("3")
    page.get_by_label("Most replicas").fill("2")
    page.get_by_label("Most replicas").press("Enter")
    expect(page.locator("#id_max_replicas_error")).to_contain_text("Choose between 3")
    expect(page.get_by_label("Fewest replicas")).to_have_value("3")
    shot("endpoint-scaling-refused")
    page.get_by_label("Fewest replicas").fill("0")
    page.get_by_label("Idle time before zero (s)").fill("300")
    page.get_by_label("Most replicas").fill("3")
    shot("endpoint-scaling")
    # Enter, not a click: the status above is re-rendered every 2 s and moves the button.
    page.get_by_label("Most replicas").press("Enter")

    expect(page.get_by_role("status").first).to_contain_text(
        "Scaling changed: 0 to 3 replicas, 0 now.")
    changed = Endpoint.objects.get(id=endpoint.id)
    assert (changed.scale_to_zero_after_seconds, changed.max_replicas) == (300, 3)
    shot("endpoint-scaling-changed")


def test_the_wizard_shows_what_scaling_to_zero_would_cost_a_month(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    choose_the_demo_model(page)

    expect(page.get_by_test_id("scale-to-zero-price")).to_contain_text(
        "With fewest replicas 0 it scales to zero when idle: idle 50 % of the time, about $")
    page.get_by_label("Fewest replicas").fill("0")
    shot("wizard-scale-to-zero")
