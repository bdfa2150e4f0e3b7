"""Replica and endpoint state transitions. Every change is a conditional update that acts
only when the row is still in the state the caller saw, and leaves an event the user sees and,
in the same transaction, the GPU-time ledger's intervals (ReplicaInterval)."""

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from endpoints.dispatch import wake_node_after_commit
from endpoints.models import DesiredState, Endpoint, EndpointEvent, Replica, ReplicaInterval
from endpoints.states import ON_NODE, PHASE_OF_STATE, PROGRESS, UNSETTLED, State, check_transition


def do_transition_replica(*, replica_id: UUID, from_states: Iterable[str], to_state: str,
                          message: str = "", held_until: datetime | None = None,
                          node_id: int | None = None, where: Mapping[str, Any] | None = None,
                          **fields: Any) -> bool:
    """Move a replica from one of `from_states` to `to_state`; False (and no change) if it
    is no longer in one of them, or, given `node_id`, no longer on that node, or its row
    does not match `where` (field lookups, held in the same update). Records an
    event, refreshes the endpoint's state, and closes and opens the replica's GPU-time
    intervals as its phase changes. A move that the lifecycle (endpoints.states) does not
    allow raises TransitionNotAllowed.

    `held_until` is when the replica's devices were last known held, where that is earlier
    than now (a lost node's last heartbeat): its open interval closes then.
    """
    from_states = frozenset(from_states)
    check_transition(from_states=from_states, to_state=to_state)
    fields.setdefault("stage", message[:80])
    fields.setdefault("progress_percent", PROGRESS[to_state])
    endpoint_id = (Replica.objects.filter(id=replica_id).values_list("endpoint_id", flat=True)
                   .first())
    if endpoint_id is None:
        return False
    with transaction.atomic():
        # The endpoint's row before the replica's, the order a reconciler pass takes them in:
        # the other way round, an agent's transition and a pass each held what the other
        # waited for, and PostgreSQL aborted one of them.
        endpoint = (Endpoint.objects.select_for_update()
                    .only("organization_id", "gpu_type_id", "gpu_count", "region_id")
                    .get(id=endpoint_id))
        moving = Replica.objects.filter(id=replica_id, state__in=list(from_states))
        if node_id is not None:
            moving = moving.filter(node_id=node_id)
        moved = moving.filter(**(where or {})).update(state=to_state, **fields)
        if moved != 1:
            return False
        now = timezone.now()
        EndpointEvent.objects.create(endpoint_id=endpoint_id, replica_id=replica_id,
                                     state=to_state, message=message, at=now)
        _record_phase(replica_id=replica_id, endpoint=endpoint, to_state=to_state, now=now,
                      held_until=held_until)
        do_refresh_endpoint_state(endpoint_id=endpoint_id)
    return True


def _record_phase(*, replica_id: UUID, endpoint: Endpoint, to_state: str, now: datetime,
                  held_until: datetime | None) -> None:
    """Close the replica's open interval if its phase ends here, and open the next phase's,
    both at `now` (the transition's event time). Called with the replica's row locked by its
    transition."""
    phase = PHASE_OF_STATE.get(to_state)
    current = ReplicaInterval.objects.filter(replica_id=replica_id, ended_at=None).first()
    if current is not None and current.phase == phase:
        return
    if current is not None:
        # Never before it started, whatever another host's clock said then.
        ended_at = max(current.started_at, min(now, held_until or now))
        ReplicaInterval.objects.filter(id=current.id, ended_at=None).update(ended_at=ended_at)
    if phase is not None:
        own_node = Replica.objects.filter(
            id=replica_id, node__organization_id=endpoint.organization_id).exists()
        ReplicaInterval.objects.create(
            replica_id=replica_id, endpoint_id=endpoint.id,
            organization_id=endpoint.organization_id, gpu_type_id=endpoint.gpu_type_id,
            gpu_count=endpoint.gpu_count, price_region_id=endpoint.region_id,
            own_node=own_node, phase=phase, started_at=now)


def backoff_until(failures: int) -> datetime:
    """When a replica that has failed `failures` times in a row may start again."""
    delay = settings.KVRUN_ENGINE_BACKOFF_SECONDS * 2 ** max(0, failures - 1)
    return timezone.now() + timedelta(seconds=min(delay, 300))


def do_fail_replica(*, replica_id: UUID, from_states: Iterable[str], reason: str,
                    **fields: Any) -> bool:
    """Move a replica to `failed`, counting the failure and setting its restart backoff."""
    failures = (Replica.objects.filter(id=replica_id).values_list("restarts", flat=True)
                .first() or 0) + 1
    fields.setdefault("failure_reason", reason)
    return do_transition_replica(
        replica_id=replica_id, from_states=from_states, to_state=State.FAILED, message=reason,
        restarts=F("restarts") + 1, next_start_at=backoff_until(failures), **fields,
    )


def do_stop_replica(*, replica: Replica, reason: str) -> bool:
    """Stop one replica, with `reason` as its event: one with no engine (not on a node, or
    still downloading) is stopped at once; one on a node is stopping and its agent is told
    to stop the engine once this commits.
    Returns False (and changes nothing) when the replica has already moved on."""
    # Nothing runs for a replica pending or failed, nor for one still downloading its weights
    # (its agent gives the download up at its next progress report, keeping what it has).
    if replica.state in (State.PENDING, State.FAILED, State.DOWNLOADING):
        return do_transition_replica(replica_id=replica.id, from_states=[replica.state],
                                     to_state=State.STOPPED, message=reason,
                                     stopped_at=timezone.now())
    moved = do_transition_replica(replica_id=replica.id, from_states=ON_NODE,
                                  to_state=State.STOPPING, message=reason)
    if moved and replica.node is not None:
        wake_node_after_commit(node=replica.node)
    return moved


def do_set_replica_progress(*, replica_id: UUID, state: str, stage: str, percent: int,
                            node_id: int | None = None, **fields: Any) -> bool:
    """Show the replica's stage (and `fields`, such as a download's expected end) while it is
    still in `state` (and, given `node_id`, on that node); False once it has left it (a stop
    came, or its node was lost), which tells a long step to give up."""
    current = Replica.objects.filter(id=replica_id, state=state)
    if node_id is not None:
        current = current.filter(node_id=node_id)
    return bool(current.update(
        stage=stage[:80], progress_percent=percent, progress_at=timezone.now(), **fields))


def do_note_replica(*, replica_id: UUID, message: str) -> None:
    """An event on the replica's endpoint that changes no state (a self-test's verdict);
    nothing for a replica that is gone."""
    replica = Replica.objects.filter(id=replica_id).values("endpoint_id", "state").first()
    if replica is not None:
        EndpointEvent.objects.create(endpoint_id=replica["endpoint_id"], replica_id=replica_id,
                                     state=replica["state"], message=message)


def summarise(*, desired_state: str, desired_replicas: int, deleted: bool,
              replica_states: list[str]) -> str:
    """The endpoint's state as the user reads it, from its replicas' states."""
    live = [state for state in replica_states if state in UNSETTLED]
    if desired_state == DesiredState.STOPPED or deleted:
        return State.STOPPING if live else State.STOPPED
    if State.READY in live:
        return State.READY
    order = [State.LOADING, State.DOWNLOADING, State.STARTING, State.SCHEDULING, State.PENDING,
             State.STOPPING]
    for state in order:
        if state in live:
            return state
    return State.IDLE if desired_replicas == 0 else State.PENDING


def do_refresh_endpoint_state(*, endpoint_id: UUID, failure_reason: str | None = None) -> str:
    """Recompute and store the endpoint's state; record an event when it changes."""
    endpoint = Endpoint.objects.select_for_update().get(id=endpoint_id)
    states = list(endpoint.replicas.values_list("state", flat=True))
    new_state: str
    if failure_reason is not None:
        new_state = State.FAILED
    elif endpoint.state == State.FAILED and endpoint.desired_state == DesiredState.RUNNING:
        return endpoint.state  # stays failed until the user starts it again
    else:
        new_state = summarise(desired_state=endpoint.desired_state,
                              desired_replicas=endpoint.desired_replicas,
                              deleted=endpoint.deleted_at is not None, replica_states=states)
    if new_state != endpoint.state:
        Endpoint.objects.filter(id=endpoint_id).update(
            state=new_state, failure_reason=failure_reason or "")
        EndpointEvent.objects.create(endpoint_id=endpoint_id, state=new_state,
                                     message=failure_reason or f"endpoint is {new_state}")
    return new_state


def do_create_replica(*, endpoint: Endpoint) -> Replica:
    with transaction.atomic():
        replica = Replica.objects.create(endpoint=endpoint, stage="waiting to be scheduled")
        EndpointEvent.objects.create(endpoint=endpoint, replica=replica, state=State.PENDING,
                                     message="replica created")
    return replica
