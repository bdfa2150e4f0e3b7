"""The end-to-end suites' node agent: one per session, on this machine's CPU."""

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from endpoints.models import Node
from endpoints.services import do_load_catalogs
from tests.helpers import start_agent, stop, wait_until


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


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
