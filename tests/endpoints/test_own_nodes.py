"""An organisation's own nodes: enrolled by its owners' join tokens, they run its endpoints
alone (first, or only where an endpoint requires them), never another organisation's, and
nobody else's sizing, regions or planner sees them."""

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from rest_framework.test import APIClient

from accounts.models import Organization, Role
from endpoints.models import Endpoint, ModelSpec, Node, Region, ReplicaInterval, State
from endpoints.planning import online_gpu_types, plan
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.reconciler import reconcile_endpoint
from endpoints.scheduling import Placement
from endpoints.selectors import EnginesOnline, engines_online, own_nodes_of, regions_online
from endpoints.services import do_create_endpoint, do_load_catalogs, do_scale_endpoint
from fleet.enrolment import (
    EnrolmentRefused,
    do_create_join_token,
    do_create_own_node_token,
    do_enrol_node,
    do_revoke_node,
)
from fleet.models import JoinToken, NodeCredential
from fleet.reports import do_register_node
from tests.factories import UserFactory, gpu_host
from tests.factories import enrolled_node as node
from tests.helpers import at_once

pytestmark = pytest.mark.django_db

A100 = "NVIDIA A100-SXM4-80GB"


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


def create(org: Organization, *, name: str = "chat", own_nodes_only: bool = False,
           replicas: int = 1, most: int | None = None) -> Endpoint:
    return do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name=name,
        model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"), gpu_count=1,
        own_nodes_only=own_nodes_only, policy=EndpointPolicy(context_length=8192, concurrency=8),
        scaling=EndpointScaling(min_replicas=replicas, max_replicas=most or replicas))


def placed(endpoint: Endpoint) -> list[str]:
    reconcile_endpoint(endpoint_id=endpoint.id)
    return sorted(replica.node.name for replica in endpoint.replicas.filter(
        state=State.STARTING).select_related("node"))


def test_a_join_token_of_an_organisation_makes_its_own_node(org: Organization) -> None:
    own = node("acme-gpu", owner=org)
    shared = node("shared-gpu")

    assert Node.objects.get(id=own.id).organization == org
    assert Node.objects.get(id=shared.id).organization is None
    assert [found.node.name for found in own_nodes_of(organization=org)] == ["acme-gpu"]


def test_an_own_node_never_takes_another_organisation_s_replica(
        org: Organization, other_org: Organization) -> None:
    node("acme-gpu", owner=org)
    theirs = create(other_org)

    assert placed(theirs) == []
    assert theirs.replicas.get().stage.startswith("no node online fits 1 × ")
    mine = create(org)
    assert placed(mine) == ["acme-gpu"]


def test_own_nodes_come_first_and_then_shared_ones(org: Organization) -> None:
    # The shared node is the tighter fit (one GPU): the organisation's own comes first all
    # the same, and once it is full, the shared one takes the next replica.
    node("acme-gpu", owner=org, count=2)
    node("shared-gpu", count=1)
    endpoint = create(org, most=3)
    assert placed(endpoint) == ["acme-gpu"]

    do_scale_endpoint(endpoint=Endpoint.objects.get(id=endpoint.id), actor_role=Role.OWNER,
                      replicas=3)

    assert placed(endpoint) == ["acme-gpu", "acme-gpu", "shared-gpu"]


def test_an_endpoint_that_requires_its_own_nodes_runs_there_alone(org: Organization) -> None:
    node("shared-gpu")
    with pytest.raises(ValidationError) as refused:
        create(org, own_nodes_only=True)
    assert refused.value.message_dict == {"own_nodes_only": [
        "No node is online on its organisation's own nodes now; enrol one "
        "(docs/operations.md, \"Your organisation's own nodes\"), or let it run on shared "
        "nodes too."]}
    assert not Endpoint.objects.exists()

    node("acme-gpu", owner=org, count=1)
    endpoint = create(org, own_nodes_only=True, most=2)
    assert endpoint.own_nodes_only
    assert placed(endpoint) == ["acme-gpu"]
    do_scale_endpoint(endpoint=Endpoint.objects.get(id=endpoint.id), actor_role=Role.OWNER,
                      replicas=2)

    assert placed(endpoint) == ["acme-gpu"]  # the shared node had room: it waits instead
    assert endpoint.replicas.get(state=State.PENDING).stage.startswith(
        "waiting for a node of its own with 1 free")


def test_nobody_else_sizes_for_or_sees_an_organisation_s_own_nodes(
        org: Organization, other_org: Organization, owner_api: APIClient) -> None:
    eu = Region.objects.create(slug="eu-west", name="EU West")
    node("acme-a100", owner=org, device=A100, region=eu)
    node("shared-h100")

    assert set(online_gpu_types(Placement(organization_id=org.id))
               .values_list("slug", flat=True)) == {"a100-80gb", "h100-80gb"}
    assert list(online_gpu_types(Placement(organization_id=other_org.id))
                .values_list("slug", flat=True)) == ["h100-80gb"]
    assert list(regions_online(organization_id=org.id)) == [eu]
    assert list(regions_online(organization_id=other_org.id)) == []
    listed = owner_api.get("/api/v1/regions/").json()["results"]
    assert listed == [{"slug": "eu-west", "name": "EU West", "online_gpu_types": [],
                       "hourly_prices_usd": {}}]
    model = ModelSpec.objects.get(slug="llama-3.1-8b-instruct")
    with pytest.raises(ValidationError) as refused:
        plan(model=model, context_length=8192, concurrency=8, kv_cache_dtype="auto",
             placement=Placement(region=eu, organization_id=other_org.id))
    assert "No node is online in EU West now" in refused.value.message_dict["region"][0]
    # The public planner has no organisation, so no own nodes.
    sized = owner_api.post("/api/v1/sizing/", {"model": "llama-3.1-8b-instruct",
                                          "context_length": 8192, "concurrency": 8,
                                          "own_nodes_only": True}, format="json")
    assert sized.status_code == 400
    assert "No node is online on its organisation's own nodes" in (
        sized.json()["error"]["fields"]["own_nodes_only"][0])


def test_the_api_creates_an_endpoint_on_its_own_nodes(owner_api: APIClient,
                                                      org: Organization) -> None:
    node("acme-gpu", owner=org, device=A100)
    node("shared-h100")
    created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
        "name": "chat", "model": "llama-3.1-8b-instruct", "context_length": 8192,
        "concurrency": 8, "own_nodes_only": True}, format="json")

    assert created.status_code == 201, created.json()
    assert (created.json()["own_nodes_only"], created.json()["gpu_type"]) == (True,
                                                                              "a100-80gb")
    # Priced at the own-node price, which is nothing until an operator sets one.
    assert created.json()["hourly_price_usd"] == "0.0000"
    assert Endpoint.objects.get().own_nodes_only


def test_gpu_time_on_an_own_node_is_marked_so_in_the_ledger(org: Organization) -> None:
    node("acme-gpu", owner=org, count=1)
    node("shared-gpu", count=1)
    endpoint = create(org, replicas=2)
    placed(endpoint)

    assert sorted((interval.replica.node.name, interval.own_node) for interval in
                  ReplicaInterval.objects.select_related("replica__node")) == [
        ("acme-gpu", True), ("shared-gpu", False)]


def test_only_an_owner_makes_a_join_token_for_the_organisation(org: Organization) -> None:
    person = UserFactory()
    with pytest.raises(PermissionDenied):
        do_create_own_node_token(organization=org, actor_role=Role.ADMIN, created_by=person,
                                 node_name="acme-gpu")
    token, secret = do_create_own_node_token(organization=org, actor_role=Role.OWNER,
                                             created_by=person, node_name="acme-gpu")
    assert (token.organization, token.created_by) == (org, person)
    assert secret.startswith("kvj_")


def test_a_join_token_cannot_take_over_a_node_of_another_owner(
        org: Organization, other_org: Organization) -> None:
    node("gpu-1")
    node("theirs", owner=other_org)

    for name, owner in (("gpu-1", org), ("theirs", org), ("theirs", None)):
        with pytest.raises(ValueError, match=f"a node named {name} exists and is not"):
            do_create_join_token(node_name=name, organization=owner)
    # A token made before the name was taken is refused at enrolment, and stays unspent.
    _, early = do_create_join_token(node_name="later", organization=org)
    do_register_node(name="later", resources=gpu_host(1))  # a shared node took the name
    with pytest.raises(EnrolmentRefused, match="a node named later exists and is not Acme's"):
        do_enrol_node(join_token=early, name="later", resources=gpu_host(1),
                      address="127.0.0.1", model_cache_bytes=0)
    assert Node.objects.get(name="later").organization is None


def test_a_node_re_enrolled_by_its_own_organisation_stays_its_own(org: Organization) -> None:
    node("acme-gpu", owner=org)
    again = node("acme-gpu", owner=org, count=4)

    assert (again.organization, len(again.devices)) == (org, 4)
    registered = do_register_node(name="acme-gpu", resources=gpu_host(4))
    assert registered.organization == org  # the agent's own reports never change it


def test_another_owner_s_waiting_token_or_an_operator_s_revocation_keeps_a_name(
        org: Organization, other_org: Organization) -> None:
    do_create_join_token(node_name="box", organization=other_org)
    with pytest.raises(ValueError, match="a join token of another owner waits for a node "
                                         "named box"):
        do_create_join_token(node_name="box", organization=org)
    with pytest.raises(ValueError, match="a join token of another owner waits"):
        do_create_join_token(node_name="box")
    revoked = node("acme-gpu", owner=org)
    do_revoke_node(node_id=revoked.id)
    with pytest.raises(ValueError, match="an operator revoked node acme-gpu; ask one"):
        do_create_own_node_token(organization=org, actor_role=Role.OWNER,
                                 created_by=UserFactory(), node_name="acme-gpu")


def test_a_model_is_admitted_by_what_the_shared_fleet_and_the_organisation_s_nodes_run(
        org: Organization, other_org: Organization) -> None:
    theirs = node("globex-gpu", owner=other_org)
    Node.objects.filter(id=theirs.id).update(
        architectures=["MambaForCausalLM"], vllm_version="9.9", model_cache_bytes=10**13,
        tool_parsers=["hermes", "mamba_json"], reasoning_parsers=["mamba"])
    shared = node("shared-gpu")
    Node.objects.filter(id=shared.id).update(
        architectures=["LlamaForCausalLM"], vllm_version="0.11", model_cache_bytes=10**11,
        tool_parsers=["hermes"], reasoning_parsers=[])

    assert engines_online(organization_id=org.id) == EnginesOnline(
        architectures={"LlamaForCausalLM"}, versions={"0.11"}, largest_cache=10**11,
        tool_parsers={"hermes"}, reasoning_parsers=set())
    assert engines_online(organization_id=other_org.id) == EnginesOnline(
        architectures={"LlamaForCausalLM", "MambaForCausalLM"}, versions={"0.11", "9.9"},
        largest_cache=10**13, tool_parsers={"hermes", "mamba_json"},
        reasoning_parsers={"mamba"})


@pytest.mark.django_db(transaction=True)
def test_two_owners_tokens_for_one_name_enrolled_at_once_make_one_owner_s_node(
        org: Organization, other_org: Organization) -> None:
    do_load_catalogs()
    _, ours = do_create_join_token(node_name="box", organization=org)
    # A token of the other owner for the same name, as two creations racing could leave.
    theirs_row, theirs = do_create_join_token(node_name="box-2", organization=other_org)
    JoinToken.objects.filter(id=theirs_row.id).update(node_name="box")

    def enrol(secret: str) -> str:
        try:
            do_enrol_node(join_token=secret, name="box", resources=gpu_host(1),
                          address="127.0.0.1", model_cache_bytes=0)
        except EnrolmentRefused as refused:
            return str(refused)
        return "enrolled"

    outcomes = at_once(lambda: enrol(ours), lambda: enrol(theirs))

    assert sorted(outcome.split(";")[0] for outcome in outcomes) in (
        ["a node named box exists and is not Globex's", "enrolled"],
        ["a node named box exists and is not Acme's", "enrolled"])
    owner = Node.objects.get(name="box").organization
    assert NodeCredential.objects.filter(node__name="box", revoked_at=None).count() == 1
    assert JoinToken.objects.filter(node_name="box", used_at=None).get().organization != owner


def test_the_api_lists_the_organisation_s_own_nodes_and_their_health(
        owner_api: APIClient, org: Organization, other_org: Organization) -> None:
    eu = Region.objects.create(slug="eu-west", name="EU West")
    node("acme-gpu", owner=org, count=2, region=eu)
    node("globex-gpu", owner=other_org)
    node("shared-gpu")
    endpoint = create(org)
    placed(endpoint)

    listed = owner_api.get(f"/api/v1/organizations/{org.slug}/nodes/")

    assert listed.status_code == 200
    [row] = listed.json()["results"]
    assert {key: row[key] for key in ("name", "state", "draining", "region", "gpu_type",
                                      "gpus", "free_gpus")} == {
        "name": "acme-gpu", "state": "online", "draining": False, "region": "eu-west",
        "gpu_type": "h100-80gb", "gpus": 2, "free_gpus": 1}
    assert row["engines"] == [{"endpoint": "chat", "replica": str(endpoint.replicas.get().id),
                               "state": "starting"}]
    assert owner_api.get(f"/api/v1/organizations/{other_org.slug}/nodes/").status_code == 404
