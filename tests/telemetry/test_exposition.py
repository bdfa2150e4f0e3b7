import json
import re
from datetime import timedelta

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from accounts.models import Organization
from billing.ingestion import do_record_usage
from billing.models import StaleUsageHour
from billing.rollup import do_roll_up_usage
from engine.metrics import EngineSnapshot
from gateway import observed
from telemetry.services import do_record_engine_samples
from tests.factories import inference_key, ready_endpoint, usage_report
from tests.helpers import ROOT

pytestmark = pytest.mark.django_db
TOKEN = "scraper-secret"


def snapshot(*, usage: float, running: int, hits: int, tier: int | None = None
             ) -> EngineSnapshot:
    return EngineSnapshot(kv_cache_usage=usage, running=running, waiting=1, prefix_queries=1000,
                          prefix_hits=hits, external_queries=tier, external_hits=tier,
                          preemptions=3, prompt_tokens=1000, generation_tokens=400, requests=9)


def scrape(client: Client) -> str:
    with override_settings(KVRUN_METRICS_TOKEN=TOKEN):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    return response.content.decode()


@pytest.fixture
def sampled(org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[41020, 41021])
    first, second = endpoint.replicas.all()
    now = timezone.now()
    do_record_engine_samples(samples=[
        (first.id, endpoint.id, now - timedelta(seconds=10), snapshot(usage=0.4, running=2,
                                                                      hits=500)),
        (second.id, endpoint.id, now - timedelta(seconds=5), snapshot(usage=0.9, running=3,
                                                                      hits=700, tier=64)),
        (second.id, endpoint.id, now - timedelta(minutes=30), snapshot(usage=1.0, running=9,
                                                                       hits=1))])


def test_the_exposition_sums_gauges_per_endpoint_and_keeps_counters_per_replica(
        client: Client, org: Organization, sampled: None) -> None:
    text = scrape(client)

    labels = f'endpoint="chat",organization="{org.slug}"'
    assert f"kvrun_endpoint_kv_cache_usage_ratio{{{labels}}} 0.9" in text
    assert f"kvrun_endpoint_requests_running{{{labels}}} 5.0" in text  # the latest of each
    assert f"kvrun_endpoint_replicas_sampled{{{labels}}} 2.0" in text
    hits = re.findall(r"kvrun_replica_prefix_cache_hits_total\{[^}]*\} (\S+)", text)
    assert sorted(hits) == ["500.0", "700.0"]
    assert "kvrun_usage_ingestion_lag_seconds" in text


def test_only_a_scraper_with_the_token_reads_the_metrics(client: Client) -> None:
    assert client.get("/metrics").status_code == 404  # no token set: no /metrics
    with override_settings(KVRUN_METRICS_TOKEN=TOKEN):
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer guess").status_code == 401


def test_the_grafana_dashboard_asks_only_for_exposed_metrics_and_rates_its_counters(
        client: Client, org: Organization, sampled: None) -> None:
    observed.OVERHEAD.labels(org.slug, "chat").observe(0.0004)
    observed.TIME_TO_FIRST_TOKEN.labels(org.slug, "chat").observe(0.2)
    observed.REQUESTS.labels(org.slug, "chat", "200").inc()
    exposed = set(re.findall(r"^(kvrun_[a-z_]+)", scrape(client), flags=re.MULTILINE))
    dashboard = json.loads((ROOT / "platform" / "grafana" / "kvrun.json").read_text())

    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(queries) >= 10
    for query in queries:
        for name in re.findall(r"kvrun_[a-z_]+", query):
            assert name in exposed, f"{name} is not exposed"
            if name.endswith(("_total", "_bucket")):
                assert f"rate({name}[" in query, f"{query}: counters only through rate()"


def test_the_exposition_says_how_far_the_billing_rollup_lags(client: Client,
                                                             org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[41022])
    key, _ = inference_key(org)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=hour + timedelta(hours=n)
                                           ).encode() for n in range(2)])
    StaleUsageHour.objects.update(marked_at=timezone.now() - timedelta(minutes=10))

    text = scrape(client)

    assert gauge(text, "kvrun_billing_stale_hours") == 2
    assert gauge(text, "kvrun_billing_oldest_stale_hour_timestamp_seconds") == hour.timestamp()
    assert 600 <= gauge(text, "kvrun_billing_rollup_lag_seconds") < 660
    assert gauge(text, "kvrun_billing_rollup_batch_hours") == 10_000

    do_roll_up_usage()

    text = scrape(client)
    assert gauge(text, "kvrun_billing_stale_hours") == 0
    assert gauge(text, "kvrun_billing_rollup_lag_seconds") == 0


def gauge(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])
