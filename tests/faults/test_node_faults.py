"""A node agent that goes quiet and comes back, is cut off from the control plane, or dies
while its engine loads or its weights download: its replicas move to a node online, no
engine of its previous life stays up, no replica is placed beside one, and a download cut
off goes on from where it was."""

import os
import shutil
import signal
import uuid
from pathlib import Path

import httpx
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import Organization
from bench.hub_server import Hub
from endpoints.models import Node, NodeState, Replica, State
from endpoints.services import do_drain_node, do_load_catalogs, do_undrain_node
from engine.processes import free_port
from fleet.enrolment import do_revoke_node
from nodes.config import AgentConfig
from tests.e2e.test_provisioning import (
    RESTART_WITHIN,
    complete,
    create,
    delete_and_settle,
    ready_replica,
    state_of,
)
from tests.helpers import (
    ANSWER_WITHIN,
    UP_AND_ASLEEP,
    api_servers,
    drive,
    engine_processes,
    process_alive,
    said,
    sandboxed,
    start_agent,
    start_web,
    stop,
    stop_agent,
    story_of,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

NODE = "e2e-0"  # before e2e-a in name order: an idle e2e-0 takes a CPU replica first
MB = 2**20


def online(name: str) -> bool:
    return Node.objects.filter(name=name, state=NodeState.ONLINE,
                               gpu_type__isnull=False).exists()


def ready_on_the_node(api: APIClient, org: Organization, name: str) -> Replica:
    """Once the node is online, an endpoint `name` created and its replica ready there."""
    assert wait_until(lambda: online(NODE), 60)
    create(api, org, name)
    assert drive(lambda: state_of(name) == State.READY, RESTART_WITHIN)
    replica = ready_replica(name)
    assert replica.node.name == NODE
    return replica


def back_on_the_node_then_deleted(api: APIClient, org: Organization, old: Replica) -> None:
    """The endpoint of `old` ready again on the node that came back, with one engine; then
    deleted, and its engines gone."""
    name = old.endpoint.name
    assert drive(lambda: Replica.objects.filter(
        endpoint__name=name, state=State.READY, node__name=NODE).exists(),
        RESTART_WITHIN), story_of(old.endpoint_id)
    assert len(api_servers(name)) == 1
    delete_and_settle(api, org, name)


def test_a_lost_node_s_replica_moves_and_the_node_back_stops_its_old_engine_first(
        ready_node: Node, web: str, owner_api: APIClient, org: Organization,
        engine_logs: Path) -> None:
    node_agent = start_agent(NODE, engine_logs, web=web)
    try:
        old = ready_on_the_node(owner_api, org, "returner")

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
        back_on_the_node_then_deleted(owner_api, org, old)
    finally:
        do_undrain_node(node_id=ready_node.id)
        stop_agent(node_agent, NODE)


def test_a_node_cut_off_from_the_control_plane_keeps_serving_and_settles_once_back(
        ready_node: Node, owner_api: APIClient, org: Organization, engine_logs: Path) -> None:
    # The node reaches the control plane through a web process of its own: killing that cuts
    # its channel, the agent and its engine running on.
    port = free_port()
    channel = start_web(port, KVRUN_NODE_HEARTBEAT_SECONDS="1")
    node_agent = start_agent(NODE, engine_logs, web=f"http://127.0.0.1:{port}")
    try:
        do_drain_node(node_id=ready_node.id)  # the replica's one place is the node cut off
        old = ready_on_the_node(owner_api, org, "islander")

        channel.kill()
        channel.wait()
        assert drive(lambda: Replica.objects.get(id=old.id).state == State.STOPPED, 30,
                     lose_silent_nodes=True)
        assert Node.objects.get(name=NODE).state == NodeState.LOST
        # Cut off, the node keeps its engine serving those who reach it.
        assert complete(old, "islander").status_code == 200

        channel = start_web(port, KVRUN_NODE_HEARTBEAT_SECONDS="1")  # the channel back
        # Its agent reports the engine, is told kvrun no longer expects it, stops it, and
        # only then does the node take the endpoint's replica again.
        assert drive(lambda: not process_alive(old.pid), 60), "the old engine outlived the cut"
        back_on_the_node_then_deleted(owner_api, org, old)
    finally:
        do_undrain_node(node_id=ready_node.id)
        stop_agent(node_agent, NODE)
        stop(channel)


def test_a_revoked_node_stops_its_engines_its_replica_moves_and_its_credential_opens_nothing(
        ready_node: Node, web: str, owner_api: APIClient, org: Organization,
        engine_logs: Path) -> None:
    node_agent = start_agent(NODE, engine_logs, web=web)
    try:
        do_drain_node(node_id=ready_node.id)  # the replica's one place is the node revoked
        old = ready_on_the_node(owner_api, org, "exile")
        do_undrain_node(node_id=ready_node.id)
        stolen = AgentConfig.from_environ().credential_file(NODE).read_text()

        do_revoke_node(node_id=old.node_id)

        # Refused at its next call, the agent stops its engine, and itself.
        assert wait_until(lambda: node_agent.poll() is not None, 60), "the agent ran on"
        assert not process_alive(old.pid), "the revoked node's engine ran on"
        assert drive(lambda: Replica.objects.filter(
            endpoint__name="exile", state=State.READY, node=ready_node).exists(),
            RESTART_WITHIN), story_of(old.endpoint_id)
        # Its credential, replayed from another host, opens nothing.
        replayed = httpx.get(f"{web}/node/v1/replicas", timeout=ANSWER_WITHIN,
                             headers={"Authorization": f"Bearer {stolen}"})
        assert replayed.status_code == 401
        delete_and_settle(owner_api, org, "exile")
    finally:
        do_undrain_node(node_id=ready_node.id)
        stop_agent(node_agent, NODE)


def test_a_killed_agent_takes_its_loading_engine_along_and_a_restart_stops_any_left(
        celery_worker: object, web: str, owner_api: APIClient, org: Organization,
        engine_logs: Path) -> None:
    do_load_catalogs()
    first = start_agent(NODE, engine_logs, web=web)
    second = left = None
    try:
        assert wait_until(lambda: online(NODE), 60)
        create(owner_api, org, "leftover")

        def loading_with_workers() -> bool:
            replica = Replica.objects.filter(endpoint__name="leftover", state=State.LOADING,
                                             pid__isnull=False).first()
            return replica is not None and len(engine_processes(replica.pid)) > 1

        assert drive(loading_with_workers, RESTART_WITHIN)
        # Killed while its engine loads, which puts off SIGTERM until it has loaded: the
        # engine's sandbox dies with the agent and kills it outright.
        first.kill()
        first.wait()
        killed_at = timezone.now()
        assert wait_until(lambda: not api_servers("leftover"), 15), "the engine outlived its agent"

        # One left all the same, marked as that replica's engine: the restarted agent stops
        # it before it registers.
        replica = Replica.objects.get(endpoint__name="leftover")
        left = sandboxed(UP_AND_ASLEEP, owner=AgentConfig.from_environ().owner(NODE),
                         replica=str(replica.id), model_dir=engine_logs,
                         log_path=engine_logs / "left.log")
        assert said(engine_logs / "left.log", "up")
        second = start_agent(NODE, engine_logs, web=web, rejoin=False)

        def back_without_the_leftover() -> bool:
            back = Node.objects.filter(name=NODE, last_heartbeat_at__gt=killed_at).exists()
            assert not (back and left.poll() is None), "back while the old engine runs"
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
        if left is not None and left.poll() is None:
            left.kill()


def test_a_node_killed_mid_download_resumes_it_when_back(
        celery_worker: object, web: str, owner_api: APIClient, org: Organization,
        engine_logs: Path, hub: Hub, hub_url: str, tmp_path: Path) -> None:
    do_load_catalogs()
    folder = shutil.copytree(hub.root / "kvrun/demo" / hub.commit_of("kvrun/demo", "main"),
                             tmp_path / "demo")
    (folder / "padding.txt").write_bytes(os.urandom(24 * MB))  # long enough to cut midway
    repo = f"acme/resumed-{uuid.uuid4().hex[:8]}"  # never downloaded before on this machine
    hub.publish(repo, folder)
    first = start_agent(NODE, engine_logs, web=web, KVRUN_HUB_URL=hub.url)
    second = None
    try:
        assert wait_until(lambda: online(NODE) and Node.objects.get(name=NODE).architectures,
                          120)
        added = owner_api.post(f"/api/v1/organizations/{org.slug}/models/", {"hf_repo": repo},
                               format="json")
        assert added.status_code == 201, added.content
        size = added.json()["download_bytes"]
        hub.rate_bytes_per_second = 4 * MB
        sent_before = hub.bytes_sent
        create(owner_api, org, "resumed", model=added.json()["slug"])
        # Past the hub client's first 10 MB write to the file.
        assert drive(lambda: hub.bytes_sent - sent_before >= 14 * MB, RESTART_WITHIN)
        replica = Replica.objects.get(endpoint__name="resumed")
        assert (replica.state, replica.node.name) == (State.DOWNLOADING, NODE)
        first.kill()  # as a crash or a power cut would
        first.wait()
        [cut] = (AgentConfig.from_environ().model_dir / "hub").glob(
            f"{repo.replace('/', '--')}/*.partial/padding.txt.incomplete")
        written = cut.stat().st_size
        assert written >= 10 * MB

        hub.rate_bytes_per_second = None
        sent_at_restart = hub.bytes_sent
        second = start_agent(NODE, engine_logs, web=web, rejoin=False, KVRUN_HUB_URL=hub.url)
        assert drive(lambda: state_of("resumed") == State.READY, RESTART_WITHIN), story_of(
            replica.endpoint_id)
        # The second download asked only for what the first had not written.
        assert hub.bytes_sent - sent_at_restart <= size - written
        assert "the node agent restarted" in "\n".join(replica.endpoint.events.values_list(
            "message", flat=True))
        delete_and_settle(owner_api, org, "resumed")
    finally:
        hub.rate_bytes_per_second = None
        stop_agent(first, NODE)
        if second is not None:
            stop_agent(second, NODE)
