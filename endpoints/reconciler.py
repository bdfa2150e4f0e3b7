"""Move each endpoint's replicas towards what the user asked for.

Runs from beat every few seconds and after every change a user makes. Each pass reads the
rows, decides, and acts only through conditional transitions, so two passes at once, or a
pass replayed, never start a second engine for one replica.
"""

from datetime import timedelta
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from endpoints.dispatch import wake_node_after_commit
from endpoints.lifecycle import (
    do_create_replica,
    do_fail_replica,
    do_refresh_endpoint_state,
    do_stop_replica,
    do_transition_replica,
)
from endpoints.models import DesiredState, Endpoint, NodeState, Replica
from endpoints.scheduling import do_place_replica
from endpoints.states import ASKED_FOR, HOLDING_DEVICES, UNSETTLED, State

# What an agent's stop may take beyond its grace period (the process reaped, the port freed).
QUIET_MARGIN_SECONDS = 30


def endpoints_to_reconcile() -> list[UUID]:
    unsettled = Q(replicas__state__in=UNSETTLED)
    return list(
        Endpoint.objects.filter(Q(deleted_at=None, desired_state=DesiredState.RUNNING) | unsettled)
        .values_list("id", flat=True).distinct()
    )


def reconcile_endpoint(*, endpoint_id: UUID) -> None:
    """One pass for one endpoint, holding its row: a concurrent pass skips it rather than
    creating a second replica for the same slot."""
    with transaction.atomic():
        endpoint = Endpoint.objects.select_for_update(skip_locked=True).filter(
            id=endpoint_id).first()
        if endpoint is None:  # deleted for good, or another pass is on it
            return
        _release_replicas_on_lost_nodes(endpoint)
        _retry_quiet_transitions(endpoint)
        if endpoint.desired_state == DesiredState.RUNNING and endpoint.deleted_at is None:
            if endpoint.state != State.FAILED:
                _retry_failed(endpoint)
                _roll_to_new_policy(endpoint)
                _match_replica_count(endpoint)
                _schedule_pending(endpoint)
                _fail_stuck(endpoint)
        else:
            for replica in endpoint.replicas.exclude(state__in=[State.STOPPED, State.STOPPING]):
                do_stop_replica(replica=replica, reason="the endpoint was stopped")
        do_refresh_endpoint_state(endpoint_id=endpoint.id)


def _release_replicas_on_lost_nodes(endpoint: Endpoint) -> None:
    """Settle a lost or revoked node's replicas without waiting for it; fresh ones replace
    them elsewhere. Their engines may still run there: if a lost node comes back, its
    heartbeats keep it recovering (no replica is placed on it) until its agent has stopped
    them (fleet.reports.do_record_node_heartbeat). The node rows are held while this settles,
    so a heartbeat that brings one back waits and then sees these replicas settled; a node
    row a heartbeat holds is skipped until the next pass (an agent frozen mid-heartbeat must
    not stall every pass)."""
    lost = endpoint.replicas.filter(state__in=HOLDING_DEVICES,
                                    node__state__in=[NodeState.LOST, NodeState.REVOKED])
    for replica in lost.select_related("node").select_for_update(of=("node",), skip_locked=True):
        why = ("was revoked" if replica.node.state == NodeState.REVOKED
               else "stopped sending heartbeats")
        do_transition_replica(
            replica_id=replica.id, from_states=HOLDING_DEVICES,
            to_state=State.STOPPED, stopped_at=timezone.now(),
            held_until=replica.node.last_heartbeat_at,
            message=f"node {replica.node.name} {why}; rescheduling",
        )


def _retry_failed(endpoint: Endpoint) -> None:
    """Restart failed replicas after their backoff; after too many failures, fail the endpoint
    with the engine's own last lines as the reason."""
    for replica in endpoint.replicas.filter(state=State.FAILED):
        if replica.restarts >= settings.KVRUN_ENGINE_MAX_FAILURES:
            do_refresh_endpoint_state(
                endpoint_id=endpoint.id,
                failure_reason=f"The engine failed {replica.restarts} times in a row. "
                               f"{replica.failure_reason}",
            )
            return
        if replica.next_start_at is None or replica.next_start_at <= timezone.now():
            do_transition_replica(
                replica_id=replica.id, from_states=[State.FAILED], to_state=State.PENDING,
                message=f"restarting (attempt {replica.restarts + 1})", node=None,
                device_indices=[], pid=None, port=None,
            )


def _roll_to_new_policy(endpoint: Endpoint) -> None:
    """Replace the replicas started under an older policy one at a time, the next only once
    every replica is ready again: an endpoint of two or more replicas serves throughout.
    The replica stopped here is replaced by _match_replica_count in the same pass."""
    live = list(endpoint.replicas.filter(state__in=ASKED_FOR).select_related("node"))
    outdated = [replica for replica in live
                if replica.policy_version < endpoint.policy_version]
    if (not outdated or len(live) < endpoint.desired_replicas
            or any(replica.state != State.READY for replica in live)):
        return
    oldest = min(outdated, key=lambda replica: replica.created_at)
    do_stop_replica(replica=oldest, reason=f"replaced by one with the endpoint's new policy "
                                           f"(version {endpoint.policy_version})")


def _match_replica_count(endpoint: Endpoint) -> None:
    slots = list(endpoint.replicas.filter(state__in=ASKED_FOR | {State.FAILED})
                 .order_by("-created_at"))
    missing = endpoint.desired_replicas - len(slots)
    for _ in range(max(0, missing)):
        do_create_replica(endpoint=endpoint)
    for replica in slots[: max(0, -missing)]:
        do_stop_replica(replica=replica, reason="scaled down")


def _schedule_pending(endpoint: Endpoint) -> None:
    for replica in endpoint.replicas.filter(state=State.PENDING):
        node = do_place_replica(replica_id=replica.id)
        if node is None:
            continue
        moved = do_transition_replica(replica_id=replica.id, from_states=[State.SCHEDULING],
                                      to_state=State.STARTING,
                                      message=f"start sent to node {node.name}")
        if moved:
            wake_node_after_commit(node=node)


def _fail_stuck(endpoint: Endpoint) -> None:
    """A start that no node agent picked up in time (its agent down or away) counts as a failure."""
    for replica in endpoint.replicas.filter(state__in=[State.SCHEDULING, State.STARTING]):
        if _quiet_for(replica, settings.KVRUN_ENGINE_START_TIMEOUT_SECONDS):
            do_fail_replica(replica_id=replica.id, from_states=[State.SCHEDULING, State.STARTING],
                            reason="no node agent started the engine in time")


def _retry_quiet_transitions(endpoint: Endpoint) -> None:
    """Starts and stops whose agent went quiet (its transition hit a database error or a
    deadlock, its stop timed out, its task was lost) would hold a replica, and its devices,
    forever. A replica still loading after the agent's own start timeout, and the stop that
    would have followed it, is stopped; a stop that nothing confirmed is sent again. Either
    way the replica keeps its devices until its agent confirms that the engine is gone."""
    grace = settings.KVRUN_ENGINE_STOP_GRACE_SECONDS + QUIET_MARGIN_SECONDS
    patience = settings.KVRUN_ENGINE_START_TIMEOUT_SECONDS + grace
    # A download reports progress every second or so, however long it takes.
    for replica in endpoint.replicas.filter(
            Q(progress_at__isnull=True) | Q(progress_at__lt=timezone.now() - timedelta(
                seconds=patience)), state=State.DOWNLOADING):
        if _quiet_for(replica, patience):
            do_stop_replica(replica=replica, reason="the download of its weights made no "
                                                    "progress in time; stopping it")
    for replica in endpoint.replicas.filter(state=State.LOADING).select_related("node"):
        if _quiet_for(replica, patience):
            do_stop_replica(replica=replica, reason="the engine was not ready in time and its "
                                                    "node agent did not say why; stopping it")
    for replica in endpoint.replicas.filter(state=State.STOPPING).select_related("node"):
        if replica.node is not None and _quiet_for(replica, grace):
            moved = do_transition_replica(
                replica_id=replica.id, from_states=[State.STOPPING], to_state=State.STOPPING,
                message=f"no stop confirmed in {grace} s; asking its node again")
            if moved:
                wake_node_after_commit(node=replica.node)


def _quiet_for(replica: Replica, seconds: float) -> bool:
    """Whether the replica's last event is more than `seconds` old."""
    last = replica.events.order_by("-at").values_list("at", flat=True).first()
    return last is not None and last < timezone.now() - timedelta(seconds=seconds)
