"""A replica's lifecycle in one place: its states, the groups of states the rest of kvrun asks
about, the phase billed in each, the progress the dashboard shows, and the moves allowed
between them, which `lifecycle.do_transition_replica` checks. An endpoint's state summarises
its replicas' (`lifecycle.summarise`) in the same words, plus `idle`.

    pending → scheduling → starting → (downloading →) loading → ready
    on a node (scheduling … ready) → stopping → stopped
    on a node → failed → pending (restarted) or stopped
    pending → stopped

A replica on a node that stopped sending heartbeats goes straight to stopped from any state
on the node, stopping included: the node is gone, and its engine with it.
"""

from django.db import models


class State(models.TextChoices):
    """An endpoint's or a replica's lifecycle."""

    PENDING = "pending"
    SCHEDULING = "scheduling"
    STARTING = "starting"
    # Its node fetches the model's weights into its model cache: devices held, not billed.
    DOWNLOADING = "downloading"
    LOADING = "loading"
    READY = "ready"
    # Running, with no replica: scaled to zero while idle, woken by its next request.
    IDLE = "idle"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class BilledPhase(models.TextChoices):
    """The lifecycle phases in which a replica holds its devices and may be billed;
    scheduling (devices chosen, start not yet sent) counts as starting. Downloading holds them
    too and is never billed: how fast the weights arrive is the hub's and the node's doing,
    not the user's (docs/billing.md)."""

    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"


# Placed on a node, whose devices it holds; an agent may run its engine.
ON_NODE = frozenset({State.SCHEDULING, State.STARTING, State.DOWNLOADING, State.LOADING,
                     State.READY})
# On a node and holding its devices: placed there, or stopping (its engine may still run).
HOLDING_DEVICES = ON_NODE | {State.STOPPING}
# Asked for and not given up: what counts towards an endpoint's replicas.
ASKED_FOR = ON_NODE | {State.PENDING}
# On its way to ready: the gateway holds requests for an endpoint with one of these.
COMING_UP = ASKED_FOR - {State.READY}
# Not yet settled: an engine may still run, or is about to.
UNSETTLED = ASKED_FOR | {State.STOPPING}
# An endpoint in one of these is at rest: nothing moves until someone or something asks.
ENDPOINT_AT_REST = frozenset({State.READY, State.IDLE, State.STOPPED, State.FAILED})

PHASE_OF_STATE: dict[str, str] = {
    State.SCHEDULING: BilledPhase.STARTING, State.STARTING: BilledPhase.STARTING,
    State.LOADING: BilledPhase.LOADING, State.READY: BilledPhase.READY,
    State.STOPPING: BilledPhase.STOPPING,
}

PROGRESS: dict[str, int] = {
    State.PENDING: 0, State.SCHEDULING: 10, State.STARTING: 20, State.DOWNLOADING: 25,
    State.LOADING: 40,
    State.READY: 100, State.STOPPING: 100, State.STOPPED: 100, State.FAILED: 100,
}

# Each state, and the states a replica may move to from it. Stopping to stopping is a stop
# sent again (its event records why).
TRANSITIONS: dict[str, frozenset[str]] = {
    State.PENDING: frozenset({State.SCHEDULING, State.STOPPED}),
    State.SCHEDULING: frozenset({State.STARTING, State.FAILED, State.STOPPING, State.STOPPED}),
    State.STARTING: frozenset({State.DOWNLOADING, State.LOADING, State.FAILED, State.STOPPING,
                               State.STOPPED}),
    State.DOWNLOADING: frozenset({State.LOADING, State.FAILED, State.STOPPING, State.STOPPED}),
    State.LOADING: frozenset({State.READY, State.FAILED, State.STOPPING, State.STOPPED}),
    State.READY: frozenset({State.FAILED, State.STOPPING, State.STOPPED}),
    State.STOPPING: frozenset({State.STOPPING, State.STOPPED}),
    State.FAILED: frozenset({State.PENDING, State.STOPPED}),
    State.STOPPED: frozenset(),
}


class TransitionNotAllowed(ValueError):
    """A move the lifecycle has no place for: a defect in the caller, never the user's."""


def check_transition(*, from_states: frozenset[str] | set[str] | list[str],
                     to_state: str) -> None:
    """Raise TransitionNotAllowed unless a replica may move to `to_state` from each of
    `from_states`."""
    refused = sorted(state for state in from_states
                     if to_state not in TRANSITIONS.get(state, frozenset()))
    if refused:
        raise TransitionNotAllowed(f"a replica never moves from {', '.join(refused)} "
                                   f"to {to_state}")
