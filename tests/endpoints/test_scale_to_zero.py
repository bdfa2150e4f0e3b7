"""An endpoint at zero: created to scale there, summarised as idle, woken once however many
requests ask at once."""

from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings

from accounts.models import Organization, Role
from endpoints.lifecycle import summarise
from endpoints.models import DesiredState, Endpoint, EndpointEvent, ModelSpec, State
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.services import (
    do_create_endpoint,
    do_load_catalogs,
    do_scale_endpoint_to_zero,
    do_stop_endpoint,
    do_wake_endpoint,
)
from tests.factories import ready_endpoint
from tests.helpers import at_once


def create(org: Organization, **scaling: Any) -> Endpoint:
    do_load_catalogs()
    return do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name="sleepy",
        model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        policy=EndpointPolicy(context_length=2048, concurrency=2),
        scaling=EndpointScaling(**scaling))


@pytest.mark.django_db
def test_an_endpoint_that_may_scale_to_zero_starts_with_one_replica(org: Organization) -> None:
    endpoint = create(org, min_replicas=0, max_replicas=2, scale_to_zero_after_seconds=600)

    endpoint.refresh_from_db()
    assert (endpoint.min_replicas, endpoint.max_replicas, endpoint.desired_replicas) == (0, 2, 1)
    assert endpoint.scale_to_zero_after_seconds == 600


@pytest.mark.django_db
@override_settings(KVRUN_SCALE_TO_ZERO_MIN_SECONDS=60)
def test_it_validates_the_scaling_settings(org: Organization) -> None:
    with pytest.raises(ValidationError) as refused:
        create(org, min_replicas=0, max_replicas=0, scale_to_zero_after_seconds=10)

    assert refused.value.message_dict == {
        "max_replicas": ["Choose between 1 (at least 1, and no fewer than the fewest replicas, "
                         "min_replicas) and 16; for more, create another endpoint."],
        "scale_to_zero_after_seconds": [
            "Wait at least 60 s without a request before scaling to zero: each wake is a cold "
            "start."]}
    assert not Endpoint.objects.exists()


def test_an_endpoint_with_no_replica_asked_for_is_idle() -> None:
    assert summarise(desired_state=DesiredState.RUNNING, desired_replicas=0, deleted=False,
                     replica_states=[State.STOPPED]) == State.IDLE
    assert summarise(desired_state=DesiredState.RUNNING, desired_replicas=0, deleted=False,
                     replica_states=[State.STOPPING]) == State.STOPPING
    assert summarise(desired_state=DesiredState.RUNNING, desired_replicas=1, deleted=False,
                     replica_states=[]) == State.PENDING


@pytest.mark.django_db(transaction=True)
def test_requests_at_once_wake_an_endpoint_at_zero_once(org: Organization) -> None:
    endpoint = ready_endpoint(org, "sleepy", [], state=State.IDLE, min_replicas=0,
                              desired_replicas=0)
    woken = at_once(*[lambda: do_wake_endpoint(endpoint_id=endpoint.id)] * 4)

    assert sorted(woken) == [False, False, False, True]
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 1
    assert EndpointEvent.objects.filter(
        endpoint=endpoint, message="woken by a request: starting one replica").count() == 1


@pytest.mark.django_db
def test_a_stopped_endpoint_or_one_with_a_minimum_is_never_woken_or_scaled_to_zero(
        org: Organization) -> None:
    stopped = ready_endpoint(org, "stopped", [], state=State.STOPPED, min_replicas=0,
                             desired_replicas=0)
    do_stop_endpoint(endpoint=stopped, actor_role=Role.OWNER)
    kept = ready_endpoint(org, "kept", [41003], min_replicas=1, desired_replicas=1)

    assert not do_wake_endpoint(endpoint_id=stopped.id)
    assert not do_scale_endpoint_to_zero(endpoint_id=kept.id, replicas=1, reason="idle",
                                         still_idle=lambda: True)
    assert Endpoint.objects.get(id=stopped.id).desired_replicas == 0
    assert Endpoint.objects.get(id=kept.id).desired_replicas == 1
