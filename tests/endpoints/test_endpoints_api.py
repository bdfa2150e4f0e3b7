import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from rest_framework.test import APIClient

from accounts.models import Membership, Organization, Role, Scope, User
from endpoints import services
from endpoints.models import (
    DesiredState,
    Endpoint,
    EndpointEvent,
    GPUType,
    ModelSpec,
    Node,
    Replica,
    State,
)
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.services import do_create_endpoint, do_load_catalogs
from tests.factories import UserFactory, api_key, organization_with_owner
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


def url(org: Organization, rest: str = "") -> str:
    return f"/api/v1/organizations/{org.slug}/endpoints/{rest}"


DEMO = {"name": "demo", "model": "kvrun-demo-tiny", "context_length": 2048, "concurrency": 4}


def test_it_creates_a_sized_endpoint(owner_api: APIClient, org: Organization,
                                     cpu_node: Node) -> None:
    response = owner_api.post(url(org), DEMO, format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["gpu_type"], body["gpu_count"], body["state"]) == ("cpu", 1, "pending")
    assert body["hourly_price_usd"] == "0.1000"
    assert body["sizing"]["kv_bytes_per_token"] == 512
    assert body["sizing"]["kv_needed_bytes_per_gpu"] == 4 * 2048 * 512
    assert "→ 1 × CPU only" in body["sizing"]["explanation"]
    endpoint = Endpoint.objects.get()
    assert endpoint.desired_state == "running"
    assert EndpointEvent.objects.filter(endpoint=endpoint, state=State.PENDING).exists()


def test_without_nodes_it_sizes_against_the_gpu_catalog(owner_api: APIClient,
                                                        org: Organization) -> None:
    body = {"name": "big", "model": "llama-3.1-70b-instruct", "context_length": 32768,
            "concurrency": 4}

    response = owner_api.post(url(org), body, format="json")

    assert response.status_code == 201, response.content
    sizing = response.json()["sizing"]
    assert sizing["gpu_count"] >= 2
    assert sizing["kv_bytes_per_token"] * sizing["gpu_count"] == 327_680
    assert "weights 141 GB + KV 40.0 GiB for 4 × 32k tokens" in sizing["explanation"]


@pytest.mark.parametrize(
    ("change", "field", "phrase"),
    [
        ({"model": "gpt-17"}, "model", "Unknown model"),
        ({"context_length": 4096}, "context_length", "at most 2,048"),
        ({"context_length": 127}, "context_length", "greater than or equal to 128"),
        ({"min_replicas": 0, "max_replicas": 0}, "max_replicas", "Choose between 1"),
        ({"min_replicas": -2}, "min_replicas", "Run at least 0 replicas"),
        ({"min_replicas": 0, "scale_to_zero_after_seconds": 5}, "scale_to_zero_after_seconds",
         "Wait at least 60 s without a request"),
        ({"concurrency": 0}, "concurrency", "greater than or equal to 1"),
        ({"gpu_type": "tpu-v9"}, "gpu_type", "Unknown GPU type"),
        ({"name": "Not A Slug!"}, "name", "letters"),
        # An engine would read it as one of its own flags.
        ({"name": "--trust-remote-code"}, "name", "Start the name with a letter"),
        ({"name": "7b-chat"}, "name", "Start the name with a letter"),
        ({"max_replicas": 32767}, "max_replicas", "less than or equal to 16"),
        ({"min_replicas": 17}, "min_replicas", "less than or equal to 16"),
        ({"colour": "blue"}, "colour", "Unknown field"),
        ({"host_tier_gib": -1}, "host_tier_gib", "greater than or equal to 0"),
        ({"disk_tier_gib": 10**6}, "disk_tier_gib", "less than or equal to 65536"),
        ({"cache_isolation": "nobody"}, "cache_isolation", "not a valid choice"),
        # The CPU node's vLLM build cannot use either tier: refused before anything starts.
        ({"host_tier_gib": 4}, "host_tier_gib",
         "CPU Offloading is currently only supported on CUDA-alike"),
        ({"host_tier_gib": 4, "disk_tier_gib": 20}, "disk_tier_gib",
         "LMCache 0.5.6 runs on CUDA only"),
    ],
)
def test_bad_input_says_what_to_change_and_writes_nothing(
    owner_api: APIClient, org: Organization, cpu_node: Node, change: dict, field: str,
    phrase: str,
) -> None:
    response = owner_api.post(url(org), {**DEMO, **change}, format="json")

    assert response.status_code == 400
    assert phrase in " ".join(response.json()["error"]["fields"][field])
    assert not Endpoint.objects.exists()


def test_a_request_that_fits_no_gpu_says_what_would(owner_api: APIClient,
                                                    org: Organization) -> None:
    body = {"name": "huge", "model": "llama-3.1-8b-instruct", "context_length": 131072,
            "concurrency": 64, "gpu_type": "l4"}

    response = owner_api.post(url(org), body, format="json")

    assert response.status_code == 400
    message = response.json()["error"]["fields"]["gpu_type"][0]
    assert "8 × NVIDIA L4 24 GB has" in message
    assert "which holds 8 at this context" in message
    assert "lower the concurrency to 8" in message
    assert "would hold the weights and the KV cache for 64 × 131,072 tokens, but no" in message
    assert not Endpoint.objects.exists()


def test_a_duplicate_name_is_refused(owner_api: APIClient, org: Organization,
                                     cpu_node: Node) -> None:
    assert owner_api.post(url(org), DEMO, format="json").status_code == 201

    response = owner_api.post(url(org), DEMO, format="json")

    assert response.status_code == 400
    assert "already exists" in response.json()["error"]["fields"]["name"][0]
    assert Endpoint.objects.count() == 1


def test_a_kv_policy_change_says_how_replicas_restart_and_records_it(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    owner_api.post(url(org), {**DEMO, "min_replicas": 2}, format="json")

    response = owner_api.patch(url(org, "demo/policy/"),
                               {"kv_cache_dtype": "fp8", "prefix_caching": False}, format="json")

    assert response.status_code == 200, response.content
    assert "2 replicas restart one at a time" in response.json()["rollout"]
    endpoint = Endpoint.objects.get(name="demo")
    assert (endpoint.kv_cache_dtype, endpoint.prefix_caching, endpoint.policy_version) == (
        "fp8", False, 2)
    assert endpoint.sizing["kv_bytes_per_token"] == response.json()["sizing"][
        "kv_bytes_per_token"]
    assert endpoint.events.filter(message__startswith="policy changed (kv_cache_dtype fp8, "
                                                      "prefix_caching False)").exists()


def test_a_routing_change_restarts_nothing_and_a_lone_replica_is_said_to_restart(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    owner_api.post(url(org), DEMO, format="json")

    routing = owner_api.patch(url(org, "demo/policy/"),
                              {"cache_isolation": "key", "prefix_affinity": False}, format="json")
    engine = owner_api.patch(url(org, "demo/policy/"), {"concurrency": 2}, format="json")

    assert routing.status_code == 200 and "no replica restarts" in routing.json()["rollout"]
    assert engine.status_code == 200 and "Its one replica restarts" in engine.json()["rollout"]
    endpoint = Endpoint.objects.get(name="demo")
    assert (endpoint.cache_isolation, endpoint.prefix_affinity, endpoint.concurrency,
            endpoint.policy_version) == ("key", False, 2, 2)


@pytest.mark.parametrize(("change", "field", "phrase"), [
    ({"host_tier_gib": 8}, "host_tier_gib", "CPU Offloading is currently only supported"),
    ({"context_length": 4096}, "context_length", "at most 2,048"),
    ({"context_length": 1}, "context_length", "greater than or equal to 128"),
    ({"disk_tier_gib": 10, "host_tier_gib": 1}, "disk_tier_gib", "runs on CUDA only"),
    ({"concurrency": 0}, "concurrency", "greater than or equal to 1"),
    ({"colour": "blue"}, "colour", "Unknown field"),
])
def test_a_policy_that_does_not_fit_is_refused_and_changes_nothing(
        owner_api: APIClient, org: Organization, cpu_node: Node, change: dict, field: str,
        phrase: str) -> None:
    owner_api.post(url(org), DEMO, format="json")
    before = Endpoint.objects.values().get(name="demo")
    events = EndpointEvent.objects.count()

    response = owner_api.patch(url(org, "demo/policy/"), change, format="json")

    assert response.status_code == 400
    assert phrase in " ".join(response.json()["error"]["fields"][field])
    assert Endpoint.objects.values().get(name="demo") == before
    assert EndpointEvent.objects.count() == events


def test_scale_stop_start_and_delete(owner_api: APIClient, org: Organization,
                                     cpu_node: Node) -> None:
    owner_api.post(url(org), {**DEMO, "max_replicas": 3}, format="json")

    assert owner_api.post(url(org, "demo/scale/"), {"replicas": 4}, format="json"
                          ).status_code == 400
    assert owner_api.post(url(org, "demo/scale/"), {"replicas": 0}, format="json"
                          ).status_code == 400
    assert owner_api.post(url(org, "demo/scale/"), {"replicas": 3}, format="json"
                          ).json()["desired_replicas"] == 3
    assert owner_api.post(url(org, "demo/stop/")).json()["desired_state"] == "stopped"
    assert owner_api.post(url(org, "demo/start/")).json()["desired_state"] == "running"
    assert owner_api.delete(url(org, "demo/")).status_code == 204
    assert owner_api.get(url(org, "demo/")).status_code == 404
    assert Endpoint.objects.get().deleted_at is not None
    # The name is free again once the endpoint is deleted.
    assert owner_api.post(url(org), DEMO, format="json").status_code == 201


@pytest.mark.parametrize("who", ["member", "inference key"])
def test_members_and_inference_keys_cannot_create_scale_stop_or_delete_endpoints(
    owner_api: APIClient, org: Organization, cpu_node: Node, who: str
) -> None:
    owner_api.post(url(org), DEMO, format="json")
    client = APIClient()
    if who == "member":
        member = UserFactory(email="member@acme.test")
        Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
        client.force_authenticate(member)
        refusal = "Only owners and admins can"
        assert client.get(url(org, "demo/")).status_code == 200  # members read
    else:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key(org, scope=Scope.INFERENCE)[1]}")
        refusal = "inference scope"

    for response in (client.post(url(org), {**DEMO, "name": "another"}, format="json"),
                     client.post(url(org, "demo/scale/"), {"replicas": 1}, format="json"),
                     client.post(url(org, "demo/stop/")),
                     client.delete(url(org, "demo/"))):
        assert response.status_code == 403, response.content
        assert refusal in response.json()["error"]["message"]

    endpoint = Endpoint.objects.get()
    assert (endpoint.name, endpoint.desired_state, endpoint.deleted_at) == (
        "demo", "running", None)


def test_events_list_the_lifecycle(owner_api: APIClient, org: Organization,
                                   cpu_node: Node) -> None:
    owner_api.post(url(org), DEMO, format="json")

    events = owner_api.get(url(org, "demo/events/")).json()["results"]

    assert events[-1]["state"] == "pending" and events[-1]["message"].startswith("created:")
    assert all(event["at"] for event in events)


def test_another_organisation_cannot_see_or_touch_an_endpoint(
    owner_api: APIClient, org: Organization, other_org: Organization, cpu_node: Node
) -> None:
    owner_api.post(url(org), DEMO, format="json")
    outsider = APIClient()
    outsider.force_authenticate(other_org.memberships.get().user)

    assert outsider.get(url(org, "demo/")).status_code == 404
    assert outsider.post(url(org, "demo/stop/")).status_code == 404
    assert outsider.delete(url(org, "demo/")).status_code == 404
    assert outsider.get(url(other_org)).json()["count"] == 0
    assert Endpoint.objects.get().desired_state == "running"


def test_sizing_preview_creates_nothing(owner_api: APIClient, cpu_node: Node) -> None:
    response = owner_api.post("/api/v1/sizing/", {"model": "llama-3.1-8b-instruct",
                                                  "context_length": 8192, "concurrency": 16,
                                                  "gpu_type": "l4"}, format="json")

    assert response.status_code == 200, response.content
    assert response.json()["gpu_type"] == "l4"
    assert response.json()["kv_bytes_per_token"] * response.json()["gpu_count"] >= 131_072
    assert not Endpoint.objects.exists()
    assert not Replica.objects.exists()


def test_the_planner_gives_kv_tokens_tiers_memory_and_price_for_a_policy(
        owner_api: APIClient) -> None:
    body = {"model": "llama-3.1-8b-instruct", "context_length": 8192, "concurrency": 16,
            "gpu_type": "h100-80gb", "gpu_count": 1, "kv_cache_dtype": "fp8",
            "host_tier_gib": 64, "disk_tier_gib": 1000}

    response = owner_api.post("/api/v1/sizing/", body, format="json")

    assert response.status_code == 200, response.content
    plan = response.json()
    # Llama-3.1-8B: 32 layers × 8 KV heads × 128 dims × K and V × 1 byte (fp8).
    assert plan["kv_bytes_per_token"] == 65_536
    assert plan["kv_cache_tokens"] == plan["kv_available_bytes_per_gpu"] // 65_536
    assert plan["host_tier_tokens"] == 64 * 2**30 // 65_536 == 1_048_576
    assert plan["disk_tier_tokens"] == 1000 * 2**30 // 65_536
    assert plan["max_concurrency_at_context"] == plan["kv_available_bytes_per_gpu"] // (
        8192 * 65_536)
    assert plan["weight_bytes_per_gpu"] > 16 * 10**9
    assert plan["hourly_price_usd"] == str(GPUType.objects.get(slug="h100-80gb").hourly_price_usd)
    assert not Endpoint.objects.exists()


def test_a_disk_tier_without_a_host_tier_is_refused_saying_what_to_set(
        owner_api: APIClient) -> None:
    response = owner_api.post("/api/v1/sizing/", {
        "model": "llama-3.1-8b-instruct", "context_length": 8192, "concurrency": 4,
        "gpu_type": "h100-80gb", "disk_tier_gib": 100}, format="json")

    assert response.status_code == 400
    assert "set a host tier of at least 1 GiB" in response.json()["error"]["fields"][
        "host_tier_gib"][0]


def test_an_embedding_model_s_endpoint_takes_no_adapters_nor_kv_tiers(
        org: Organization, cpu_node: Node) -> None:
    with pytest.raises(ValidationError) as refused:
        do_create_endpoint(
            organization=org, actor_role=Role.OWNER, created_by=None, name="embed",
            model=ModelSpec.objects.get(slug="kvrun-demo-embed"),
            policy=EndpointPolicy(context_length=512, concurrency=8, host_tier_gib=1,
                                  lora_adapters=2))

    assert refused.value.message_dict == {
        "host_tier_gib": ["kvrun embeddings demo (tiny, random weights) serves embeddings: it "
                          "reads each input once and keeps no prefixes to tier. Set 0."],
        "lora_adapters": ["kvrun embeddings demo (tiny, random weights) serves embeddings: "
                          "kvrun serves LoRA adapters on models that generate."]}
    assert not Endpoint.objects.exists()


def test_the_service_caps_replicas_per_endpoint_whatever_the_caller(org: Organization,
                                                                    cpu_node: Node) -> None:
    with pytest.raises(ValidationError) as refused:
        do_create_endpoint(
            organization=org, actor_role=Role.OWNER, created_by=None, name="wide",
            model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
            policy=EndpointPolicy(context_length=2048, concurrency=4),
            scaling=EndpointScaling(min_replicas=1, max_replicas=32767))

    assert "Choose between 1 (at least 1, and no fewer than the fewest replicas, min_replicas) " \
           "and 16" in " ".join(
        refused.value.message_dict["max_replicas"])
    assert not Endpoint.objects.exists()


RAISE_IT = "ask an operator to raise the organisation's quota"


def test_an_endpoint_past_the_quota_is_refused_saying_how_to_raise_it(
        owner_api: APIClient, org: Organization, cpu_node: Node, settings: object) -> None:
    settings.KVRUN_ORG_MAX_ENDPOINTS = 1
    assert owner_api.post(url(org), DEMO, format="json").status_code == 201

    response = owner_api.post(url(org), {**DEMO, "name": "second"}, format="json")

    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "may have 1 endpoint(s) and has 1" in message
    assert RAISE_IT in message
    assert list(Endpoint.objects.values_list("name", flat=True)) == ["demo"]


def test_gpus_past_the_quota_are_refused_at_the_endpoints_most_replicas(
        owner_api: APIClient, org: Organization, settings: object) -> None:
    settings.KVRUN_ORG_MAX_GPUS = 5
    big = {"name": "big", "model": "llama-3.1-8b-instruct", "context_length": 8192,
           "concurrency": 8, "gpu_type": "h100-80gb", "gpu_count": 2}
    assert owner_api.post(url(org), big, format="json").status_code == 201

    response = owner_api.post(url(org), {**big, "name": "wider", "max_replicas": 2},
                              format="json")

    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "may hold 5 GPU(s) at their most replicas; they hold 2 and this needs 4 (2 × 2)" \
        in message
    assert RAISE_IT in message
    assert list(Endpoint.objects.values_list("name", flat=True)) == ["big"]


def test_replicas_past_the_quota_are_refused(owner_api: APIClient, org: Organization,
                                             cpu_node: Node, settings: object) -> None:
    settings.KVRUN_ORG_MAX_REPLICAS = 3
    assert owner_api.post(url(org), {**DEMO, "max_replicas": 2}, format="json").status_code == 201

    response = owner_api.post(url(org), {**DEMO, "name": "more", "max_replicas": 2},
                              format="json")

    assert response.status_code == 400
    assert "may have 3 replica(s) at most" in response.json()["error"]["message"]
    assert Endpoint.objects.count() == 1


def test_a_stopped_endpoint_holds_no_replicas_and_cannot_start_past_the_quota(
        owner_api: APIClient, org: Organization, cpu_node: Node, settings: object) -> None:
    settings.KVRUN_ORG_MAX_REPLICAS = 2
    owner_api.post(url(org), {**DEMO, "max_replicas": 2}, format="json")
    assert owner_api.post(url(org, "demo/stop/")).status_code == 200
    assert owner_api.post(url(org), {**DEMO, "name": "other", "max_replicas": 2},
                          format="json").status_code == 201

    response = owner_api.post(url(org, "demo/start/"))

    assert response.status_code == 400
    assert RAISE_IT in response.json()["error"]["message"]
    assert Endpoint.objects.get(name="demo").desired_state == DesiredState.STOPPED


def test_a_person_s_organisations_share_the_default_quotas_and_an_operator_s_own_stands_alone(
        owner_api: APIClient, owner: User, org: Organization, cpu_node: Node,
        settings: object) -> None:
    settings.KVRUN_ORG_MAX_ENDPOINTS = 2
    second = organization_with_owner("Acme two", owner)
    third = organization_with_owner("Acme three", owner)
    assert owner_api.post(url(org), DEMO, format="json").status_code == 201
    assert owner_api.post(url(second), DEMO, format="json").status_code == 201

    refused = owner_api.post(url(third), DEMO, format="json")

    assert refused.status_code == 400
    assert ("Its owners' organisations on the deployment's default quotas (this one and 2 "
            f"more) may have 2 endpoint(s) and have 2; delete one, or {RAISE_IT}.") == \
        refused.json()["error"]["message"]
    assert not Endpoint.objects.filter(organization=third).exists()
    Organization.objects.filter(id=third.id).update(max_endpoints=1)
    assert owner_api.post(url(third), DEMO, format="json").status_code == 201


def test_a_co_owned_organisation_counts_with_each_owner_s_others(
        owner_api: APIClient, owner: User, org: Organization, cpu_node: Node,
        settings: object) -> None:
    settings.KVRUN_ORG_MAX_REPLICAS = 2
    partner = UserFactory()
    theirs = organization_with_owner("Partner's", partner)
    assert owner_api.post(url(org), DEMO, format="json").status_code == 201
    Membership.objects.create(organization=org, user=partner, role=Role.OWNER)
    owner_api.force_authenticate(partner)
    assert owner_api.post(url(theirs), DEMO, format="json").status_code == 201

    refused = owner_api.post(url(org), {**DEMO, "name": "third"}, format="json")

    assert refused.status_code == 400
    assert "may have 2 replica(s) at most, all together; they have 2 and this needs 1" in \
        refused.json()["error"]["message"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("second_in", ["the same organisation", "another of its owner's"])
def test_two_creates_at_once_cannot_both_take_the_last_room(
        org: Organization, cpu_node: Node, settings: object,
        monkeypatch: pytest.MonkeyPatch, second_in: str) -> None:
    """The first create stops right after its quota check, inside its transaction, until the
    second has either finished (nothing held the first one's room) or waits for a lock."""
    settings.KVRUN_ORG_MAX_ENDPOINTS = 1
    second_organization = org if second_in == "the same organisation" else \
        organization_with_owner("Acme two", org.members.get())
    checked, second_done = threading.Event(), threading.Event()
    outcomes: dict[str, str] = {}
    hold_quota = services.hold_quota

    def second_waits_for_a_lock() -> bool:
        with connection.cursor() as cursor:
            # Asked from inside a transaction, which would otherwise see its first snapshot.
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                           "current_database() AND wait_event_type = 'Lock'")
            return cursor.fetchone()[0] > 0

    def hold_then_let_the_second_in(**kwargs: object) -> None:
        hold_quota(**kwargs)
        if threading.current_thread().name == "first":
            checked.set()
            assert wait_until(lambda: second_done.is_set() or second_waits_for_a_lock(),
                              timeout=10, interval=0.05)

    def create(name: str) -> None:
        if name == "second":
            checked.wait(timeout=10)
        try:
            do_create_endpoint(
                organization=org if name == "first" else second_organization,
                actor_role=Role.OWNER, created_by=None, name=name,
                model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
                policy=EndpointPolicy(context_length=2048, concurrency=4))
            outcomes[name] = "created"
        except ValidationError as exc:
            outcomes[name] = " ".join(exc.messages)
        finally:
            if name == "second":
                second_done.set()
            connection.close()

    monkeypatch.setattr(services.deployment, "hold_quota", hold_then_let_the_second_in)
    threads = [threading.Thread(target=create, args=(name,), name=name)
               for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert outcomes["first"] == "created"
    assert RAISE_IT in outcomes["second"], outcomes
    assert list(Endpoint.objects.values_list("name", flat=True)) == ["first"]


def test_a_policy_past_the_endpoint_s_hardware_names_the_largest_fit(org: Organization) -> None:
    do_load_catalogs()
    endpoint = do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name="big",
        model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"),
        gpu_type=GPUType.objects.get(slug="l4"), gpu_count=1,
        policy=EndpointPolicy(context_length=8192, concurrency=2))

    with pytest.raises(ValidationError) as refused:
        services.do_change_endpoint_policy(endpoint=endpoint, actor_role=Role.OWNER,
                                           changes={"context_length": 131072, "concurrency": 64})

    # About the asked count: what one L4 holds, not what eight would.
    message = refused.value.message_dict["gpu_type"][0]
    assert "1 × NVIDIA L4 24 GB has 3.3 GiB left" in message
    assert "which holds 0 at this context. To fit, lower the context length to 416" in message
    endpoint.refresh_from_db()
    assert (endpoint.context_length, endpoint.concurrency, endpoint.policy_version) == (
        8192, 2, 1)
