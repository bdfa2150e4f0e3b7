"""Endpoints, replica lifecycles, usage and month ends for billing tests, on a controlled
clock."""

from datetime import datetime, timedelta

import time_machine

from accounts.models import APIKey
from billing.ingestion import do_record_usage
from billing.invoicing import do_finalize_due_invoices
from billing.rollup import do_roll_up_usage
from endpoints.lifecycle import do_transition_replica
from endpoints.models import Endpoint, Node, Replica, State
from tests.factories import moves_to, usage_report


def run_replica(replica: Replica, node: Node, steps: list[tuple[datetime, str]]) -> None:
    """Move the replica through `steps`, each (when, state), as the scheduler and agent do."""
    state = Replica.objects.get(id=replica.id).state
    for when, to_state in steps:
        with time_machine.travel(when, tick=False):
            for step in moves_to(state, to_state):
                assert do_transition_replica(replica_id=replica.id, from_states=[state],
                                             to_state=step, message=step, node=node)
                state = step


def ready_for(endpoint: Endpoint, node: Node, start: datetime, hours: float) -> None:
    """One replica's life: 10 s starting, 20 s loading, `hours` ready, 5 s stopping."""
    replica = Replica.objects.filter(endpoint=endpoint).first()
    ready = start + timedelta(seconds=30)
    run_replica(replica, node, [
        (start, State.SCHEDULING), (start + timedelta(seconds=10), State.LOADING),
        (ready, State.READY), (ready + timedelta(hours=hours), State.STOPPING),
        (ready + timedelta(hours=hours, seconds=5), State.STOPPED)])
    Replica.objects.filter(id=replica.id).update(state=State.PENDING)  # for the next life


def record(endpoint: Endpoint, key: APIKey, when: datetime, **tokens: int) -> None:
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=when, **tokens).encode()])


def finalize_at(moment: datetime) -> int:
    with time_machine.travel(moment, tick=False):
        do_roll_up_usage()
        return do_finalize_due_invoices()
