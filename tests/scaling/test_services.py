"""The autoscaler's idle decision: from the rows and the gateways' activity in Redis."""

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from accounts.models import Organization
from endpoints.models import DesiredState, Endpoint, EndpointEvent
from kvrun.redis import redis_client
from scaling.activity import in_flight_name, last_request_name
from scaling.services import do_scale_idle_endpoints_to_zero
from tests.factories import ready_endpoint

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
    together = threading.Barrier(2)
    results = []

    def decide() -> None:
        together.wait()
        results.append(do_scale_idle_endpoints_to_zero(now=timezone.now()))
        connection.close()

    threads = [threading.Thread(target=decide) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(results) == [0, 1]
    assert len(zero_events(idle)) == 1
    assert Endpoint.objects.get(id=idle.id).desired_replicas == 0
