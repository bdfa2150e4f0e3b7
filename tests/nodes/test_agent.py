"""The node agent in this process (a NodeAgent of its own per test), against engines' stand-ins."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from accounts.models import Role
from endpoints.models import Endpoint, ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy
from endpoints.services import do_create_endpoint
from nodes import agent
from tests.factories import organization_with_owner
from tests.helpers import UP_AND_ASLEEP, process_alive, said, sandboxed, wait_until

# An API server that exited, leaving a worker of its group that ignores SIGTERM, as a
# loading engine's does: stopping its group takes the whole grace period. The worker gives
# its pid only once it ignores SIGTERM, so a busy machine cannot stop it before that.
EXITED_WITH_A_STUBBORN_WORKER = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import os, signal, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print(os.getpid(), flush=True); time.sleep(120)"])
"""


def demo_replica(node: Node, state: str) -> Replica:
    """A replica of an endpoint of the demo model on `node`, in `state`."""
    endpoint = do_create_endpoint(
        organization=organization_with_owner("Acme"), actor_role=Role.OWNER, created_by=None,
        name="chat", model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        policy=EndpointPolicy(context_length=2048, concurrency=4))
    return Replica.objects.create(endpoint=endpoint, node=node, state=state)


@pytest.fixture
def node_agent(cpu_node: Node) -> agent.NodeAgent:
    """A node agent of its own for each test, as manage.py node_agent builds one."""
    return agent.NodeAgent(name=cpu_node.name)


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_never_waits_for_an_engine_to_stop(
        cpu_node: Node, node_agent: agent.NodeAgent, settings: object,
        tmp_path: Path) -> None:
    settings.KVRUN_ENGINE_STOP_GRACE_SECONDS = 3
    settings.KVRUN_ENGINE_LOG_DIR = tmp_path
    replica = demo_replica(cpu_node, State.READY)
    server = subprocess.Popen([sys.executable, "-c", EXITED_WITH_A_STUBBORN_WORKER],
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    worker = int(server.stdout.readline())
    server.wait(10)
    node_agent.engines[str(replica.id)] = server

    started = time.monotonic()
    assert node_agent.beat()
    assert time.monotonic() - started < settings.KVRUN_ENGINE_STOP_GRACE_SECONDS / 2

    # Its devices stay held until the group is gone; then the replica fails and restarts.
    assert process_alive(worker) and Replica.objects.get(id=replica.id).state == State.READY
    assert wait_until(lambda: Replica.objects.get(id=replica.id).state == State.FAILED, 15)
    assert not process_alive(worker)
    assert "exited with status 0" in Replica.objects.get(id=replica.id).failure_reason


@pytest.mark.django_db(transaction=True)
def test_a_start_delivered_twice_while_starting_starts_one_engine(
        cpu_node: Node, node_agent: agent.NodeAgent, monkeypatch: pytest.MonkeyPatch,
        settings: object, tmp_path: Path) -> None:
    settings.KVRUN_ENGINE_LOG_DIR = tmp_path
    replica = demo_replica(cpu_node, State.STARTING)
    spawned: list[object] = []
    both_in = threading.Barrier(2)

    def spawn(spec: object, log: Path) -> subprocess.Popen:
        spawned.append(spec)
        raise OSError("no engine in this test")  # recorded as the start's failure
    monkeypatch.setattr(agent.supervisor, "start", spawn)
    real_free_port = agent.processes.free_port

    def free_port_once_both_arrived(address: str) -> int:
        both_in.wait(10)  # both deliveries are past their read of the replica
        return real_free_port(address)
    monkeypatch.setattr(agent.processes, "free_port", free_port_once_both_arrived)

    def deliver() -> None:
        try:
            node_agent.start_replica(str(replica.id))
        finally:
            connection.close()  # this thread's own

    deliveries = [threading.Thread(target=deliver) for _ in range(2)]
    for delivery in deliveries:
        delivery.start()
    for delivery in deliveries:
        delivery.join(30)

    assert len(spawned) == 1
    assert Replica.objects.get(id=replica.id).state == State.FAILED


@pytest.mark.django_db(transaction=True)
def test_an_agent_starting_deletes_the_kv_caches_its_replicas_left_on_disk(
        cpu_node: Node, settings: object, tmp_path: Path) -> None:
    settings.KVRUN_STATE_DIR = tmp_path
    stopped = demo_replica(cpu_node, State.STOPPING)  # the agent died while it stopped
    elsewhere = Replica.objects.create(endpoint=stopped.endpoint, state=State.READY,
                                       node=Node.objects.create(name="cpu-2", address="10.0.0.2",
                                                                cpu_count=2, memory_bytes=2**34))
    for replica in (stopped, elsewhere):
        (agent.cache_dir(replica.id) / "lmcache").mkdir(parents=True)

    agent.stop_engines_left_behind(name=cpu_node.name)

    assert not agent.cache_dir(stopped.id).exists()
    assert (agent.cache_dir(elsewhere.id) / "lmcache").is_dir()  # another node's, running


@pytest.mark.django_db(transaction=True)
def test_an_engine_kvrun_no_longer_expects_is_stopped_and_its_kv_cache_deleted(
        cpu_node: Node, node_agent: agent.NodeAgent, settings: object, tmp_path: Path) -> None:
    settings.KVRUN_STATE_DIR = tmp_path
    replica = demo_replica(cpu_node, State.STOPPED)
    (agent.cache_dir(replica.id) / "lmcache").mkdir(parents=True)
    engine = sandboxed(UP_AND_ASLEEP, owner=agent.owner(cpu_node.name), replica=str(replica.id),
                       model_dir=tmp_path, log_path=tmp_path / "engine.log")
    assert said(tmp_path / "engine.log", "up")

    assert node_agent.beat()

    assert wait_until(lambda: engine.poll() is not None, 15)
    assert wait_until(lambda: not agent.cache_dir(replica.id).exists(), 5)



@pytest.mark.django_db
def test_an_organisation_s_compile_cache_is_its_own_and_goes_with_its_last_endpoint(
        cpu_node: Node, settings: object, tmp_path: Path) -> None:
    settings.KVRUN_STATE_DIR = tmp_path
    kept, emptied = (demo_replica(cpu_node, State.READY).endpoint for _ in range(2))
    assert kept.organization_id != emptied.organization_id
    assert agent.spec_for(demo_replica(cpu_node, State.STARTING), 8000).compile_cache not in (
        str(agent.compile_cache_dir(kept.organization_id)),
        str(agent.compile_cache_dir(emptied.organization_id)))
    for endpoint in (kept, emptied):
        (agent.compile_cache_dir(endpoint.organization_id) / "vllm").mkdir(parents=True)
    Endpoint.objects.filter(id=emptied.id).update(deleted_at=timezone.now())

    assert agent.delete_unused_compile_caches() == 1

    assert [path.name for path in agent.compile_cache_root().iterdir()] == [
        str(kept.organization_id)]


@pytest.mark.django_db
def test_old_engine_logs_of_stopped_replicas_are_deleted(
        cpu_node: Node, settings: object, tmp_path: Path) -> None:
    settings.KVRUN_ENGINE_LOG_DIR = tmp_path
    stopped, ready, failed, recent = (demo_replica(cpu_node, state) for state in (
        State.STOPPED, State.READY, State.FAILED, State.STOPPED))
    gone = "0b6f4e4e-8f3c-4a55-9d5e-1f2a3b4c5d6e"  # a replica whose row was deleted
    eight_days_ago = time.time() - 8 * 86400
    for name in (stopped.id, ready.id, failed.id, gone, "notes"):
        log = tmp_path / f"{name}.log"
        log.write_text("INFO engine\n")
        os.utime(log, (eight_days_ago, eight_days_ago))
    (tmp_path / f"{recent.id}.log").write_text("INFO engine\n")

    assert agent.delete_old_logs() == 2

    assert sorted(path.stem for path in tmp_path.iterdir()) == sorted(
        [str(ready.id), str(failed.id), str(recent.id), "notes"])


def test_cpu_engines_are_bound_to_the_cores_the_fewest_running_engines_use(
        node_agent: agent.NodeAgent, monkeypatch: pytest.MonkeyPatch, settings: object) -> None:
    settings.KVRUN_NODE_CPU_CORES_PER_ENGINE = 2
    monkeypatch.setattr(agent.os, "sched_getaffinity", lambda pid: {3, 2, 1, 0})

    def started(replica_id: str) -> tuple[int, ...]:
        cores = node_agent._cores_for(replica_id)
        node_agent.engines[replica_id] = subprocess.Popen(["true"])  # its engine, as spawned
        return cores

    assert (started("a"), started("b")) == ((0, 1), (2, 3))
    assert started("c") == (0, 1)  # none free: shared with the fewest engines
    del node_agent.engines["a"], node_agent.engines["c"]  # stopped: their cores are free
    assert started("d") == (0, 1)
    assert node_agent.cpu_cores == {"b": (2, 3), "d": (0, 1)}
