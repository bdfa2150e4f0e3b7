import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
from django.conf import settings
from django.core.cache import cache
from django.db import OperationalError
from django.db.backends.postgresql.operations import DatabaseOperations
from rest_framework.test import APIClient

from accounts.models import Organization, User
from bench.hub_server import Hub
from billing import usage_stream as stream
from billing.ingestion import INGEST_LOCK
from endpoints.models import Endpoint, Node
from endpoints.services import do_load_catalogs
from engine import demo_model, lora
from engine.build import EngineBuild
from engine.devices import HostResources
from engine.processes import dying_with_parent, free_port
from fleet.reports import do_register_node
from kvrun.celery import app as celery_app
from nodes.weights import DEMO_SLUG
from tests.factories import (
    UserFactory,
    api_key,
    inference_key,
    organization_with_owner,
    ready_endpoint,
)
from tests.helpers import (
    ENGINE_TIMINGS,
    NODE_LOST_AFTER_SECONDS,
    PATIENT_CONNECT_SECONDS,
    ROOT,
    WEB_METRICS_TOKEN,
    SuiteAgent,
    start_web,
    start_worker,
    stop,
    wait_until,
)

# pgserver logs at INFO from an atexit hook, after pytest has closed the stream its handler
# writes to: each run ended with a "Logging error" traceback.
logging.getLogger("pgserver").setLevel(logging.WARNING)

# The fixtures that start a real process (a worker, a web process, a node agent and its
# engines, a browser). A test that uses one, however indirectly, carries the mark, so that
# `make check`, which leaves those marks out, never starts one whatever the test's author wrote.
PROCESS_FIXTURES = {"celery_worker": "e2e", "web": "e2e", "stub_ports": "e2e", "agent": "e2e",
                    "browser": "browser"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in PROCESS_FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(PROCESS_FIXTURES[fixture])


@pytest.fixture(scope="session")
def django_db_setup(request: pytest.FixtureRequest, django_test_environment: None,
                    django_db_blocker: object) -> Iterator[None]:
    """The test database, always created: pytest-django would create it only when a collected
    test is marked for the database, and processes started for the suite (worker, node
    agents, web) must never be pointed at the development database instead."""
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        config = setup_databases(verbosity=request.config.option.verbose, interactive=False,
                                 aliases={"default"}, serialized_aliases=set())
    yield
    with django_db_blocker.unblock():
        # Backends of processes that have just exited may not have gone yet: end them, and
        # wait until they are gone, or dropping the database finds them still there.
        with connection.cursor() as cursor:
            for _ in range(50):
                cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                               "WHERE datname = current_database() AND pid <> pg_backend_pid()")
                if cursor.fetchone()[0] == 0:
                    break
                time.sleep(0.1)
        # Closed here, not left to teardown_databases: a session of ours still open on the test
        # database makes its DROP fail ("being accessed by other users"), seen when the
        # session's last test used no database.
        connection.close()
        teardown_databases(config, verbosity=request.config.option.verbose)


@pytest.fixture(scope="session", autouse=True)
def _flush_retried_on_deadlock() -> Iterator[None]:
    """The worker and node agents keep using the test database between tests, so the TRUNCATE
    that ends a transactional test can deadlock with one of their statements; PostgreSQL then
    aborts one side. When the flush is the one aborted, it is simply run again."""
    flush = DatabaseOperations.execute_sql_flush

    def execute_sql_flush(self: DatabaseOperations, sql_list: list[str]) -> None:
        for attempt in range(5):
            try:
                return flush(self, sql_list)
            except OperationalError as exc:
                if not isinstance(exc.__cause__, psycopg.errors.DeadlockDetected) or attempt == 4:
                    raise
                time.sleep(0.2)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DatabaseOperations, "execute_sql_flush", execute_sql_flush)
        yield


@pytest.fixture(autouse=True)
def _clear_django_cache() -> None:
    """Each test starts with an empty Django cache: the key cache, and the throttles and
    counters keyed on the client's address, which every test shares (127.0.0.1).

    Nothing else: the gateway's and the usage stream's keys belong to processes that may be
    running still from an earlier test, and they are keyed by ids no other test has, but
    for the usage stream, which the tests that read it empty first (`usage_stream`)."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = list(client.scan_iter(match=cache.make_key("*"), count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(autouse=True)
def _no_task_of_an_earlier_test(request: pytest.FixtureRequest) -> None:
    """A test with the worker never inherits the tasks an earlier one left queued: the
    worker would run them during this test, against rows that are gone, or reconcile this
    test's endpoints at a moment it did not choose. (One the worker is running goes on.)"""
    if "celery_worker" in request.fixturenames:
        celery_app.control.purge()


@pytest.fixture
def usage_stream() -> None:
    """An empty usage stream, with no dead letters, admitted traces or ingestion lock."""
    redis.Redis.from_url(settings.REDIS_URL).delete(
        stream.STREAM, stream.DEAD_LETTERS, stream.ADMITTED, stream.ADMITTED_SEEN, INGEST_LOCK)


@pytest.fixture
def api() -> APIClient:
    return APIClient()


@pytest.fixture
def owner(db: None) -> User:
    return UserFactory(email="owner@acme.test")


@pytest.fixture
def org(owner: User) -> Organization:
    return organization_with_owner("Acme", owner)


@pytest.fixture
def other_org(db: None) -> Organization:
    return organization_with_owner("Globex", UserFactory(email="owner@globex.test"))


@pytest.fixture
def owner_api(api: APIClient, owner: User) -> APIClient:
    api.force_authenticate(owner)
    return api


# What a node's vLLM build reports, cut to the architectures and parsers the tests use.
TEST_BUILD = EngineBuild(version="0.32.0", architectures=("LlamaForCausalLM", "Qwen2ForCausalLM",
                                                        "LlamaForSequenceClassification"),
                         tool_parsers=("hermes", "llama3_json"),
                         reasoning_parsers=("deepseek_r1", "qwen3"))


@pytest.fixture
def cpu_node(db: None) -> Node:
    """What `make run` has on a machine without a GPU: the catalog and one CPU node online."""
    do_load_catalogs()
    return do_register_node(name="cpu-1", resources=HostResources(
        devices=[], cpu_count=2, memory_bytes=24 * 2**30), build=TEST_BUILD,
        model_cache_bytes=100 * 2**30)


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """A hub on loopback (bench/hub_server.py) holding the demo model as kvrun/demo, and
    LoRA adapters of it: kvrun/demo-lora-a and -b (rank 8, apart by their seeds) and
    kvrun/demo-lora-r16 (rank 16)."""
    server = Hub(tmp_path_factory.mktemp("hub")).start()
    server.publish("kvrun/demo", demo_model.build(tmp_path_factory.mktemp("demo") / "demo"),
                   licence="apache-2.0")
    for name, seed, rank in (("a", 1, 8), ("b", 2, 8), ("r16", 3, 16)):
        server.publish(f"kvrun/demo-lora-{name}", lora.build_demo_adapter(
            tmp_path_factory.mktemp(f"lora-{name}"), seed=seed, base_model=DEMO_SLUG,
            shape=demo_model.lora_shape(), rank=rank))
    yield server
    server.stop()


@pytest.fixture
def hub_url(hub: Hub, settings: object) -> str:
    """kvrun reads models from the loopback hub."""
    settings.KVRUN_HUB_URL = hub.url  # type: ignore[attr-defined]
    return hub.url


@pytest.fixture
def manage_secret(org: Organization) -> str:
    return api_key(org)[1]


@pytest.fixture(scope="session")
def celery_worker(django_db_setup: None, django_db_blocker: object) -> Iterator[subprocess.Popen]:
    """A real Celery worker on the control queue, against the test database and Redis."""
    celery_app.control.purge()  # tasks queued by earlier tests, which ran with no worker
    process = start_worker("control", KVRUN_NODE_LOST_AFTER_SECONDS=str(NODE_LOST_AFTER_SECONDS),
                           **ENGINE_TIMINGS)
    yield process
    stop(process)


@pytest.fixture(scope="session")
def web_mail(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared web process writes the mail it sends, a file each."""
    return tmp_path_factory.mktemp("web-mail")


@pytest.fixture(scope="session")
def web(celery_worker: subprocess.Popen, hub: Hub, web_mail: Path) -> Iterator[str]:
    """The base URL of a web process shared by the gateway tests, with the control worker
    that ingests its usage records."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # The dashboard's snippets and its playground reach the gateway at this address. Its
    # guard against floods of unknown keys counts per client address, and every test is
    # 127.0.0.1: so that no test inherits the failures of those before it, the guard is
    # out of reach here and tested on a gateway of its own (tests/gateway/test_auth.py).
    # Its node channel tells the suite's node agents to beat every second.
    process = start_web(port, KVRUN_BASE_URL=base, KVRUN_METRICS_TOKEN=WEB_METRICS_TOKEN,
                        KVRUN_NODE_HEARTBEAT_SECONDS="1",
                        KVRUN_GATEWAY_FAILED_AUTHENTICATIONS_PER_MINUTE=str(10**9),
                        KVRUN_HUB_URL=hub.url,
                        KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS=PATIENT_CONNECT_SECONDS,
                        EMAIL_BACKEND="django.core.mail.backends.filebased.EmailBackend",
                        EMAIL_FILE_PATH=str(web_mail))
    yield base
    stop(process)


@pytest.fixture(scope="session")
def stub_ports() -> Iterator[list[int]]:
    """Two scripted stand-ins for engines (tests.stub_upstream), by port."""
    from kvrun.launcher import uvicorn_args, wait_until_listening

    ports = [free_port(), free_port()]
    processes = [subprocess.Popen([sys.executable, *uvicorn_args("tests.stub_upstream:app",
                                                                 port=port)], cwd=ROOT,
                                  preexec_fn=dying_with_parent)
                 for port in ports]
    for process, port in zip(processes, ports, strict=True):
        wait_until_listening(process, port)
    yield ports
    for process in processes:
        stop(process)


@pytest.fixture
def stubs(stub_ports: list[int]) -> Iterator[list[httpx.Client]]:
    """Clients of the stand-in engines, with what they were sent forgotten."""
    clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}") for port in stub_ports]
    for client in clients:
        client.delete("/_requests")
    yield clients
    for client in clients:
        client.close()


@pytest.fixture
def stub_endpoint(org: Organization, stub_ports: list[int]) -> Endpoint:
    """A ready endpoint "chat" whose one replica is the first stand-in engine."""
    return ready_endpoint(org, "chat", stub_ports[:1])


@pytest.fixture
def secret(org: Organization) -> str:
    return inference_key(org)[1]


@pytest.fixture
def ingested(celery_worker: subprocess.Popen) -> Callable[..., bool]:
    """ingested(n): run the real ingestion task on the worker until n usage records are
    stored; False if they are not there in time."""
    from billing.models import UsageRecord
    from billing.tasks import ingest_usage

    def until(count: int, timeout: float = 30) -> bool:
        def enough() -> bool:
            ingest_usage.delay()
            return UsageRecord.objects.count() >= count
        return wait_until(enough, timeout, interval=0.5)
    return until


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def agent(celery_worker: object, web: str, engine_logs: Path,
          hub: Hub) -> Iterator[SuiteAgent]:
    suite_agent = SuiteAgent("e2e-a", engine_logs, web=web, KVRUN_HUB_URL=hub.url)
    yield suite_agent
    suite_agent.stop()


@pytest.fixture
def ready_node(agent: SuiteAgent) -> Node:
    agent.enrolled()
    do_load_catalogs()
    # Online, and with its vLLM build read (what adding a model by id is judged by).
    assert wait_until(lambda: Node.objects.filter(name="e2e-a", state="online",
                                                  gpu_type__slug="cpu").exclude(
        architectures=[]).exists(), 120)
    return Node.objects.get(name="e2e-a")
