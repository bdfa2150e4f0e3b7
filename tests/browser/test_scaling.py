"""Scaling in a real Chromium against Django alone: an endpoint at zero in the list and on
its page, its scaling settings changed there, and the wizard's scale-to-zero price."""

from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from accounts.models import Organization
from endpoints.models import Endpoint, Node, Replica, State
from endpoints.services import do_load_catalogs
from engine.devices import HostResources
from nodes.services import do_register_node
from tests.browser.conftest import sign_up
from tests.factories import ready_endpoint

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_owner_sees_an_endpoint_at_zero_and_changes_how_it_scales(
        live_server: object, page: Page, shot: Callable[[str], None]) -> None:
    do_load_catalogs()
    do_register_node(name="laptop", resources=HostResources(devices=[], cpu_count=2,
                                                            memory_bytes=24 * 2**30))
    sign_up(page, live_server.url)
    endpoint = ready_endpoint(Organization.objects.get(name="Engines"), "sleepy", ports=[],
                              state=State.IDLE, min_replicas=0, desired_replicas=0,
                              max_replicas=2)
    started = timezone.now() - timedelta(hours=1)
    Replica.objects.create(endpoint=endpoint, state=State.STOPPED, created_at=started,
                           ready_at=started + timedelta(seconds=23),
                           node=Node.objects.get(name="stub-node"))

    page.goto(f"{live_server.url}/orgs/engines/")
    expect(page.get_by_role("row", name="sleepy")).to_contain_text(
        "scaled to zero; a request wakes it in about 23 s")
    shot("endpoints-at-zero")

    page.get_by_role("link", name="sleepy").click()
    expect(page.get_by_test_id("idle")).to_contain_text("waits about 23 s")
    page.get_by_text("Autoscaling and scale to zero").click()
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
        live_server: object, page: Page, shot: Callable[[str], None]) -> None:
    do_load_catalogs()
    do_register_node(name="laptop", resources=HostResources(devices=[], cpu_count=2,
                                                            memory_bytes=24 * 2**30))
    sign_up(page, live_server.url)
    page.get_by_role("link", name="Create your first endpoint").click()
    page.get_by_label("Search").fill("demo")
    page.get_by_text("kvrun demo").click()

    expect(page.get_by_test_id("scale-to-zero-price")).to_contain_text(
        "With fewest replicas 0 it scales to zero when idle: idle 50 % of the time, about $")
    page.get_by_label("Fewest replicas").fill("0")
    shot("wizard-scale-to-zero")
