"""The node agent reading its engines' /metrics, against engines that answer badly: an engine
runs weights its tenant chose, so what it answers is bounded."""

import asyncio
import gzip
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from accounts.models import Role
from endpoints.models import ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy
from endpoints.services import do_create_endpoint
from engine.metrics import EngineSnapshot
from engine.tls import EngineAddress
from nodes import agent
from telemetry.models import EngineSample
from tests.factories import organization_with_owner

METRICS = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"

Answer = Callable[[BaseHTTPRequestHandler], None]


@pytest.fixture
def engine() -> Iterator[Callable[[Answer], int]]:
    """Start a stand-in engine answering /metrics with `answer`; its port."""
    servers = []

    def start(answer: Answer) -> int:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    answer(self)
                except OSError:
                    pass  # the agent hung up first, as it should

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def headers(handler: BaseHTTPRequestHandler, **extra: str) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain")
    for name, value in extra.items():
        handler.send_header(name.replace("_", "-"), value)
    handler.end_headers()


def endless(handler: BaseHTTPRequestHandler) -> None:
    headers(handler)
    while True:
        handler.wfile.write(b"vllm:num_requests_running 1\n" * 1024)


def dripping(handler: BaseHTTPRequestHandler) -> None:
    headers(handler)
    while True:  # a line at a time, each well within the read timeout
        handler.wfile.write(b"# still here\n")
        handler.wfile.flush()
        time.sleep(agent.SCRAPE_TIMEOUT_SECONDS / 4)


def dripping_headers(handler: BaseHTTPRequestHandler) -> None:
    handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
    while True:  # a header that never ends, a byte at a time
        handler.wfile.write(b"X")
        handler.wfile.flush()
        time.sleep(agent.SCRAPE_TIMEOUT_SECONDS / 4)


def compressed(handler: BaseHTTPRequestHandler) -> None:
    body = gzip.compress(METRICS)
    headers(handler, Content_Encoding="gzip", Content_Length=str(len(body)))
    handler.wfile.write(body)


def plain(handler: BaseHTTPRequestHandler) -> None:
    headers(handler, Content_Length=str(len(METRICS)))
    handler.wfile.write(METRICS)


def read(port: int) -> EngineSnapshot | None:
    """What the agent reads of the /metrics of an engine of its on `port`."""
    engine = EngineAddress(host="127.0.0.1", port=port, api_key="key")
    return asyncio.run(agent._read_all([("an-engine", engine)]))[0][0]


def test_an_engine_s_metrics_are_read(engine: Callable[[Answer], int]) -> None:
    snapshot = read(engine(plain))

    assert snapshot is not None and snapshot.running == 1


@pytest.mark.parametrize("answer", [endless, dripping, dripping_headers, compressed])
def test_an_engine_s_endless_slow_or_compressed_metrics_are_dropped(
        engine: Callable[[Answer], int], answer: Answer) -> None:
    assert read(engine(answer)) is None


def ready_replica(node_agent: agent.NodeAgent, node: Node, port: int) -> Replica:
    """A ready replica on `node` whose engine, of `node_agent`'s, listens on `port`."""
    endpoint = do_create_endpoint(
        organization=organization_with_owner(f"Tenant {port}"), actor_role=Role.OWNER,
        created_by=None, name="chat", model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        policy=EndpointPolicy(context_length=2048, concurrency=4))
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=State.READY, port=port)
    node_agent.listening[str(replica.id)] = EngineAddress(host="127.0.0.1", port=port,
                                                          api_key="key")
    return replica


@pytest.mark.django_db
def test_engines_are_read_at_once_so_that_a_slow_one_delays_no_other(
        cpu_node: Node, node_agent: agent.NodeAgent, engine: Callable[[Answer], int]) -> None:
    # Each answers only once the other has been asked: read one after the other, the first
    # waits past its timeout for a question that comes only after it is dropped.
    asked = {"first": threading.Event(), "second": threading.Event()}

    def waiting_for(mine: str, other: str) -> Answer:
        def answer(handler: BaseHTTPRequestHandler) -> None:
            asked[mine].set()
            asked[other].wait(agent.SCRAPE_TIMEOUT_SECONDS * 5)
            plain(handler)
        return answer

    first = ready_replica(node_agent, cpu_node, engine(waiting_for("first", "second")))
    second = ready_replica(node_agent, cpu_node, engine(waiting_for("second", "first")))

    assert node_agent.scrape() == 2
    assert set(EngineSample.objects.values_list("replica_id", flat=True)) == {
        first.id, second.id}
