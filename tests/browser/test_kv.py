"""The KV cache on an endpoint's page and in the wizard, in a real Chromium against Django
alone (engine samples and advice recorded as the node agent and beat would)."""

from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from accounts.models import Organization
from endpoints.models import Endpoint, Node
from engine.metrics import EngineSnapshot
from telemetry.advice import do_advise_endpoint
from telemetry.services import do_record_engine_samples
from tests.browser.conftest import choose_the_demo_model
from tests.factories import ready_endpoint

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_owner_sees_the_cache_charts_and_applies_the_advice(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    endpoint = ready_endpoint(Organization.objects.get(name="Engines"), "chat", ports=[41010])
    replica = endpoint.replicas.get()
    now = timezone.now()
    do_record_engine_samples(samples=[
        (replica.id, endpoint.id, now - timedelta(seconds=ago), EngineSnapshot(
            kv_cache_usage=0.95, running=4, waiting=2, prefix_queries=1000 * (600 - ago),
            prefix_hits=700 * (600 - ago), external_queries=None, external_hits=None,
            preemptions=(600 - ago) // 60, prompt_tokens=1000 * (600 - ago),
            generation_tokens=0, requests=0)) for ago in range(10, 300, 10)])
    do_advise_endpoint(endpoint=endpoint, now=now)

    page.goto(f"{live_server.url}/orgs/engines/endpoints/chat/")

    expect(page.get_by_test_id("kv-policy")).to_contain_text("prefix-affinity routing on")
    expect(page.locator("section[aria-labelledby=kv-title] canvas")).to_have_count(5)
    advice = page.get_by_test_id("kv-advice")
    expect(advice).to_contain_text("Cache-bound")
    # A CPU engine's KV pool is its budget: the room comes from a larger one.
    expect(advice).to_contain_text("a budget of 16 concurrent requests")
    shot("endpoint-kv")

    advice.get_by_role("button", name="Apply: concurrency 16").click()
    expect(page.get_by_role("status").first).to_contain_text("Advice applied")
    expect(page.get_by_test_id("kv-policy")).to_contain_text("policy version 2")
    assert Endpoint.objects.get(id=endpoint.id).concurrency == 16
    shot("endpoint-kv-applied")


def test_the_wizard_explains_a_tier_the_cpu_node_cannot_use(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    choose_the_demo_model(page)
    expect(page.get_by_test_id("kv-tokens")).to_contain_text("tokens")

    page.get_by_text("KV cache policy: tiers, isolation and routing").click()
    page.get_by_label("Host-memory KV tier (GiB per replica)").fill("8")
    refusal = page.get_by_test_id("sizing-refusal")
    expect(refusal).to_contain_text("cannot offload KV to host memory")
    shot("wizard-kv-refusal")

    refusal.get_by_role("button", name="No host tier").click()
    expect(page.get_by_test_id("sizing")).to_contain_text("1 × CPU only")
