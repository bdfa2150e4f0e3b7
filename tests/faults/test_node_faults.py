"""A node agent that goes quiet and comes back, or dies while its engine loads: its replicas
move to a node online, no engine of its previous life stays up, and no replica is placed
beside one."""

import os
import signal
from pathlib import Path

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import Organization
from endpoints.models import Node, NodeState, Replica, State
from endpoints.services import do_drain_node, do_load_catalogs, do_undrain_node
from tests.e2e.test_provisioning import (
    RESTART_WITHIN,
    create,
    delete_and_settle,
    ready_replica,
    state_of,
)
from tests.helpers import (
    api_servers,
    drive,
    group_members,
    process_alive,
    start_agent,
    stop_agent,
    story_of,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

NODE = "e2e-0"  # before e2e-a in name order: an idle e2e-0 takes a CPU replica first


def online(name: str) -> bool:
    return Node.objects.filter(name=name, state=NodeState.ONLINE,
                               gpu_type__isnull=False).exists()


def test_a_lost_node_s_replica_moves_and_the_node_back_stops_its_old_engine_first(
        ready_node: Node, owner_api: APIClient, org: Organization, engine_logs: Path) -> None:
    node_agent = start_agent(NODE, engine_logs)
    try:
        assert wait_until(lambda: online(NODE), 60)
        create(owner_api, org, "returner")
        assert drive(lambda: state_of("returner") == State.READY, RESTART_WITHIN)
        old = ready_replica("returner")
        assert old.node.name == NODE

        # The agent goes quiet (as behind a network partition); its engine keeps running.
        os.kill(node_agent.pid, signal.SIGSTOP)
        try:
            assert drive(lambda: Replica.objects.get(id=old.id).state == State.STOPPED, 30,
                         lose_silent_nodes=True)
            assert Node.objects.get(name=NODE).state == NodeState.LOST
            assert process_alive(old.pid)
            # The replica moves to the node still online. (The liveness check no longer
            # runs: that node's heartbeats come late while its new engine loads.)
            assert drive(lambda: Replica.objects.filter(
                endpoint__name="returner", state=State.READY, node=ready_node).exists(),
                RESTART_WITHIN), story_of(old.endpoint_id)
            # That node drains: the replica's one place to go is the lost node, once back.
            do_drain_node(node_id=ready_node.id)
        finally:
            os.kill(node_agent.pid, signal.SIGCONT)

        def old_engine_gone() -> bool:
            beside = Replica.objects.filter(endpoint__name="returner", node__name=NODE).exclude(
                id=old.id)
            alive = process_alive(old.pid)
            assert not (alive and beside.exists()), "a replica was placed beside the old engine"
            return not alive

        assert drive(old_engine_gone, 60), "the returning node kept its old engine"
        assert drive(lambda: Replica.objects.filter(
            endpoint__name="returner", state=State.READY, node__name=NODE).exists(),
            RESTART_WITHIN), story_of(old.endpoint_id)
        assert len(api_servers("returner")) == 1
        delete_and_settle(owner_api, org, "returner")
    finally:
        do_undrain_node(node_id=ready_node.id)
        stop_agent(node_agent, NODE)


def test_a_restarted_agent_stops_the_engine_its_previous_run_left(
        celery_worker: object, owner_api: APIClient, org: Organization,
        engine_logs: Path) -> None:
    do_load_catalogs()
    first = start_agent(NODE, engine_logs)
    second = None
    try:
        assert wait_until(lambda: online(NODE), 60)
        create(owner_api, org, "leftover")

        def loading_with_workers() -> bool:
            replica = Replica.objects.filter(endpoint__name="leftover", state=State.LOADING,
                                             pid__isnull=False).first()
            return replica is not None and len(group_members(replica.pid)) > 1

        assert drive(loading_with_workers, RESTART_WITHIN)
        # Killed while its engine loads: the engine puts off the SIGTERM it gets for it until
        # it has loaded, holding its memory (on a GPU, its devices) all that time.
        first.kill()
        first.wait()
        killed_at = timezone.now()
        assert api_servers("leftover"), "the engine died with its agent: nothing was left"

        second = start_agent(NODE, engine_logs)

        def back_without_the_leftover() -> bool:
            back = Node.objects.filter(name=NODE, last_heartbeat_at__gt=killed_at).exists()
            assert not (back and api_servers("leftover")), "back while the old engine runs"
            return back

        assert wait_until(back_without_the_leftover, 60)
        assert wait_until(lambda: Replica.objects.get(endpoint__name="leftover").state
                          == State.FAILED, 30)
        assert "the node agent restarted" in Replica.objects.get(
            endpoint__name="leftover").failure_reason
        assert wait_until(lambda: online(NODE), 30)
        delete_and_settle(owner_api, org, "leftover")
    finally:
        stop_agent(first, NODE)
        if second is not None:
            stop_agent(second, NODE)
