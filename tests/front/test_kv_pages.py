from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import Organization
from endpoints.models import Endpoint, Node
from engine.metrics import EngineSnapshot
from telemetry.models import Advice, AdviceKind
from telemetry.services import do_record_engine_samples
from tests.factories import ready_endpoint

pytestmark = pytest.mark.django_db


def snapshot(*, queries: int, hits: int, usage: float) -> EngineSnapshot:
    return EngineSnapshot(kv_cache_usage=usage, running=2, waiting=1, prefix_queries=queries,
                          prefix_hits=hits, external_queries=None, external_hits=None,
                          preemptions=0, prompt_tokens=queries, generation_tokens=0,
                          requests=0)


def open_advice(endpoint: Endpoint) -> Advice:
    now = timezone.now()
    return Advice.objects.create(
        endpoint=endpoint, kind=AdviceKind.CACHE_BOUND, opened_at=now, last_seen_at=now,
        message="Cache-bound: the KV cache was at least 90 % full in 80% of the last 10 "
                "minutes' samples.", figures={"kv_cache_high_share": 0.8},
        change={"kv_cache_dtype": "fp8"})


def test_the_endpoint_page_shows_the_kv_policy_advice_and_charts(
        owner_client: Client, member_client: Client, org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[])
    open_advice(endpoint)

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/")
    seen = member_client.get(f"/orgs/{org.slug}/endpoints/chat/")

    assert b"prefixes shared within the organisation" in page.content
    assert b"prefix-affinity routing on" in page.content
    assert b"at least 90 % full in 80%" in page.content
    assert b"Apply: kv cache dtype fp8" in page.content
    assert f'data-url="/orgs/{org.slug}/endpoints/chat/kv/"'.encode() in page.content
    assert b"Change the KV policy" in page.content
    assert b"at least 90 % full" in seen.content  # members read the advice...
    assert b"Apply:" not in seen.content and b"Change the KV policy" not in seen.content


def test_the_kv_series_gives_each_minute_s_usage_and_hit_rate_in_percent(
        owner_client: Client, org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[41009])
    replica = endpoint.replicas.get()
    now = timezone.now()
    do_record_engine_samples(samples=[
        (replica.id, endpoint.id, now - timedelta(seconds=130), snapshot(queries=0, hits=0,
                                                                         usage=0.1)),
        (replica.id, endpoint.id, now - timedelta(seconds=70), snapshot(queries=400, hits=300,
                                                                        usage=0.5))])

    data = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/kv/").json()

    assert data["kv_cache_usage_pct"] == [10.0, 50.0]
    assert data["prefix_hit_rate_pct"] == [None, 75.0]
    assert data["running"] == [2, 2] and data["waiting"] == [1, 1]
    assert len(data["times"]) == 2 and data["times"][0] < data["times"][1]
    # The charts span the hour they are captioned with, not only the minutes with samples.
    assert data["until"] - data["since"] == 3600
    assert data["since"] <= data["times"][0] and data["times"][-1] <= data["until"] + 60


def test_a_policy_change_from_the_page_says_how_replicas_restart(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    ready_endpoint(org, "chat", ports=[])
    form = {"context_length": "2048", "concurrency": "4", "kv_cache_dtype": "auto",
            "prefix_caching": "", "host_tier_gib": "0", "disk_tier_gib": "0",
            "cache_isolation": "key", "prefix_affinity": "on"}

    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/policy/", form, follow=True)

    assert b"KV policy changed. Its one replica restarts" in response.content
    endpoint = Endpoint.objects.get(name="chat")
    assert (endpoint.prefix_caching, endpoint.concurrency, endpoint.cache_isolation,
            endpoint.policy_version) == (False, 4, "key", 2)


def test_a_tier_the_cpu_engine_cannot_use_is_refused_on_the_page_and_changes_nothing(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    ready_endpoint(org, "chat", ports=[])
    form = {"context_length": "2048", "concurrency": "8", "kv_cache_dtype": "auto",
            "prefix_caching": "on", "host_tier_gib": "16", "disk_tier_gib": "0",
            "cache_isolation": "organization", "prefix_affinity": "on"}

    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/policy/", form)

    assert response.status_code == 400
    page = response.content.decode()
    assert '<ul class="errors" id="id_host_tier_gib_error" role="alert">' in page
    assert "cannot offload KV to host memory" in page
    assert '<details class="kv-policy" id="policy" open>' in page
    endpoint = Endpoint.objects.get(name="chat")
    assert (endpoint.host_tier_gib, endpoint.policy_version) == (0, 1)


def test_applying_advice_from_the_page_changes_the_policy_once(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[])
    advice = open_advice(endpoint)
    url = f"/orgs/{org.slug}/endpoints/chat/advice/{advice.id}/apply/"

    applied = owner_client.post(url, follow=True)
    again = owner_client.post(url, follow=True)

    assert b"Advice applied. Its one replica restarts" in applied.content
    assert b"no one-click change open" in again.content
    endpoint.refresh_from_db()
    assert (endpoint.kv_cache_dtype, endpoint.policy_version) == ("fp8", 2)
    assert Advice.objects.get().resolved_at is not None


def test_the_wizard_shows_a_tier_s_tokens_and_refuses_one_the_hardware_cannot_use(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    sizing = f"/orgs/{org.slug}/endpoints/new/sizing/"
    on_gpu = {"model": "llama-3.1-8b-instruct", "context_length": "8192", "concurrency": "8",
              "kv_cache_dtype": "auto", "gpu_type": "h100-80gb", "host_tier_gib": "64",
              "disk_tier_gib": "0"}
    on_cpu = {"model": "kvrun-demo-tiny", "context_length": "2048", "concurrency": "8",
              "kv_cache_dtype": "auto", "gpu_type": "", "host_tier_gib": "8",
              "disk_tier_gib": "0"}

    gpu = owner_client.post(sizing, on_gpu)
    cpu = owner_client.post(sizing, on_cpu)
    launched = owner_client.post(f"/orgs/{org.slug}/endpoints/new/", {
        **on_cpu, "name": "tiered", "min_replicas": "1", "cache_isolation": "organization",
        "prefix_affinity": "on", "prefix_caching": "on"})

    assert b"Host tier (64 GiB)" in gpu.content
    assert b"524,288 more tokens of cached prefixes" in gpu.content  # 64 GiB / 128 KiB
    assert b"The KV policy cannot run on this hardware" in cpu.content
    assert b"CPU Offloading is currently only supported" in cpu.content
    assert launched.status_code == 400
    assert not Endpoint.objects.filter(name="tiered").exists()
