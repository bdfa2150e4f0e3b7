"""What a node agent reports about its own replicas, and the moves it may make them.

An agent moves a replica only along the steps of starting and stopping an engine
(AGENT_MOVES), sets only the fields those steps have, and only while the replica is on its
node: the conditional update carries the node, so a replica moved elsewhere meanwhile is
left alone. Times are the control plane's own.
"""

from collections.abc import Iterable
from datetime import datetime
from typing import Any
from uuid import UUID

from django.utils import timezone

from endpoints.dispatch import take_pull
from endpoints.lifecycle import (
    do_fail_replica,
    do_note_replica,
    do_set_replica_progress,
    do_transition_replica,
)
from endpoints.models import EndpointEvent, ModelSpec, Node, Replica, State
from endpoints.selectors import hub_token_of
from endpoints.services import do_pin_model
from endpoints.states import PROGRESS
from engine.metrics import EngineSnapshot
from fleet.selectors import FETCHING_MODEL, SERVING_ADAPTERS, NotNow
from telemetry.services import do_record_engine_samples

# To each state an agent may move a replica to: the states it may move it from, and the
# fields it may report with the move.
AGENT_MOVES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    State.DOWNLOADING: (frozenset({State.STARTING}), frozenset()),
    State.LOADING: (frozenset({State.STARTING, State.DOWNLOADING}),
                    frozenset({"port", "policy_version", "tool_call_parser",
                               "reasoning_parser"})),
    State.READY: (frozenset({State.LOADING}), frozenset({"kv_cache_tokens", "log_tail"})),
    State.STOPPED: (frozenset({State.STOPPING}), frozenset({"log_tail"})),
}
# A replica in one of these has its agent at work on it: fetching its weights, then waiting
# for its engine, then watching it serve. Only then can its engine fail, or the agent have
# something to tell of it.
AGENT_AT_WORK = frozenset({State.DOWNLOADING, State.LOADING, State.READY})
# What a move sets besides what the agent reports.
_SET_BY_MOVE: dict[str, Any] = {
    State.LOADING: lambda: {"download_done_at": None, "adapters": [], "tls": False},
    State.READY: lambda: {"ready_at": timezone.now(), "restarts": 0},
    State.STOPPED: lambda: {"stopped_at": timezone.now(), "pid": None},
}


class MoveRefused(ValueError):
    """An agent asked for a move or a field that is not its to make."""


def failure_text(reason: str, log_tail: str) -> str:
    """A failed replica's reason as its user reads it: with its engine's last lines."""
    return f"{reason}. Last engine log lines:\n{log_tail}" if log_tail else reason


def _downloaded_for(replica_id: UUID) -> dict[str, Any]:
    """How long the replica's download took, by the control plane's clock: from its move to
    downloading until now; nothing for a replica that downloaded nothing."""
    began = (EndpointEvent.objects.filter(replica_id=replica_id, state=State.DOWNLOADING)
             .order_by("-at").values_list("at", flat=True).first())
    if began is None or not Replica.objects.filter(id=replica_id,
                                                   state=State.DOWNLOADING).exists():
        return {}
    return {"download_seconds": (timezone.now() - began).total_seconds()}


def do_report_replica_move(*, node: Node, replica_id: UUID, from_states: Iterable[str],
                           to_state: str, message: str, **fields: Any) -> bool:
    """Move the node's replica from one of `from_states` to `to_state` as its agent reports.
    False (and no change) when it is no longer in one of them or no longer on the node.
    Raises MoveRefused for a move or field outside AGENT_MOVES."""
    allowed_from, allowed_fields = AGENT_MOVES.get(to_state, (frozenset(), frozenset()))
    asked_from = frozenset(from_states)
    if not asked_from or not asked_from <= allowed_from:
        raise MoveRefused(f"an agent does not move a replica from {sorted(asked_from)} to "
                          f"{to_state}")
    if fields.keys() - allowed_fields:
        raise MoveRefused(f"an agent does not set {sorted(fields.keys() - allowed_fields)} "
                          f"moving a replica to {to_state}")
    setting = _SET_BY_MOVE.get(to_state)
    measured = _downloaded_for(replica_id) if to_state == State.LOADING else {}
    # Gateways reach engines over TLS: an engine is ready only once a certificate was signed
    # for its start (the move to loading clears it), checked in the move's own update.
    where = {"tls": True} if to_state == State.READY else {}
    moved = do_transition_replica(replica_id=replica_id, from_states=asked_from,
                                  to_state=to_state, message=message, node_id=node.id,
                                  where=where, **fields, **measured,
                                  **(setting() if setting else {}))
    if not moved and where and Replica.objects.filter(
            id=replica_id, node=node, state__in=asked_from, tls=False).exists():
        raise MoveRefused("an engine serves only over TLS: ask for its certificate before "
                          "it is ready")
    return moved


def do_report_replica_failure(*, node: Node, replica_id: UUID, from_states: Iterable[str],
                              reason: str, log_tail: str) -> bool:
    """The replica's engine failed (or could not be fetched or started) while its agent was
    at work on it; the engine's last lines go with the reason. False when it had moved on."""
    asked_from = frozenset(from_states)
    if not asked_from or not asked_from <= AGENT_AT_WORK:
        raise MoveRefused(f"an agent does not fail a replica from {sorted(asked_from)}")
    return do_fail_replica(replica_id=replica_id, from_states=asked_from, reason=reason,
                           failure_reason=failure_text(reason, log_tail), log_tail=log_tail,
                           pid=None, node_id=node.id)


def do_report_replica_progress(*, node: Node, replica_id: UUID, state: str, stage: str,
                               percent: int, download_done_at: datetime | None = None) -> bool:
    """Show how far the replica's step is; False once it has left `state` (the agent gives
    the step up). While it downloads, `percent` is the download's, shown as the part of the
    replica's start that downloading is."""
    if state == State.DOWNLOADING:
        span = PROGRESS[State.LOADING] - PROGRESS[State.DOWNLOADING]
        percent = PROGRESS[State.DOWNLOADING] + percent * span // 100
    return do_set_replica_progress(replica_id=replica_id, state=state, stage=stage,
                                   percent=percent, node_id=node.id,
                                   download_done_at=download_done_at)


def do_report_replica_pid(*, node: Node, replica_id: UUID, pid: int) -> None:
    """The process id of the replica's engine (the console shows it), once it is spawned:
    kept while the replica loads; ignored in any other state."""
    Replica.objects.filter(id=replica_id, node=node, state=State.LOADING).update(pid=pid)


def do_report_replica_log(*, node: Node, replica_id: UUID, log_tail: str) -> None:
    """The last lines of the engine's log, shown while it loads and serves; ignored in any
    other state."""
    Replica.objects.filter(id=replica_id, node=node,
                           state__in=[State.LOADING, State.READY]).update(log_tail=log_tail)


def do_report_replica_event(*, node: Node, replica_id: UUID, message: str) -> None:
    """An event on the replica's endpoint that moves nothing (a download finished, a
    self-test's verdict, an adapter not served), while its agent is at work on it. Raises
    NotNow otherwise: a node has nothing to tell a tenant of a replica it does not run."""
    if not Replica.objects.filter(id=replica_id, node=node, state__in=AGENT_AT_WORK).exists():
        raise NotNow("The replica's agent is not at work on it.")
    do_note_replica(replica_id=replica_id, message=message)


def do_report_served_adapters(*, node: Node, replica_id: UUID, names: list[str]) -> None:
    """The adapters the replica's engine serves now, by name, while it loads (its agent
    serves them before the replica takes traffic) or is ready; ignored in any other state."""
    Replica.objects.filter(id=replica_id, node=node, state__in=SERVING_ADAPTERS).update(
        adapters=sorted(names))


def do_report_engine_samples(*, node: Node,
                             samples: list[tuple[UUID, datetime, EngineSnapshot]]) -> int:
    """Store the node's engines' samples (replica, read at, snapshot); those of replicas not
    on the node are dropped. Returns how many were kept or known already."""
    endpoints = dict(Replica.objects.filter(
        node=node, id__in=[replica_id for replica_id, _, _ in samples]).values_list(
        "id", "endpoint_id"))
    return do_record_engine_samples(samples=[
        (replica_id, endpoints[replica_id], at, snapshot)
        for replica_id, at, snapshot in samples if replica_id in endpoints])


def do_take_model_pull(*, node: Node, model_id: int) -> tuple[ModelSpec, str | None] | None:
    """Take the pull of a model an operator asked of the node (endpoints.dispatch.request_pull):
    the model, pinned, and its hub token, once per asking; None when none waits, or when the
    model is another organisation's than the node's (its weights and token stay off that
    node whoever asked). Raises hub.HubRefusal."""
    model = ModelSpec.objects.filter(id=model_id).first()
    if model is None or not take_pull(node_id=node.id, model_id=model_id):
        return None
    if node.organization_id is not None and model.organization_id != node.organization_id:
        return None
    token = hub_token_of(model)
    if not model.hf_repo or model.hf_repo.startswith("/"):  # built here, or an import's folder
        return model, token
    return do_pin_model(model=model, token=token), token


def do_pin_replica_model(*, replica: Replica) -> ModelSpec:
    """Pin the replica's model to a commit (the first node to fetch a model named by its hub
    id alone does), with the model's own token, which stays here. Raises NotNow unless the
    replica is downloading its weights, and hub.HubRefusal."""
    if replica.state not in FETCHING_MODEL:
        raise NotNow("The replica is not downloading its weights.")
    model = replica.endpoint.model
    return do_pin_model(model=model, token=hub_token_of(model))
