"""How an endpoint scales: its settings, and the moves the autoscaler and the gateway ask
for (up, down, to zero, woken)."""

from collections.abc import Callable, Mapping
from typing import Any
from uuid import UUID

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.services import require_manager
from endpoints.dispatch import reconcile_after_commit
from endpoints.lifecycle import do_stop_replica
from endpoints.models import (
    LONGEST_WINDOW_SECONDS,
    MAX_IDLE_SECONDS,
    MAX_REPLICAS_PER_ENDPOINT,
    SHORTEST_WINDOW_SECONDS,
    DesiredState,
    Endpoint,
    EndpointEvent,
    Replica,
    State,
)
from endpoints.policies import EndpointScaling
from endpoints.services.quota import hold_quota, lock_organization


def do_change_endpoint_scaling(*, endpoint: Endpoint, actor_role: str | None,
                               changes: Mapping[str, Any]) -> Endpoint:
    """Change how an endpoint scales (EndpointScaling's fields; only those in `changes`).

    Raises ValidationError naming the field: replicas out of range, an idle time under
    KVRUN_SCALE_TO_ZERO_MIN_SECONDS, a target not above zero, a window out of range; and
    naming the quota where a higher max_replicas would pass it. The replicas asked for move
    into the new range at once; the autoscaler takes it from there."""
    require_manager(actor_role, "change endpoints")
    with transaction.atomic():
        lock_organization(endpoint.organization_id)  # before the endpoint, as hold_quota needs
        locked = Endpoint.objects.select_for_update().get(id=endpoint.id)
        new = EndpointScaling.of(locked).changed(changes)
        errors = scaling_errors(new)
        if errors:
            raise ValidationError(errors)
        if new.max_replicas > locked.max_replicas and (
                locked.desired_state == DesiredState.RUNNING):
            hold_quota(organization_id=locked.organization_id, excluding=locked.id,
                        gpu_type=locked.gpu_type, gpu_count=locked.gpu_count,
                        replicas=new.max_replicas, own_nodes_only=locked.own_nodes_only)
        # At zero it stays there while zero is allowed; a minimum of one or more starts them.
        desired = min(new.max_replicas, max(new.min_replicas, locked.desired_replicas))
        fields = new.as_fields()
        Endpoint.objects.filter(id=locked.id).update(desired_replicas=desired, **fields)
        said = ", ".join(f"{name.replace('_', ' ')} {_shown(value)}"
                         for name, value in fields.items() if value != getattr(locked, name))
        EndpointEvent.objects.create(endpoint=locked, state=locked.state,
                                     message=f"scaling changed: {said or 'nothing'}"
                                             + (f"; {desired} replica(s) now"
                                                if desired != locked.desired_replicas else ""))
    reconcile_after_commit(locked)
    return Endpoint.objects.get(id=locked.id)


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def idle_time_refusal(seconds: int) -> str | None:
    """Why an idle time before scaling to zero is refused, or None (forms check it too)."""
    shortest = settings.KVRUN_SCALE_TO_ZERO_MIN_SECONDS
    if seconds < shortest:
        return (f"Wait at least {shortest} s without a request before scaling to zero: each "
                "wake is a cold start.")
    if seconds > MAX_IDLE_SECONDS:
        return (f"Wait at most {MAX_IDLE_SECONDS} s (30 days); to never scale to zero, set the "
                "fewest replicas to 1 or more.")
    return None


def scaling_errors(scaling: EndpointScaling) -> dict[str, list[str]]:
    """What is out of range in `scaling`, by field, in words a person can act on."""
    errors: dict[str, list[str]] = {}
    fewest = max(1, scaling.min_replicas)
    if scaling.min_replicas < 0:
        errors["min_replicas"] = ["Run at least 0 replicas (0 scales to zero while idle)."]
    if not fewest <= scaling.max_replicas <= MAX_REPLICAS_PER_ENDPOINT:
        errors["max_replicas"] = [
            f"Choose between {fewest} (at least 1, and no fewer than the fewest replicas, "
            f"min_replicas) and {MAX_REPLICAS_PER_ENDPOINT}; for more, create another "
            "endpoint."]
    idle = idle_time_refusal(scaling.scale_to_zero_after_seconds)
    if idle:
        errors["scale_to_zero_after_seconds"] = [idle]
    if scaling.scaling_target is not None and scaling.scaling_target <= 0:
        errors["scaling_target"] = ["Set a target above 0, or none for the metric's default."]
    for name in ("scale_up_window_seconds", "scale_down_window_seconds"):
        if not SHORTEST_WINDOW_SECONDS <= getattr(scaling, name) <= LONGEST_WINDOW_SECONDS:
            errors[name] = [f"Choose between {SHORTEST_WINDOW_SECONDS} s and "
                            f"{LONGEST_WINDOW_SECONDS} s."]
    return errors


def do_wake_endpoint(*, endpoint_id: UUID) -> bool:
    """Ask for one replica of an endpoint scaled to zero, for a request waiting on it.

    A conditional update: of any number of calls at once (gateways holding a burst of
    requests), one wakes the endpoint and the rest change nothing. Returns whether this call
    woke it; False also for an endpoint stopped, deleted, failed or not at zero.
    """
    return _move_desired_replicas(
        endpoint_id=endpoint_id, where=Q(min_replicas=0, desired_replicas=0) & ~Q(
            state=State.FAILED),
        to_replicas=1, message="woken by a request: starting one replica")


def do_scale_endpoint_to_zero(*, endpoint_id: UUID, replicas: int, reason: str,
                              still_idle: Callable[[], bool]) -> bool:
    """Stop every replica of an idle endpoint that may scale to zero, with `reason` (the
    numbers behind the decision) as its event; `replicas` is the count the decision was
    made at. A conditional update: a request that woke the endpoint or a scaling change
    made since, or a second autoscaler deciding the same, changes nothing. Activity lives
    outside the database, so `still_idle` asks again once the endpoint's row is held by the
    update: a request admitted since the decision read it undoes it. Returns whether this
    call scaled it."""
    with transaction.atomic():
        moved = _move_desired_replicas(
            endpoint_id=endpoint_id, where=Q(min_replicas=0, desired_replicas=replicas),
            to_replicas=0, message=f"scaling to zero: {reason}")
        if moved and not still_idle():
            transaction.set_rollback(True)
            return False
    return moved


def do_autoscale_endpoint(*, endpoint_id: UUID, replicas: int, to_replicas: int, reason: str,
                          policy_version: int, stop_replica_id: UUID | None = None) -> bool:
    """Move a running endpoint from `replicas` at `policy_version` (what the decision was
    made at) to `to_replicas`, with `reason` (the numbers behind it) as its event. A
    conditional update: a change made since (a scale, or a policy change whose rolling
    restart then decides alone), or a second autoscaler deciding the same, changes nothing.
    Returns whether this call scaled it; the reconciler then adds replicas.

    Scaling down, `stop_replica_id` is the replica to remove (the one the event names),
    stopped in the same transaction; its node agent drains it first. If it has moved on
    since, nothing changes and False is returned: the next pass decides again."""
    with transaction.atomic():
        moved = _move_desired_replicas(
            endpoint_id=endpoint_id,
            where=Q(desired_replicas=replicas, policy_version=policy_version),
            to_replicas=to_replicas,
            message=reason, last_scaled_at=timezone.now())
        if moved and stop_replica_id is not None:
            replica = (Replica.objects.select_related("node")
                       .filter(id=stop_replica_id, endpoint_id=endpoint_id).first())
            if replica is None or not do_stop_replica(replica=replica, reason="scaled down"):
                transaction.set_rollback(True)
                return False
    return moved


def _move_desired_replicas(*, endpoint_id: UUID, where: Q, to_replicas: int, message: str,
                           **also: object) -> bool:
    """Set `to_replicas` (and `also`) on the endpoint if it still matches `where`, runs and
    is not deleted, with `message` as its event, and reconcile it once that commits; returns
    whether it did."""
    with transaction.atomic():
        moved = Endpoint.objects.filter(
            where, id=endpoint_id, deleted_at=None, desired_state=DesiredState.RUNNING).update(
                desired_replicas=to_replicas, **also)
        if moved:
            endpoint = Endpoint.objects.get(id=endpoint_id)
            EndpointEvent.objects.create(endpoint=endpoint, state=endpoint.state,
                                         message=message)
            reconcile_after_commit(endpoint)
    return bool(moved)
