"""Which replica a request goes to: the fewest in flight, one prefix to one replica until its
load bound, a refused connection retried elsewhere, an endpoint not ready saying why, and
caches kept apart by the salt kvrun chooses.

The gateway's ASGI app driven in this process, in front of scripted stand-in engines
(tests.stub_upstream); the same against a real vLLM engine is in tests/e2e."""

import asyncio
import hashlib
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from accounts.models import APIKey, Organization
from billing.models import UsageRecord
from endpoints.models import Endpoint, State
from engine.processes import free_port
from tests.factories import inference_key, ready_endpoint
from tests.gateway.helpers import (
    InProcessGateway,
    documented_cache_salt,
    nothing_held,
    received,
    stored,
)

# e2e: the stand-in engines are processes of their own.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_client_cannot_choose_its_cache_salt(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, other_org: Organization,
    secret: str, stub_ports: list[int], stubs: list[httpx.Client]
) -> None:
    ready_endpoint(other_org, "chat", stub_ports[:1])
    _, other_secret = inference_key(other_org)
    for key in (secret, secret, other_secret):
        response = gateway.post(key, {"model": "chat", "prompt": "hello", "cache_salt": "theirs"})
        assert response.status_code == 200

    ours, again, theirs = (sent["body"]["cache_salt"] for sent in received(stubs[0]))
    assert ours == again == documented_cache_salt(org.id)  # the same for every request
    assert theirs == documented_cache_salt(other_org.id) != ours
    # Keyed with the pepper: knowing an organisation's id is not enough to compute its salt.
    assert ours not in (hashlib.sha256(str(org.id).encode()).hexdigest()[:32],
                        str(org.id).replace("-", ""))


def test_an_endpoint_that_is_not_ready_says_what_it_is_doing(
    gateway: InProcessGateway, org: Organization, secret: str
) -> None:
    loading = ready_endpoint(org, "warming", [free_port()], state=State.LOADING)
    loading.replicas.update(stage="loading weights", progress_percent=50)
    ready_endpoint(org, "resting", [], state=State.STOPPED)

    starting = gateway.post(secret, {"model": "warming", "prompt": "hello"})
    stopped = gateway.post(secret, {"model": "resting", "prompt": "hello"})

    assert starting.status_code == 503 and starting.headers["retry-after"] == "5"
    assert starting.json()["error"]["message"] == (
        "Endpoint 'warming' is loading (loading weights, 50%); retry in a few seconds.")
    assert stopped.status_code == 503
    assert stopped.json()["error"]["message"] == (
        "Endpoint 'resting' is stopped; start it (Start on its page in the dashboard, or POST "
        f"/api/v1/organizations/{org.slug}/endpoints/resting/start/) and retry.")
    assert gateway.get(secret, "/v1/models").json() == {"object": "list", "data": []}


def test_a_refused_connection_is_retried_on_another_replica(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    dead_port = free_port()
    endpoint = ready_endpoint(org, "sturdy", [dead_port, stub_ports[0]], prefix_affinity=False)
    live = endpoint.replicas.get(port=stub_ports[0])
    dead = endpoint.replicas.get(port=dead_port)

    statuses = [gateway.post(secret, {"model": "sturdy", "prompt": "hello"}).status_code
                for _ in range(4)]

    assert statuses == [200] * 4
    assert len(received(stubs[0])) == 4
    # Tried once, and then last for the next few seconds: no request paid for it again.
    assert gateway.upstreams(org.id)[str(dead.id)].served == 1
    assert stored(4)
    assert set(UsageRecord.objects.values_list("replica_id", flat=True)) == {live.id}


def test_no_replica_accepting_is_a_503_that_says_to_retry(
    gateway: InProcessGateway, org: Organization, secret: str
) -> None:
    ready_endpoint(org, "gone", [free_port(), free_port()])

    response = gateway.post(secret, {"model": "gone", "prompt": "hello"})

    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert stored(1)
    assert (UsageRecord.objects.get().status_code, UsageRecord.objects.get().replica_id) == (
        503, None)
    gateway.stop()
    assert nothing_held(gateway, org)


def test_requests_go_to_the_replica_with_the_fewest_in_flight(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "pair", stub_ports, prefix_affinity=False)

    async def quick_ones_beside_a_long_stream() -> list[int]:
        long = asyncio.ensure_future(gateway.send(secret, {"model": "pair", "prompt": "slow",
                                                           "stream": True}))
        routes = await gateway.app.directory.routes(org.id)
        while not any(upstream.in_flight for upstream in routes["pair"].upstreams):
            await asyncio.sleep(0.01)
        quick = [await gateway.send(secret, {"model": "pair", "prompt": "hello"})
                 for _ in range(3)]
        return [response.status_code for response in [*quick, await long]]

    assert gateway.run(quick_ones_beside_a_long_stream()) == [200] * 4
    # Round-robin would have sent a quick one to the replica busy with the stream.
    prompts = sorted([sent["body"]["prompt"] for sent in received(stub)] for stub in stubs)
    assert prompts == [["hello"] * 3, ["slow"]]


CHAT = "/v1/chat/completions"


def with_system_prompt(system: str, user: str) -> dict:
    return {"model": "pair", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": user}]}


def test_requests_that_share_a_prefix_go_to_one_replica_and_prefixes_spread(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "pair", stub_ports)
    handbook = "You answer questions about the staff handbook. " * 30  # ~1,400 characters

    for question in ("Holidays?", "Sick leave?", "Expenses?", "Parking?", "Pensions?"):
        assert gateway.post(secret, with_system_prompt(handbook, question), CHAT).status_code == 200
    by_replica = [len(received(stub)) for stub in stubs]
    assert sorted(by_replica) == [0, 5]

    for stub in stubs:
        stub.delete("/_requests")
    for tenant in range(16):
        prompt = with_system_prompt(f"Tenant {tenant}'s own assistant. " * 40, "Hello")
        assert gateway.post(secret, prompt, CHAT).status_code == 200
    # Sixteen prefixes on two replicas: all on one would happen once in 32,768 runs.
    assert all(received(stub) for stub in stubs)


def test_a_hot_prefix_spills_to_another_replica_past_its_load_bound(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "pair", stub_ports)
    shared = "One very popular system prompt. " * 40

    async def at_once() -> list[int]:
        # "slow": the stand-in engine takes a second, so all four are in flight together.
        sent = [gateway.send(secret, with_system_prompt(shared, "slow"), CHAT)
                for _ in range(4)]
        return [response.status_code for response in await asyncio.gather(*sent)]

    spills = {"organization": org.slug, "endpoint": "pair"}
    assert gateway.run(at_once()) == [200] * 4
    # Bounded at 1.25 × the average in flight: the second replica takes the third request.
    assert sorted(len(received(stub)) for stub in stubs) == [1, 3]
    assert REGISTRY.get_sample_value("kvrun_gateway_affinity_spills_total", spills) == 1


def test_an_endpoint_may_keep_each_key_s_cache_apart(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "solo", stub_ports[:1], cache_isolation="key")
    first = APIKey.objects.get(organization=org)
    second, second_secret = inference_key(org)

    for key in (secret, second_secret):
        assert gateway.post(key, {"model": "solo", "prompt": "hello"}).status_code == 200

    salts = [sent["body"]["cache_salt"] for sent in received(stubs[0])]
    assert salts == [documented_cache_salt(org.id, key_id=first.id),
                     documented_cache_salt(org.id, key_id=second.id)]
    assert documented_cache_salt(org.id) not in salts


@pytest.fixture
def stalled_port() -> Iterator[int]:
    """A port whose listener accepts nothing more: its accept queue is full, so a further
    connection's handshake is dropped and its connect waits, as with an engine whose host
    is too busy to take it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = [socket.socket() for _ in range(2)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
    yield port
    for held in (*fillers, listener):
        held.close()


def test_a_replica_too_slow_to_accept_is_passed_for_another_and_alone_is_a_503(
    gateway_loop: asyncio.AbstractEventLoop, transactional_db: None,
    settings: Any, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client], stalled_port: int
) -> None:
    settings.KVRUN_GATEWAY_CONNECT_TIMEOUT_SECONDS = 0.5
    gateway = InProcessGateway(gateway_loop)
    try:
        endpoint = ready_endpoint(org, "busy", [stalled_port, stub_ports[0]],
                                  prefix_affinity=False)
        ready_endpoint(org, "swamped", [stalled_port])

        statuses = [gateway.post(secret, {"model": "busy", "prompt": "hello"}).status_code
                    for _ in range(3)]
        slow = gateway.upstreams(org.id)[str(endpoint.replicas.get(port=stalled_port).id)]
        alone = gateway.post(secret, {"model": "swamped", "prompt": "hello"})
    finally:
        gateway.stop()

    assert statuses == [200] * 3
    assert len(received(stubs[0])) == 3
    # Slow, not gone: tried again by the next requests, where a replica that refused the
    # connection is passed over for a few seconds (tried once in three).
    assert slow.served >= 2
    assert alone.status_code == 503 and alone.headers["retry-after"] == "5"
    assert alone.json()["error"]["code"] == "engine_unavailable"
    assert alone.json()["error"]["message"] == (
        "No replica of 'swamped' accepted the connection within 0.5 s: it is overloaded. "
        "Retry in a few seconds.")
    assert stored(4)
    assert sorted(UsageRecord.objects.values_list("status_code", flat=True)) == [200, 200, 200, 503]
