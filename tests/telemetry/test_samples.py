from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import Organization
from endpoints.models import Endpoint, Replica
from engine.metrics import EngineSnapshot
from telemetry.models import MINUTE_KEPT, EngineSample
from telemetry.selectors import series, served_over
from telemetry.services import do_downsample_samples, do_record_engine_samples
from tests.factories import ready_endpoint

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def shot(*, queries: int = 0, hits: int = 0, prompt: int = 0, usage: float = 0.1,
         ttft: dict | None = None, running: int = 0, requests: int = 0) -> EngineSnapshot:
    return EngineSnapshot(kv_cache_usage=usage, running=running, waiting=0,
                          prefix_queries=queries, prefix_hits=hits, external_queries=None,
                          external_hits=None, preemptions=0, prompt_tokens=prompt,
                          generation_tokens=0, requests=requests, ttft_buckets=ttft or {})


@pytest.fixture
def endpoint_of_two_replicas(org: Organization) -> Endpoint:
    return ready_endpoint(org, "chat", [41001, 41002])


def record(replica: Replica, at: datetime, snapshot: EngineSnapshot) -> None:
    do_record_engine_samples(samples=[(replica.id, replica.endpoint_id, at, snapshot)])


def test_hit_rates_are_hits_over_lookups_in_each_step_never_lifetime_totals(
        endpoint_of_two_replicas: Endpoint) -> None:
    replica = endpoint_of_two_replicas.replicas.first()
    # A lifetime of misses, then a minute in which every lookup hits.
    record(replica, T0, shot(queries=100_000, hits=0, prompt=100_000))
    record(replica, T0 + timedelta(seconds=30), shot(queries=100_000, hits=0, prompt=100_000))
    record(replica, T0 + timedelta(seconds=60), shot(queries=101_000, hits=1_000,
                                                     prompt=101_000))

    step, points = series(endpoint_id=endpoint_of_two_replicas.id, since=T0,
                          until=T0 + timedelta(seconds=600))

    assert step == 5
    by_time = {point["at"]: point for point in points}
    last = by_time[T0 + timedelta(seconds=65)]
    assert last["prefix_hit_rate"] == 1.0  # the lifetime ratio would say 1 %
    assert last["prompt_tokens_per_s"] == 1_000 / 5
    assert by_time[T0 + timedelta(seconds=35)]["prefix_hit_rate"] is None  # no lookups


def test_a_chart_s_steps_hold_as_many_samples_and_end_before_the_step_still_filling(
        endpoint_of_two_replicas: Endpoint) -> None:
    replica = endpoint_of_two_replicas.replicas.first()
    now = timezone.now()
    for n in range(180):  # the last 15 minutes, one sample every 5 s, 100 prompt tokens each
        record(replica, now - timedelta(seconds=900 - 5 * n), shot(prompt=100 * n))

    step, points = series(endpoint_id=endpoint_of_two_replicas.id,
                          since=now - timedelta(minutes=15), until=now)

    assert step == 10  # two scrape periods: a 7.5 s step would hold one sample, then two
    assert {point["prompt_tokens_per_s"] for point in points[1:]} == {20.0}
    assert points[-1]["at"] == now - timedelta(seconds=10)  # the step ending now is left out


def test_steps_sum_replicas_and_a_restarted_engine_s_counters_count_from_zero(
        endpoint_of_two_replicas: Endpoint) -> None:
    first, second = endpoint_of_two_replicas.replicas.all()
    record(first, T0, shot(queries=500, hits=100, usage=0.2, running=2))
    record(second, T0 + timedelta(seconds=1), shot(queries=50, hits=0, usage=0.7, running=1))
    # Within one step: the first engine restarted (counters from zero), the second moved on.
    record(first, T0 + timedelta(seconds=61), shot(queries=40, hits=30, usage=0.3, running=1))
    record(second, T0 + timedelta(seconds=62), shot(queries=110, hits=60, usage=0.4,
                                                   running=4))

    _, points = series(endpoint_id=endpoint_of_two_replicas.id, since=T0,
                       until=T0 + timedelta(minutes=10))

    step = next(point for point in points if point["at"] == T0 + timedelta(seconds=65))
    assert step["prefix_hit_rate"] == (30 + 60) / (40 + 60)
    assert (step["kv_cache_usage"], step["running"]) == (0.4, 5)
    _, only_second = series(endpoint_id=endpoint_of_two_replicas.id, since=T0,
                            until=T0 + timedelta(minutes=10), replica_id=second.id)
    assert [point["prefix_hit_rate"] for point in only_second] == [None, 1.0]


def test_the_requests_a_day_count_an_engine_restarted_under_its_replica(
        endpoint_of_two_replicas: Endpoint) -> None:
    first, second = endpoint_of_two_replicas.replicas.all()
    # 2,000 served, a crash, and the restarted engine's 60,000; the other replica's 300.
    for at, served in ((T0, 50_000), (T0 + timedelta(hours=1), 52_000),
                       (T0 + timedelta(hours=2), 5), (T0 + timedelta(hours=3), 60_000)):
        record(first, at, shot(requests=served))
    for at, served in ((T0, 100), (T0 + timedelta(hours=3), 400)):
        record(second, at, shot(requests=served))

    requests, _, _ = served_over(endpoint_id=endpoint_of_two_replicas.id, since=T0,
                                 until=T0 + timedelta(days=1))

    assert requests == 2_000 + 60_000 + 300


def test_latency_percentiles_come_from_the_buckets_increase_in_the_step(
        endpoint_of_two_replicas: Endpoint) -> None:
    replica = endpoint_of_two_replicas.replicas.first()
    record(replica, T0, shot(ttft={"0.1": 1000.0, "1.0": 1000.0, "+Inf": 1000.0}))
    record(replica, T0 + timedelta(seconds=4),
           shot(ttft={"0.1": 1000.0, "1.0": 1010.0, "+Inf": 1010.0}))

    _, points = series(endpoint_id=endpoint_of_two_replicas.id, since=T0,
                       until=T0 + timedelta(minutes=10))

    # Ten slow first tokens in the step; the thousand fast ones before it do not count.
    assert points[0]["ttft_p50_s"] == pytest.approx(0.1 + 0.9 * 0.5)


def test_a_sample_recorded_twice_is_stored_once(endpoint_of_two_replicas: Endpoint) -> None:
    replica = endpoint_of_two_replicas.replicas.first()

    record(replica, T0, shot(queries=1))
    record(replica, T0, shot(queries=2))

    assert list(EngineSample.objects.values_list("prefix_queries", flat=True)) == [1]


def test_old_samples_thin_to_one_a_minute_with_their_peak_and_exact_counters(
        endpoint_of_two_replicas: Endpoint) -> None:
    replica = endpoint_of_two_replicas.replicas.first()
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(hours=3)
    for n in range(24):  # two minutes at one sample every 5 s
        record(replica, start + timedelta(seconds=5 * n),
               shot(queries=100 * n, hits=50 * n, prompt=100 * n, usage=0.9 if n == 3 else 0.1))
    raw_step, before = series(endpoint_id=endpoint_of_two_replicas.id, since=start,
                              until=start + timedelta(minutes=2))
    second_minute = [point["prompt_tokens_per_s"] for point in before
                     if point["at"] > start + timedelta(seconds=60)]

    assert do_downsample_samples(now=timezone.now())
    assert do_downsample_samples(now=timezone.now())  # again: nothing more changes

    kept = list(EngineSample.objects.order_by("at").values_list(
        "at", "resolution_seconds", "kv_cache_usage", "prefix_queries"))
    assert kept == [(start + timedelta(seconds=55), 60, 0.9, 1100),
                    (start + timedelta(seconds=115), 60, 0.1, 2300)]
    minute_step, after = series(endpoint_id=endpoint_of_two_replicas.id, since=start,
                                until=start + timedelta(minutes=2))
    # The second minute's prompt tokens, whether read from twelve samples or from one; steps
    # of whole minutes once the samples stand for one each.
    assert (raw_step, minute_step) == (5, 60)
    assert after[-1]["prompt_tokens_per_s"] * minute_step == 1200
    assert sum(second_minute) * raw_step == 1200


def test_a_week_of_samples_thinned_to_hours_charts_an_even_rate(
        endpoint_of_two_replicas: Endpoint) -> None:
    replica = endpoint_of_two_replicas.replicas.first()
    start = T0 - timedelta(days=7)
    for quarter in range(7 * 24 * 4):  # a sample every 15 minutes, one token a second throughout
        at = start + timedelta(minutes=15 * quarter + 14, seconds=55)
        record(replica, at, shot(prompt=round((at - start).total_seconds())))

    assert do_downsample_samples(now=T0)

    # Thinned by the code that thins them: one an hour past three days, one a minute before.
    past_three_days = EngineSample.objects.filter(at__lt=T0 - MINUTE_KEPT)
    assert set(past_three_days.values_list("resolution_seconds", flat=True)) == {3600}
    assert past_three_days.count() == 4 * 24
    step, points = series(endpoint_id=endpoint_of_two_replicas.id, since=start, until=T0)
    # Steps of whole hours: 84-minute ones held one sample or two, and the rate saw-toothed.
    assert step % 3600 == 0
    assert {point["prompt_tokens_per_s"] for point in points[1:]} == {1.0}


def test_samples_past_their_retention_are_deleted(endpoint_of_two_replicas: Endpoint) -> None:
    replica = endpoint_of_two_replicas.replicas.first()
    record(replica, timezone.now() - timedelta(days=91), shot())
    record(replica, timezone.now() - timedelta(days=89), shot())

    do_downsample_samples(now=timezone.now())

    assert EngineSample.objects.count() == 1


def test_the_api_gives_members_the_series_and_hides_other_organisations(
        endpoint_of_two_replicas: Endpoint, org: Organization, other_org: Organization,
        owner_api: APIClient) -> None:
    replica = endpoint_of_two_replicas.replicas.first()
    now = timezone.now()
    record(replica, now - timedelta(seconds=20), shot(queries=0, hits=0))
    record(replica, now - timedelta(seconds=10), shot(queries=200, hits=150))
    url = f"/api/v1/organizations/{org.slug}/endpoints/chat/metrics/"

    response = owner_api.get(url, {"window": "15m"})

    assert response.status_code == 200, response.content
    assert response.json()["step_seconds"] == 10
    assert [point["prefix_hit_rate"] for point in response.json()["points"]] == [None, 0.75]
    assert owner_api.get(url, {"window": "2y"}).status_code == 400
    theirs = f"/api/v1/organizations/{other_org.slug}/endpoints/chat/metrics/"
    assert owner_api.get(theirs).status_code == 404
