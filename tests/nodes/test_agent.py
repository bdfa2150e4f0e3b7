"""The node agent in this process (a NodeAgent of its own per test, tests/nodes/conftest.py),
against engines' stand-ins."""

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from django.db import connection

from endpoints.models import Node, Replica, State
from fleet.certificates import replica_host_name
from fleet.selectors import node_work
from nodes import agent
from nodes.config import AgentConfig, Timings
from tests.helpers import UP_AND_ASLEEP, process_alive, said, sandboxed, wait_until
from tests.nodes.helpers import demo_replica

# An API server that exited, leaving a worker of its group that ignores SIGTERM, as a
# loading engine's does: stopping its group takes the whole grace period. The worker gives
# its pid only once it ignores SIGTERM, so a busy machine cannot stop it before that.
EXITED_WITH_A_STUBBORN_WORKER = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import os, signal, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print(os.getpid(), flush=True); time.sleep(120)"])
"""


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_never_waits_for_an_engine_to_stop(
        cpu_node: Node, node_agent: agent.NodeAgent) -> None:
    node_agent.timings = Timings(stop_grace_seconds=3)
    replica = demo_replica(cpu_node, State.READY)
    server = subprocess.Popen([sys.executable, "-c", EXITED_WITH_A_STUBBORN_WORKER],
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    worker = int(server.stdout.readline())
    server.wait(10)
    node_agent.engines[str(replica.id)] = server

    started = time.monotonic()
    assert node_agent.beat()
    assert time.monotonic() - started < node_agent.timings.stop_grace_seconds / 2

    # Its devices stay held until the group is gone; then the replica fails and restarts.
    assert process_alive(worker) and Replica.objects.get(id=replica.id).state == State.READY
    assert wait_until(lambda: Replica.objects.get(id=replica.id).state == State.FAILED, 15)
    assert not process_alive(worker)
    assert "exited with status 0" in Replica.objects.get(id=replica.id).failure_reason


@pytest.mark.django_db(transaction=True)
def test_a_start_delivered_twice_while_starting_starts_one_engine(
        cpu_node: Node, node_agent: agent.NodeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
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
        cpu_node: Node, node_agent: agent.NodeAgent) -> None:
    stopped = demo_replica(cpu_node, State.STOPPING)  # the agent died while it stopped
    elsewhere = Replica.objects.create(endpoint=stopped.endpoint, state=State.READY,
                                       node=Node.objects.create(name="cpu-2", address="10.0.0.2",
                                                                cpu_count=2, memory_bytes=2**34))
    for replica in (stopped, elsewhere):
        (node_agent.config.kv_dir(replica.id) / "lmcache").mkdir(parents=True)

    node_agent.delete_kv_caches_left_behind()

    assert not node_agent.config.kv_dir(stopped.id).exists()
    assert (node_agent.config.kv_dir(elsewhere.id) / "lmcache").is_dir()  # another node's, running


@pytest.mark.django_db(transaction=True)
def test_an_engine_kvrun_no_longer_expects_is_stopped_and_its_kv_cache_deleted(
        cpu_node: Node, node_agent: agent.NodeAgent, tmp_path: Path) -> None:
    replica = demo_replica(cpu_node, State.STOPPED)
    (node_agent.config.kv_dir(replica.id) / "lmcache").mkdir(parents=True)
    engine = sandboxed(UP_AND_ASLEEP, owner=node_agent.config.owner(cpu_node.name),
                       replica=str(replica.id), model_dir=tmp_path,
                       log_path=tmp_path / "engine.log")
    assert said(tmp_path / "engine.log", "up")

    assert node_agent.beat()

    assert wait_until(lambda: engine.poll() is not None, 15)
    assert wait_until(lambda: not node_agent.config.kv_dir(replica.id).exists(), 5)



@pytest.mark.django_db(transaction=True)
def test_an_organisation_s_compile_cache_is_its_own_and_outlives_its_last_engine_a_week(
        cpu_node: Node, node_agent: agent.NodeAgent) -> None:
    config = node_agent.config
    here, gone_long, gone_lately = (demo_replica(cpu_node, State.READY) for _ in range(3))
    starting = demo_replica(cpu_node, State.STARTING)
    spec = node_agent.channel.replica(starting.id)
    assert node_agent.engine_spec(spec, 8000).compile_cache == str(
        config.compile_cache_dir(starting.endpoint.organization_id))
    for replica in (here, gone_long, gone_lately):
        (config.compile_cache_dir(replica.endpoint.organization_id) / "vllm").mkdir(parents=True)
    eight_days_ago = time.time() - 8 * 86400
    for replica in (here, gone_long):
        folder = config.compile_cache_dir(replica.endpoint.organization_id)
        os.utime(folder, (eight_days_ago, eight_days_ago))

    assert agent.delete_unused_compile_caches(config, kept={
        str(here.endpoint.organization_id), str(starting.endpoint.organization_id)}) == 1

    assert sorted(path.name for path in config.compile_cache_root.iterdir()) == sorted(
        str(replica.endpoint.organization_id) for replica in (here, gone_lately, starting))


def test_old_engine_logs_are_deleted_but_those_of_replicas_on_the_node(tmp_path: Path) -> None:
    config = AgentConfig(engine_log_dir=tmp_path)
    stopped, ready, gone, recent = (str(uuid.uuid4()) for _ in range(4))
    eight_days_ago = time.time() - 8 * 86400
    for name in (stopped, ready, gone, "notes"):
        log = tmp_path / f"{name}.log"
        log.write_text("INFO engine\n")
        os.utime(log, (eight_days_ago, eight_days_ago))
    (tmp_path / f"{recent}.log").write_text("INFO engine\n")

    assert agent.delete_old_logs(config, kept={ready}) == 2

    assert sorted(path.stem for path in tmp_path.iterdir()) == sorted([ready, recent, "notes"])


def test_cpu_engines_are_bound_to_the_cores_the_fewest_running_engines_use(
        node_agent: agent.NodeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    node_agent.config = replace(node_agent.config, cpu_cores_per_engine=2)
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


@pytest.mark.django_db(transaction=True)
def test_the_same_work_read_again_while_its_start_is_on_starts_nothing_more(
        cpu_node: Node, node_agent: agent.NodeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    replica = demo_replica(cpu_node, State.STARTING)
    started: list[str] = []
    on, done = threading.Event(), threading.Event()

    def start_replica(replica_id: str) -> None:
        started.append(replica_id)
        on.set()
        done.wait(10)
    monkeypatch.setattr(node_agent, "start_replica", start_replica)
    work = node_work(node=cpu_node)  # as the node channel's long poll gives it

    node_agent.take_work(work)
    assert on.wait(10)
    node_agent.take_work(work)  # read again, the start still on
    done.set()

    assert wait_until(lambda: not node_agent._busy, 10)
    assert started == [str(replica.id)]


@pytest.mark.django_db(transaction=True)
def test_an_engine_starts_with_a_key_made_here_and_its_replica_s_certificate(
        cpu_node: Node, node_agent: agent.NodeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    replica = demo_replica(cpu_node, State.STARTING)
    seen: dict[str, object] = {}

    def spawn(spec: agent.supervisor.EngineSpec, log: Path) -> subprocess.Popen:
        key, certificate = Path(spec.ssl_keyfile), Path(spec.ssl_certfile)
        seen.update(folder=key.parent, key_mode=key.stat().st_mode & 0o777,
                    key=serialization.load_pem_private_key(key.read_bytes(), password=None),
                    certificate=x509.load_pem_x509_certificate(certificate.read_bytes()))
        raise OSError("no engine in this test")
    monkeypatch.setattr(agent.supervisor, "start", spawn)

    node_agent.start_replica(str(replica.id))

    # In the replica's own directory (its engine's sandbox sees it; deleted when it stops).
    assert seen["folder"] == node_agent.config.kv_dir(str(replica.id))
    assert seen["key_mode"] == 0o600
    names = seen["certificate"].extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert names.value.get_values_for_type(x509.DNSName) == [
        replica_host_name(replica_id=replica.id, node_id=cpu_node.id)]
    assert seen["certificate"].public_key() == seen["key"].public_key()
    assert Replica.objects.get(id=replica.id).tls


@pytest.mark.django_db(transaction=True)
def test_an_engine_the_control_plane_signs_no_certificate_for_is_not_started(
        cpu_node: Node, node_agent: agent.NodeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    replica = demo_replica(cpu_node, State.STARTING)
    spawned: list[object] = []
    monkeypatch.setattr(agent.supervisor, "start", lambda spec, log: spawned.append(spec))
    monkeypatch.setattr(agent.tls, "new_key_and_request", lambda: (b"", "not a request"))

    node_agent.start_replica(str(replica.id))

    assert not spawned
    replica.refresh_from_db()
    assert (replica.state, replica.tls) == (State.FAILED, False)
    assert "the control plane signed no certificate for the engine" in replica.failure_reason
