"""Where replicas go. Regions: an endpoint that requires one is sized for what is online
there and has its replicas there alone, through creation, scaling up, the loss of a node and
a wake from zero; the API lists regions and the hardware each has online. Host resources:
KV tiers and CPU engines' KV pools are counted against a node's memory and disk (beside its
model cache), and a tier beyond a replica's share of any node is refused saying the most."""

import pytest
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from accounts.models import Organization, Role
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, NodeState, Region, Replica, State
from endpoints.planning import plan
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.reconciler import reconcile_endpoint
from endpoints.scheduling import Placement, Room, needs_of
from endpoints.services import (
    do_create_endpoint,
    do_load_catalogs,
    do_scale_endpoint,
    do_wake_endpoint,
)
from engine.devices import Device, HostResources
from fleet.reports import do_register_node
from tests.factories import ready_endpoint

pytestmark = pytest.mark.django_db

H100 = Device(index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=81559 * 2**20)
A100 = Device(index=0, name="NVIDIA A100-SXM4-80GB", memory_bytes=81920 * 2**20)


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


def node_in(region: Region | None, name: str, device: Device = H100, count: int = 8) -> Node:
    """A node online in `region` (where its join token put it), with `count` GPUs."""
    node = do_register_node(name=name, resources=HostResources(
        devices=[Device(index=i, name=device.name, memory_bytes=device.memory_bytes)
                 for i in range(count)], cpu_count=64, memory_bytes=2**40))
    Node.objects.filter(id=node.id).update(region=region)
    node.refresh_from_db()
    return node


@pytest.fixture
def eu() -> Region:
    return Region.objects.create(slug="eu-west", name="EU West")


@pytest.fixture
def us() -> Region:
    return Region.objects.create(slug="us-east", name="US East")


def create(org: Organization, region: Region | None, *, replicas: int = 1,
           most: int | None = None) -> Endpoint:
    return do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name="chat",
        model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"), gpu_count=1, region=region,
        policy=EndpointPolicy(context_length=8192, concurrency=8),
        scaling=EndpointScaling(min_replicas=replicas, max_replicas=most or replicas))


def placed(endpoint: Endpoint) -> list[str]:
    reconcile_endpoint(endpoint_id=endpoint.id)
    return sorted(replica.node.name for replica in endpoint.replicas.filter(
        state=State.STARTING).select_related("node"))


def test_an_endpoint_s_replicas_stay_in_its_region_through_create_and_scale_up(
        org: Organization, eu: Region, us: Region) -> None:
    # The US node would win on fit (fewer free GPUs left after it): the region comes first.
    node_in(eu, "eu-1")
    node_in(us, "us-1", count=1)
    endpoint = create(org, eu, most=3)
    assert placed(endpoint) == ["eu-1"]

    do_scale_endpoint(endpoint=Endpoint.objects.get(id=endpoint.id), actor_role=Role.OWNER,
                      replicas=3)

    assert placed(endpoint) == ["eu-1"] * 3


def test_a_lost_node_s_replica_is_replaced_in_its_region_or_waits_for_one(
        org: Organization, eu: Region, us: Region) -> None:
    first = node_in(eu, "eu-1")
    node_in(us, "us-1")
    endpoint = create(org, eu)
    [old] = placed(endpoint)
    Replica.objects.filter(endpoint=endpoint).update(state=State.READY)
    Node.objects.filter(id=first.id).update(state=NodeState.LOST)

    reconcile_endpoint(endpoint_id=endpoint.id)

    waiting = endpoint.replicas.get(state=State.PENDING)
    assert waiting.node is None
    assert waiting.stage.startswith("no node in eu-west online fits 1 × ")
    node_in(eu, "eu-2")
    assert placed(endpoint) == ["eu-2"]


def test_a_wake_from_zero_starts_its_replica_in_its_region(
        org: Organization, eu: Region, us: Region) -> None:
    node_in(us, "us-cpu", count=0)
    node_in(eu, "eu-cpu", count=0)
    # At zero, on the demo model sized for CPU nodes (beside a CPU node of no region).
    endpoint = ready_endpoint(org, "sleepy", [], state=State.IDLE, min_replicas=0,
                              desired_replicas=0, region=eu)

    assert do_wake_endpoint(endpoint_id=endpoint.id)

    assert placed(endpoint) == ["eu-cpu"]


def test_an_endpoint_without_a_region_runs_in_any(org: Organization, eu: Region,
                                                   us: Region) -> None:
    node_in(us, "us-1", count=1)
    endpoint = create(org, None, replicas=2)
    node_in(eu, "eu-1", count=1)

    assert placed(endpoint) == ["eu-1", "us-1"]


def test_sizing_in_a_region_counts_only_what_is_online_there(eu: Region, us: Region) -> None:
    node_in(eu, "eu-1", device=A100)
    node_in(us, "us-1")
    model = ModelSpec.objects.get(slug="llama-3.1-8b-instruct")
    asked = {"model": model, "context_length": 8192, "concurrency": 8, "kv_cache_dtype": "auto"}

    assert plan(**asked, placement=Placement(region=eu)).gpu_type.slug == "a100-80gb"
    assert plan(**asked, placement=Placement(region=us)).gpu_type.slug == "h100-80gb"
    with pytest.raises(ValidationError) as refused:
        plan(**asked, placement=Placement(region=eu),
             gpu_type=GPUType.objects.get(slug="h100-80gb"))
    assert refused.value.message_dict == {"gpu_type": [
        "No NVIDIA H100 80 GB node is online in EU West; there: NVIDIA A100 80 GB."]}
    empty = Region.objects.create(slug="ap-south", name="AP South")
    with pytest.raises(ValidationError) as nothing:
        plan(**asked, placement=Placement(region=empty))
    assert nothing.value.message_dict == {"region": [
        "No node is online in AP South now; choose another region, or none to run in any."]}


def test_the_api_lists_regions_and_creates_an_endpoint_in_one(
        owner_api: APIClient, org: Organization, eu: Region, us: Region) -> None:
    node_in(eu, "eu-1", device=A100)
    node_in(us, "us-1")
    Region.objects.create(slug="ap-south", name="AP South")

    listed = owner_api.get("/api/v1/regions/").json()["results"]
    assert listed == [
        {"slug": "ap-south", "name": "AP South", "online_gpu_types": [], "hourly_prices_usd": {}},
        {"slug": "eu-west", "name": "EU West", "online_gpu_types": ["a100-80gb"],
         "hourly_prices_usd": {}},
        {"slug": "us-east", "name": "US East", "online_gpu_types": ["h100-80gb"],
         "hourly_prices_usd": {}}]
    body = {"name": "chat", "model": "llama-3.1-8b-instruct", "context_length": 8192,
            "concurrency": 8}

    unknown = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                             {**body, "region": "mars-1"}, format="json")
    assert unknown.status_code == 400
    assert unknown.json()["error"]["fields"]["region"] == [
        "Unknown region 'mars-1'; GET /api/v1/regions/ lists them."]
    empty = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                           {**body, "region": "ap-south"}, format="json")
    assert empty.status_code == 400
    assert "No node is online in AP South now" in empty.json()["error"]["fields"]["region"][0]
    assert not Endpoint.objects.exists()

    created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                             {**body, "region": "eu-west"}, format="json")
    assert created.status_code == 201, created.json()
    assert (created.json()["region"], created.json()["gpu_type"]) == ("eu-west", "a100-80gb")
    assert Endpoint.objects.get().region == eu
    sized = owner_api.post("/api/v1/sizing/", {"model": "llama-3.1-8b-instruct",
                                                "context_length": 8192, "concurrency": 8,
                                                "region": "us-east"}, format="json")
    assert sized.json()["gpu_type"] == "h100-80gb"


def test_two_replicas_whose_kv_together_passes_a_node_s_memory_never_share_it(
        org: Organization) -> None:
    # A CPU node of 1 GiB: 768 MiB for its engines' KV; the demo model at 2k × 300 needs
    # 300 MiB of KV pool a replica (512 bytes a token).
    small = node_in(None, "cpu-small", count=0)
    Node.objects.filter(id=small.id).update(memory_bytes=2**30)

    def demo(name: str) -> Endpoint:
        return do_create_endpoint(
            organization=org, actor_role=Role.OWNER, created_by=None, name=name,
            model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
            policy=EndpointPolicy(context_length=2048, concurrency=300))

    first, second, third = demo("first"), demo("second"), demo("third")
    assert first.sizing["cpu_kv_cache_bytes"] == 300 * 2**20

    assert placed(first) == ["cpu-small"]
    assert placed(second) == ["cpu-small"]
    assert placed(third) == []
    assert third.replicas.get().stage == "waiting for a node with 1 free CPU only and KV room"
    assert Replica.objects.filter(node=small).count() == 2


def test_a_tier_beyond_what_any_node_gives_is_refused_with_the_largest_that_fits(
        owner_api: APIClient, org: Organization) -> None:
    node = node_in(None, "gpu-1")
    Node.objects.filter(id=node.id).update(disk_bytes=1100 * 2**30, model_cache_bytes=300 * 2**30)
    node_in(None, "gpu-small", count=1)  # one GPU: it cannot hold a replica on two
    body = {"name": "chat", "model": "llama-3.1-8b-instruct", "context_length": 8192,
            "concurrency": 8, "gpu_type": "h100-80gb", "gpu_count": 2}

    refused = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                             {**body, "host_tier_gib": 4096, "disk_tier_gib": 100}, format="json")

    # 2 of 8 GPUs: a quarter of 768 GiB of host memory and of 800 GiB of disk.
    assert refused.status_code == 400
    assert refused.json()["error"]["fields"] == {"host_tier_gib": [
        "A host tier of 4096 GiB is more than any node gives a replica on 2 × NVIDIA H100 80 GB: "
        "at most 192 GiB, their share of a node's host memory."]}
    sized = owner_api.post("/api/v1/sizing/", {
        key: value for key, value in body.items() if key != "name"} | {
        "host_tier_gib": 16, "disk_tier_gib": 201}, format="json")
    assert sized.status_code == 400
    assert "at most 200 GiB, their share of a node's disk beside its model cache" in (
        sized.json()["error"]["fields"]["disk_tier_gib"][0])
    assert not Endpoint.objects.exists()
    created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                             {**body, "host_tier_gib": 192, "disk_tier_gib": 200}, format="json")
    assert created.status_code == 201, created.json()

    # A change that grows a tier is judged the same way; one that leaves them is not.
    grown = owner_api.patch(f"/api/v1/organizations/{org.slug}/endpoints/chat/policy/",
                            {"host_tier_gib": 256}, format="json")
    assert grown.status_code == 400
    assert "at most 192 GiB" in grown.json()["error"]["fields"]["host_tier_gib"][0]
    Node.objects.filter(id=node.id).update(disk_bytes=0)  # an agent not yet reporting it
    routing = owner_api.patch(f"/api/v1/organizations/{org.slug}/endpoints/chat/policy/",
                              {"prefix_affinity": False}, format="json")
    assert routing.status_code == 200, routing.json()


def test_an_endpoint_sized_before_its_kv_pool_was_exact_counts_a_whole_gib(
        org: Organization) -> None:
    endpoint = ready_endpoint(org, "old", [])
    Endpoint.objects.filter(id=endpoint.id).update(sizing={})

    assert needs_of(Endpoint.objects.get(id=endpoint.id)) == Room(host_bytes=2**30,
                                                                  disk_bytes=0)
