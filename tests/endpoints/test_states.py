import pytest

from endpoints.lifecycle import (
    do_set_replica_progress,
    do_stop_replica,
    do_transition_replica,
    summarise,
)
from endpoints.models import EndpointEvent, Node, Replica, ReplicaInterval
from endpoints.states import (
    ASKED_FOR,
    COMING_UP,
    ON_NODE,
    PHASE_OF_STATE,
    PROGRESS,
    TRANSITIONS,
    UNSETTLED,
    State,
    TransitionNotAllowed,
)
from tests.factories import demo_endpoint, organization_with_owner

REPLICA_STATES = set(State) - {State.IDLE}  # idle is an endpoint's alone


def test_every_replica_state_has_its_moves_its_progress_and_a_way_to_stopped() -> None:
    assert set(TRANSITIONS) == REPLICA_STATES
    assert set(PROGRESS) == REPLICA_STATES
    for state in REPLICA_STATES - {State.STOPPED}:
        reached, frontier = {state}, {state}
        while frontier:
            frontier = set().union(*(TRANSITIONS[s] for s in frontier)) - reached
            reached |= frontier
        assert State.STOPPED in reached, state


def test_a_replica_holds_devices_and_is_billed_while_on_a_node_or_stopping_but_downloading(
        ) -> None:
    assert set(PHASE_OF_STATE) == (ON_NODE | {State.STOPPING}) - {State.DOWNLOADING}
    assert State.DOWNLOADING in ON_NODE  # its devices wait for the weights, unbilled
    assert ASKED_FOR - ON_NODE == {State.PENDING}
    assert COMING_UP == ASKED_FOR - {State.READY}
    assert UNSETTLED == ASKED_FOR | {State.STOPPING}


@pytest.mark.parametrize(("moves", "expected"), [
    ([State.READY, State.STOPPED], State.READY),
    ([State.LOADING, State.FAILED], State.LOADING),
    ([State.STOPPING, State.STOPPED], State.STOPPING),
    ([State.FAILED, State.STOPPED], State.PENDING),
])
def test_the_endpoint_summarises_its_unsettled_replicas(moves: list[str], expected: str) -> None:
    assert summarise(desired_state="running", desired_replicas=1, deleted=False,
                     replica_states=moves) == expected


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), [
    (State.STOPPED, State.READY), (State.PENDING, State.READY), (State.READY, State.LOADING),
    (State.FAILED, State.READY), (State.STOPPING, State.READY),
])
def test_a_move_the_lifecycle_has_no_place_for_is_refused_and_changes_nothing(
        cpu_node: Node, from_state: str, to_state: str) -> None:
    replica = Replica.objects.create(endpoint=demo_endpoint(organization_with_owner("Acme")),
                                     node=cpu_node, state=from_state)

    with pytest.raises(TransitionNotAllowed, match=f"from {from_state} to {to_state}"):
        do_transition_replica(replica_id=replica.id, from_states=[from_state], to_state=to_state)

    replica.refresh_from_db()
    assert replica.state == from_state
    assert not EndpointEvent.objects.filter(replica=replica).exists()
    assert not ReplicaInterval.objects.filter(replica=replica).exists()


@pytest.mark.django_db
def test_one_refused_origin_refuses_the_whole_move(cpu_node: Node) -> None:
    replica = Replica.objects.create(endpoint=demo_endpoint(organization_with_owner("Acme")),
                                     node=cpu_node, state=State.LOADING)

    with pytest.raises(TransitionNotAllowed, match="from pending to ready"):
        do_transition_replica(replica_id=replica.id, from_states=[State.LOADING, State.PENDING],
                              to_state=State.READY)

    assert Replica.objects.get(id=replica.id).state == State.LOADING


@pytest.mark.django_db
def test_a_replica_stopped_while_downloading_is_stopped_at_once_and_billed_nothing(
        cpu_node: Node) -> None:
    replica = Replica.objects.create(endpoint=demo_endpoint(organization_with_owner("Acme")),
                                     node=cpu_node, state=State.PENDING)
    for before, after in [(State.PENDING, State.SCHEDULING), (State.SCHEDULING, State.STARTING),
                          (State.STARTING, State.DOWNLOADING)]:
        do_transition_replica(replica_id=replica.id, from_states=[before], to_state=after)
    starting = ReplicaInterval.objects.get(replica=replica)

    assert do_stop_replica(replica=Replica.objects.get(id=replica.id), reason="scaled down")

    assert Replica.objects.get(id=replica.id).state == State.STOPPED  # no engine to stop
    assert ReplicaInterval.objects.filter(replica=replica).count() == 1
    assert ReplicaInterval.objects.get(id=starting.id).ended_at is not None
    # Its agent gives the download up at its next report.
    assert not do_set_replica_progress(replica_id=replica.id, state=State.DOWNLOADING,
                                       stage="downloading weights: 1 of 2 GB", percent=30)
