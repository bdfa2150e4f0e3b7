"""Shared by the end-to-end suites: the session's node agent and the reconciler's drive."""

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from endpoints.models import Node
from endpoints.services import do_load_catalogs
from endpoints.tasks import mark_lost_nodes, reconcile
from engine.supervisor import process_alive
from tests.conftest import ENGINE_TIMINGS, ROOT, process_env, stop, wait_until


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


def start_agent(name: str, logs: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", "node_agent", "--name", name],
        cwd=ROOT, env=process_env(KVRUN_NODE_GPUS="none", KVRUN_NODE_HEARTBEAT_SECONDS="1",
                                  KVRUN_ENGINE_LOG_DIR=str(logs), **ENGINE_TIMINGS),
    )


@pytest.fixture(scope="session")
def agent(celery_worker: object, engine_logs: Path) -> Iterator[subprocess.Popen]:
    process = start_agent("e2e-a", engine_logs)
    yield process
    stop(process)


@pytest.fixture
def ready_node(agent: subprocess.Popen) -> Node:
    do_load_catalogs()
    assert wait_until(lambda: Node.objects.filter(name="e2e-a", state="online",
                                                  gpu_type__slug="cpu").exists(), 60)
    return Node.objects.get(name="e2e-a")


def drive(predicate: Callable[[], bool], timeout: float) -> bool:
    """Wait for `predicate`, running the reconciler and the liveness check as beat would."""
    def step() -> bool:
        reconcile.delay()
        mark_lost_nodes.delay()
        return predicate()
    return wait_until(step, timeout, interval=1.0)


def api_servers(name: str) -> list[int]:
    """PIDs of vLLM API servers serving `name` on this machine."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and name.encode() in argv:
            found.append(int(cmdline.parent.name))
    return [pid for pid in found if process_alive(pid)]


