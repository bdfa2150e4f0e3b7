"""The autoscaler's decisions: scale to zero from the gateways' activity in Redis, and
replicas added or removed from the engines' samples."""

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from accounts.models import Organization, Role
from endpoints.models import (
    LONGEST_WINDOW_SECONDS,
    DesiredState,
    Endpoint,
    EndpointEvent,
    Replica,
    State,
)
from endpoints.services import do_autoscale_endpoint, do_change_endpoint_policy, do_scale_endpoint
from kvrun.common.redis import redis_client
from scaling import services
from scaling.activity import in_flight_name, last_request_name, readings_name, record_in_flight
from scaling.selectors import replica_to_remove
from scaling.services import do_scale_endpoints_on_signals, do_scale_idle_endpoints_to_zero
from telemetry.models import RAW_KEPT, EngineSample
from tests.factories import ready_endpoint
from tests.helpers import at_once

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def idle(org: Organization) -> Endpoint:
    """An endpoint that may scale to zero, its one replica ready for 20 minutes."""
    endpoint = ready_endpoint(org, "idle", [41001], min_replicas=0,
                              scale_to_zero_after_seconds=900)
    endpoint.replicas.update(ready_at=timezone.now() - timedelta(minutes=20))
    redis = redis_client()
    redis.delete(in_flight_name(endpoint.id), last_request_name(endpoint.id))
    return endpoint


def zero_events(endpoint: Endpoint) -> list[str]:
    return list(EndpointEvent.objects.filter(endpoint=endpoint, message__startswith="scaling to "
                                             "zero").values_list("message", flat=True))


def test_it_scales_an_endpoint_idle_past_its_idle_time_to_zero(idle: Endpoint) -> None:
    scaled = do_scale_idle_endpoints_to_zero(now=timezone.now())

    assert scaled == 1
    idle.refresh_from_db()
    assert idle.desired_replicas == 0 and idle.desired_state == DesiredState.RUNNING
    [message] = zero_events(idle)
    assert message.startswith("scaling to zero: no request for 20 min 0 s and none in flight "
                              "(its idle time is 15 min 0 s); stopping its 1 replica(s).")


def test_it_counts_the_idle_time_from_the_last_request(idle: Endpoint) -> None:
    now = timezone.now()
    minute_ago = int((now - timedelta(minutes=1)).timestamp() * 1000)
    redis_client().set(last_request_name(idle.id), minute_ago)

    assert do_scale_idle_endpoints_to_zero(now=now) == 0
    assert do_scale_idle_endpoints_to_zero(now=now + timedelta(minutes=14, seconds=1)) == 1


def test_a_request_admitted_while_it_decides_keeps_the_endpoint_running(
        idle: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    now = timezone.now()
    decide = services.do_scale_endpoint_to_zero

    def admitted_meanwhile(**decision: Any) -> bool:
        redis_client().zadd(in_flight_name(idle.id), {"req_late": int(now.timestamp() * 1000)})
        return decide(**decision)
    monkeypatch.setattr(services, "do_scale_endpoint_to_zero", admitted_meanwhile)

    assert do_scale_idle_endpoints_to_zero(now=now) == 0

    idle.refresh_from_db()
    assert idle.desired_replicas == 1
    assert zero_events(idle) == []


def test_it_keeps_an_endpoint_with_a_request_in_flight(idle: Endpoint) -> None:
    now = timezone.now()
    redis_client().zadd(in_flight_name(idle.id), {"req_long_stream": int(now.timestamp() * 1000)})

    assert do_scale_idle_endpoints_to_zero(now=now) == 0
    # A slot its web process stopped renewing (the process died) no longer counts.
    later = now + timedelta(minutes=5)
    assert do_scale_idle_endpoints_to_zero(now=later) == 1


def test_it_leaves_endpoints_that_may_not_scale_to_zero_or_are_stopped(
        org: Organization, idle: Endpoint) -> None:
    kept = ready_endpoint(org, "kept", [41002], min_replicas=1)
    kept.replicas.update(ready_at=timezone.now() - timedelta(days=1))
    Endpoint.objects.filter(id=idle.id).update(desired_state=DesiredState.STOPPED)

    assert do_scale_idle_endpoints_to_zero(now=timezone.now()) == 0
    assert Endpoint.objects.get(id=kept.id).desired_replicas == 1


def test_two_autoscalers_at_once_make_one_decision(idle: Endpoint) -> None:
    results = at_once(*[lambda: do_scale_idle_endpoints_to_zero(now=timezone.now())] * 2)

    assert sorted(results) == [0, 1]
    assert len(zero_events(idle)) == 1
    assert Endpoint.objects.get(id=idle.id).desired_replicas == 0


def busy(org: Organization, replicas: int, **scaling: object) -> Endpoint:
    """An endpoint of `replicas` ready replicas whose autoscaler keeps 2 in flight each."""
    endpoint = ready_endpoint(org, "busy", [41010 + n for n in range(replicas)],
                              max_replicas=4, desired_replicas=replicas, scaling_target=2,
                              scale_up_window_seconds=60, scale_down_window_seconds=120,
                              **scaling)
    redis_client().delete(readings_name(endpoint.id))
    return endpoint


def load(endpoint: Endpoint, *, seconds: int, in_flight: float, now: datetime) -> None:
    """What the autoscaler read of the gateways' requests in flight at each of its passes
    over the last `seconds`: `in_flight` per replica."""
    replicas = endpoint.replicas.count()
    step = settings.KVRUN_AUTOSCALE_SECONDS
    for n in range(int(seconds // step) + 1):
        at = now - timedelta(seconds=n * step)
        record_in_flight(readings={endpoint.id: (round(in_flight * replicas), 3600)}, now=at)


def sample(replica: Replica, *, at: datetime, running: int, waiting: float = 0) -> None:
    EngineSample.objects.create(
        replica=replica, endpoint=replica.endpoint, at=at, kv_cache_usage=0.1, running=running,
        waiting=waiting, prefix_queries=0, prefix_hits=0, preemptions=0, prompt_tokens=0,
        generation_tokens=0, requests=0)


def engine_load(endpoint: Endpoint, *, seconds: int, waiting: float, now: datetime) -> None:
    """Samples of each replica every scrape over the last `seconds`: `waiting` requests each
    (half a request more on the first, half less on the last: only their mean is
    `waiting`)."""
    replicas = list(endpoint.replicas.all())
    step = settings.KVRUN_ENGINE_SCRAPE_SECONDS
    for n in range(int(seconds // step) + 1):
        for index, replica in enumerate(replicas):
            skew = 0.5 if index == 0 else -0.5 if index == len(replicas) - 1 else 0
            sample(replica, at=now - timedelta(seconds=n * step), running=4,
                   waiting=waiting + skew)


def scaling_events(endpoint: Endpoint) -> list[str]:
    return list(EndpointEvent.objects.filter(endpoint=endpoint, message__startswith="scaling ")
                .values_list("message", flat=True))


def test_a_load_above_target_for_the_up_window_adds_the_replicas_it_needs(
        org: Organization) -> None:
    endpoint, now = busy(org, 2), timezone.now()
    load(endpoint, seconds=60, in_flight=3, now=now)

    assert do_scale_endpoints_on_signals(now=now) == 1

    endpoint.refresh_from_db()
    assert endpoint.desired_replicas == 3 and endpoint.last_scaled_at is not None
    assert scaling_events(endpoint) == [
        "scaling up from 2 to 3 replica(s): requests in flight per replica stayed above its "
        "target of 2 through the last 60 s (each third's mean: 3.0, 3.0, 3.0); max_replicas "
        "is 4"]
    # The next change waits a window from this one.
    assert do_scale_endpoints_on_signals(now=now + timedelta(seconds=30)) == 0


def test_a_change_by_hand_is_left_a_window_before_the_autoscaler_judges(
        org: Organization) -> None:
    endpoint = busy(org, 2)
    do_scale_endpoint(endpoint=endpoint, actor_role=Role.OWNER, replicas=2)
    now = timezone.now()
    load(endpoint, seconds=120, in_flight=0.5, now=now)  # would fit on one replica fewer

    assert do_scale_endpoints_on_signals(now=now) == 0
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 2


def test_a_reading_between_requests_does_not_reset_a_sustained_load(
        org: Organization) -> None:
    endpoint, now = busy(org, 2), timezone.now()
    load(endpoint, seconds=60, in_flight=3, now=now)
    record_in_flight(readings={endpoint.id: (0, 3600)}, now=now - timedelta(seconds=32))

    assert do_scale_endpoints_on_signals(now=now) == 1


def test_a_burst_shorter_than_the_up_window_adds_nothing(org: Organization) -> None:
    endpoint, now = busy(org, 2), timezone.now()
    load(endpoint, seconds=60, in_flight=1, now=now - timedelta(seconds=25))
    load(endpoint, seconds=20, in_flight=6, now=now)

    assert do_scale_endpoints_on_signals(now=now) == 0
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 2


def test_a_load_that_fits_on_one_replica_fewer_removes_one_after_the_down_window(
        org: Organization) -> None:
    endpoint, now = busy(org, 3, min_replicas=1), timezone.now()
    load(endpoint, seconds=120, in_flight=1, now=now)  # 3 in flight: 1.5 each on two

    assert do_scale_endpoints_on_signals(now=now) == 1

    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 2
    [message] = scaling_events(endpoint)
    newest = endpoint.replicas.order_by("created_at").last()
    assert message == ("scaling down from 3 to 2 replica(s): requests in flight per replica "
                       "stayed at or under 1.3 through the last 120 s (each third's mean: 1.0, "
                       "1.0, 1.0), so one replica fewer keeps it under the target of 2; replica "
                       f"{str(newest.id)[:8]} stops, the one with the fewest requests running "
                       "or waiting in its engine's last sample (not read yet), drained first")
    assert list(endpoint.replicas.order_by("created_at").values_list("state", flat=True)) == [
        State.READY, State.READY, State.STOPPING]


def test_scaling_down_stops_the_replica_with_the_fewest_requests_in_its_engine(
        org: Organization) -> None:
    endpoint, now = busy(org, 3, min_replicas=1), timezone.now()
    load(endpoint, seconds=120, in_flight=1, now=now)
    oldest, middle, newest = endpoint.replicas.order_by("created_at")
    # Only the last sample counts: before it, the middle one was the busiest.
    for replica, earlier, last in [(oldest, 0, (2, 1)), (middle, 9, (1, 0)), (newest, 0, (3, 0))]:
        sample(replica, at=now - timedelta(seconds=10), running=earlier)
        sample(replica, at=now - timedelta(seconds=2), running=last[0], waiting=last[1])

    assert do_scale_endpoints_on_signals(now=now) == 1

    [message] = scaling_events(endpoint)
    assert message.endswith(f"; replica {str(middle.id)[:8]} stops, the one with the fewest "
                            "requests running or waiting in its engine's last sample (1), "
                            "drained first")
    assert {replica.id: replica.state for replica in endpoint.replicas.all()} == {
        oldest.id: State.READY, middle.id: State.STOPPING, newest.id: State.READY}


def test_among_replicas_as_busy_the_newest_stops_and_one_not_read_lately_comes_last(
        org: Organization) -> None:
    endpoint, now = busy(org, 3, min_replicas=1), timezone.now()
    oldest, middle, newest = endpoint.replicas.order_by("created_at")
    sample(oldest, at=now - timedelta(seconds=2), running=1)
    sample(middle, at=now - timedelta(seconds=2), running=1)
    sample(newest, at=now - timedelta(hours=1), running=0)  # its agent went quiet since

    chosen, busy_count = replica_to_remove(replicas=[oldest, middle, newest],
                                           since=now - timedelta(minutes=5))

    assert (chosen, busy_count) == (middle, 1)


def test_a_replica_chosen_that_has_moved_on_changes_nothing(org: Organization) -> None:
    endpoint = busy(org, 2, min_replicas=1)
    chosen = endpoint.replicas.order_by("created_at").first()
    Replica.objects.filter(id=chosen.id).update(state=State.STOPPED)

    scaled = do_autoscale_endpoint(endpoint_id=endpoint.id, replicas=2, to_replicas=1,
                                   reason="scaling down from 2 to 1", stop_replica_id=chosen.id,
                                   policy_version=endpoint.policy_version)

    assert scaled is False
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 2
    assert scaling_events(endpoint) == []

def test_a_scale_down_decided_before_a_policy_change_leaves_its_roll_alone(
        org: Organization) -> None:
    # Decided on two ready replicas of policy 1; the policy changes before the decision
    # lands: its rolling restart replaces the replicas one at a time, and a scale-down now
    # could stop the one replica the roll keeps serving.
    endpoint = busy(org, 2, min_replicas=1)
    chosen = endpoint.replicas.order_by("created_at").last()
    decided_at = endpoint.policy_version
    do_change_endpoint_policy(endpoint=endpoint, actor_role=Role.OWNER,
                              changes={"prefix_caching": False})
    assert Endpoint.objects.get(id=endpoint.id).policy_version == decided_at + 1

    scaled = do_autoscale_endpoint(endpoint_id=endpoint.id, replicas=2, to_replicas=1,
                                   reason="scaling down from 2 to 1", stop_replica_id=chosen.id,
                                   policy_version=decided_at)

    assert scaled is False
    assert Replica.objects.get(id=chosen.id).state == State.READY
    # While the roll runs (replicas on the older policy), the autoscaler decides nothing.
    load(endpoint, seconds=120, in_flight=1, now=timezone.now())
    assert do_scale_endpoints_on_signals(now=timezone.now()) == 0


def test_it_decides_nothing_without_readings_over_the_whole_window_or_while_starting(
        org: Organization) -> None:
    endpoint, now = busy(org, 2), timezone.now()
    load(endpoint, seconds=30, in_flight=5, now=now)  # read for 30 s of the 60

    assert do_scale_endpoints_on_signals(now=now) == 0

    load(endpoint, seconds=60, in_flight=5, now=now - timedelta(seconds=35))
    endpoint.replicas.filter(port=41010).update(state=State.LOADING)
    assert do_scale_endpoints_on_signals(now=now) == 0
    endpoint.replicas.update(state=State.READY)
    assert do_scale_endpoints_on_signals(now=now) == 1


def test_waiting_requests_are_read_from_the_engines_samples(org: Organization) -> None:
    endpoint, now = busy(org, 2, scaling_metric="waiting"), timezone.now()
    engine_load(endpoint, seconds=60, waiting=2.5, now=now)

    assert do_scale_endpoints_on_signals(now=now) == 1

    [message] = scaling_events(endpoint)
    assert message.startswith("scaling up from 2 to 3 replica(s): requests waiting per replica "
                              "stayed above its target of 2 through the last 60 s (each third's "
                              "mean: 2.5, 2.5, 2.5)")


def test_two_autoscalers_on_signals_at_once_make_one_change(org: Organization) -> None:
    endpoint, now = busy(org, 2), timezone.now()
    load(endpoint, seconds=60, in_flight=3, now=now)
    results = at_once(*[lambda: do_scale_endpoints_on_signals(now=now)] * 2)

    assert sorted(results) == [0, 1] and len(scaling_events(endpoint)) == 1


def test_the_longest_window_is_one_the_engines_samples_cover_as_read() -> None:
    # A window longer than raw samples are kept would never be covered: no decision, ever.
    assert LONGEST_WINDOW_SECONDS <= RAW_KEPT.total_seconds()
