"""The gateway's memory of keys and routes, on its own event loop in this process."""

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from accounts.models import Organization
from endpoints.models import Endpoint, ModelSpec, Node, Replica, State
from endpoints.selectors import median_start_seconds
from gateway import directory
from gateway.hold import eta_seconds
from tests.factories import demo_endpoint, inference_key, ready_endpoint

pytestmark = pytest.mark.django_db(transaction=True)  # read on Django's own thread


def test_concurrent_misses_read_the_database_once_and_share_what_it_said(
        org: Organization, monkeypatch: pytest.MonkeyPatch) -> None:
    ready_endpoint(org, "chat", [41000])
    _, secret = inference_key(org)
    reads: Counter[str] = Counter()

    def counting(name: str) -> Any:
        read = getattr(directory, name)

        def counted(*args: Any) -> Any:
            reads[name] += 1
            return read(*args)
        return counted

    for name in ("_read_key", "read_endpoints"):
        monkeypatch.setattr(directory, name, counting(name))
    memory = directory.Directory(key_seconds=60, route_seconds=60)

    async def at_once() -> list[Any]:
        # Each request starts before any read has come back, as a burst reaches a gateway
        # whose cache has just expired.
        return await asyncio.gather(*(memory.identity(secret) for _ in range(20)),
                                    *(memory.routes(org.id) for _ in range(20)))

    answers = asyncio.run(at_once())

    assert reads == {"_read_key": 1, "read_endpoints": 1}
    identities, routes = answers[:20], answers[20:]
    assert {identity.organization_id for identity in identities} == {org.id}
    assert all(list(found) == ["chat"] for found in routes)


def test_a_start_that_downloads_its_weights_is_expected_after_the_download_and_a_start(
        org: Organization, cpu_node: Node) -> None:
    endpoint = demo_endpoint(org)
    Endpoint.objects.filter(id=endpoint.id).update(min_replicas=0)  # the ETA a wake is told
    now = timezone.now()
    # Its one earlier start took 100 s, 70 of them downloading: starts take 30 s.
    Replica.objects.create(endpoint=endpoint, node=cpu_node, state=State.STOPPED,
                           created_at=now - timedelta(seconds=1000),
                           ready_at=now - timedelta(seconds=900), download_seconds=70)
    assert median_start_seconds(model_id=endpoint.model_id,
                                gpu_type_id=endpoint.gpu_type_id) == 30
    Replica.objects.create(endpoint=endpoint, node=cpu_node, state=State.DOWNLOADING,
                           download_done_at=now + timedelta(seconds=40))

    [(route, _)] = directory.read_endpoints(org.id)

    assert eta_seconds(route, now=now.timestamp()) == pytest.approx(70, abs=1)


def test_a_start_that_will_download_is_expected_after_that_download_before_it_begins(
        org: Organization, cpu_node: Node) -> None:
    endpoint = demo_endpoint(org)
    Endpoint.objects.filter(id=endpoint.id).update(min_replicas=0)
    ModelSpec.objects.filter(id=endpoint.model_id).update(
        hf_commit="c" * 40, files=[{"path": "model.safetensors", "size": 700_000_000}])
    now = timezone.now()
    # Its earlier start downloaded the 700 MB at 10 MB/s, then took 30 s to start.
    Replica.objects.create(endpoint=endpoint, node=cpu_node, state=State.STOPPED,
                           created_at=now - timedelta(seconds=1000),
                           ready_at=now - timedelta(seconds=900), download_seconds=70)
    Replica.objects.create(endpoint=endpoint, state=State.PENDING, created_at=now)

    [(route, _)] = directory.read_endpoints(org.id)
    assert eta_seconds(route, now=now.timestamp()) == pytest.approx(100, abs=1)

    # Once a node of its kind holds the weights, the start downloads nothing.
    model = ModelSpec.objects.get(id=endpoint.model_id)
    Node.objects.filter(id=cpu_node.id).update(
        model_cache=[{"repo_id": model.hf_repo, "commit": "c" * 40}])
    [(route, _)] = directory.read_endpoints(org.id)
    assert eta_seconds(route, now=now.timestamp()) == pytest.approx(30, abs=1)


def test_an_engine_off_loopback_is_reached_over_tls_or_not_at_all(org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", [8001, 8002, 8003])
    remote = Node.objects.create(name="gpu-far", gpu_type=endpoint.gpu_type, address="10.0.0.9",
                                 cpu_count=8, memory_bytes=2**34)
    on_loopback, in_clear, certified = endpoint.replicas.order_by("port")
    Replica.objects.filter(id__in=[in_clear.id, certified.id]).update(node=remote)
    Replica.objects.filter(id=certified.id).update(tls=True)

    [(route, replicas)] = directory.read_endpoints(org.id)

    reached = {replica.replica_id: replica.address.base_url for replica in replicas}
    assert reached == {str(on_loopback.id): "http://127.0.0.1:8001",
                       str(certified.id): "https://10.0.0.9:8003"}
    [address] = [replica.address for replica in replicas
                 if replica.replica_id == str(certified.id)]
    assert address.host_name == f"{certified.id}.node-{remote.id}.replicas.kvrun.internal"
