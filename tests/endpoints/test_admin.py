from collections.abc import Callable

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

from accounts.models import Organization, Role
from bench.hub_server import Hub
from endpoints import dispatch
from endpoints.dispatch import pulls_for, request_pull
from endpoints.models import (
    DesiredState,
    Endpoint,
    ModelSpec,
    Node,
    Replica,
    ReplicaInterval,
    State,
)
from endpoints.policies import EndpointPolicy
from endpoints.reconciler import reconcile_endpoint
from endpoints.scheduling import do_place_replica
from endpoints.selectors import model_catalog
from endpoints.services import (
    do_add_model_from_hub,
    do_create_endpoint,
    do_delete_endpoint,
    do_load_catalogs,
    do_restart_endpoint,
)
from engine.devices import Device, HostResources
from fleet.replicas import do_take_model_pull
from fleet.reports import do_record_model_cache, do_register_node
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


@pytest.fixture
def operator(client: Client) -> Client:
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list, str | None]]:
    """The Celery tasks sent, as (name, args, queue), instead of enqueuing them in Redis."""
    from kvrun.celery import app

    calls: list[tuple[str, list, str | None]] = []

    def send_task(name: str, args: list | None = None, kwargs: dict | None = None,
                  **options: object) -> None:
        calls.append((name, list(args or []), options.get("queue")))

    monkeypatch.setattr(app, "send_task", send_task)
    return calls


@pytest.fixture
def woken(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The nodes whose agents were woken to read their work, by id."""
    calls: list[int] = []
    monkeypatch.setattr(dispatch, "wake_node", calls.append)
    return calls


def h100_node(name: str) -> Node:
    devices = [Device(index=i, name=H100, memory_bytes=81559 * 2**20) for i in range(8)]
    return do_register_node(name=name, resources=HostResources(
        devices=devices, cpu_count=64, memory_bytes=2**40))


def endpoint_on(node: Node, org: Organization, name: str = "chat") -> Endpoint:
    """A running endpoint with one replica placed on `node`."""
    endpoint = do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name=name,
        model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"), gpu_type=node.gpu_type,
        gpu_count=2, policy=EndpointPolicy(context_length=8192, concurrency=8))
    reconcile_endpoint(endpoint_id=endpoint.id)
    Replica.objects.filter(endpoint=endpoint).update(state=State.READY, port=8001, pid=4242,
                                                     ready_at=timezone.now())
    return endpoint


def post_action(client: Client, url: str, action: str, *ids: object) -> int:
    return client.post(url, {"action": action,
                             "_selected_action": [str(i) for i in ids]}).status_code


def test_it_sends_anonymous_visitors_to_the_admin_login(client: Client) -> None:
    response = client.get("/admin/endpoints/node/")

    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_it_gives_signed_in_users_who_are_not_staff_no_access(client: Client) -> None:
    node = h100_node("n1")
    client.force_login(UserFactory())

    for url in ["/admin/endpoints/node/", f"/admin/endpoints/node/{node.id}/change/",
                "/admin/endpoints/endpoint/"]:
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")
    response = client.post("/admin/endpoints/node/", {
        "action": "drain", "_selected_action": [str(node.id)]})
    assert response.status_code == 302
    assert not Node.objects.get(id=node.id).draining


def test_it_shows_a_node_with_its_devices_heartbeat_and_engines(operator: Client,
                                                                org: Organization) -> None:
    node = h100_node("gpu-1")
    endpoint_on(node, org, name="chat")

    response = operator.get(f"/admin/endpoints/node/{node.id}/change/")

    assert response.status_code == 200
    page = response.content.decode()
    assert f"0: {H100} (80 GiB)" in page
    assert f"7: {H100} (80 GiB)" in page
    assert "s ago)" in page
    assert "chat" in page and "4242" in page and "8001" in page
    assert "Save" not in page  # the agent owns the row: view only


def test_it_lists_nodes_with_their_engines(operator: Client, org: Organization) -> None:
    endpoint_on(h100_node("gpu-1"), org)
    h100_node("gpu-2")

    response = operator.get("/admin/endpoints/node/", {"q": "gpu-1", "state__exact": "online"})

    assert response.status_code == 200
    assert b"gpu-1" in response.content and b"gpu-2" not in response.content


@pytest.mark.parametrize(("url", "params"), [
    ("/admin/endpoints/node/", {"q": "gpu", "draining__exact": "0"}),
    ("/admin/endpoints/endpoint/", {"q": "acme", "state__exact": "ready"}),
    ("/admin/endpoints/endpoint/",
     {"q": "llama-3.1-8b-instruct", "desired_state__exact": "running"}),
    ("/admin/endpoints/replica/", {"q": "chat", "state__exact": "ready"}),
    ("/admin/endpoints/endpointevent/", {"q": "chat", "state__exact": "pending"}),
    ("/admin/endpoints/gputype/", {"q": "H100", "vendor__exact": "nvidia"}),
    ("/admin/endpoints/modelspec/", {"q": "llama", "attention_kind__exact": "gqa"}),
    ("/admin/endpoints/replicainterval/", {"q": "chat", "phase__exact": "starting"}),
])
def test_every_list_answers_a_search_and_a_filter(operator: Client, org: Organization,
                                                  url: str, params: dict) -> None:
    endpoint_on(h100_node("gpu-1"), org)

    response = operator.get(url, params)

    assert response.status_code == 200  # a filter it rejects redirects to ?e=1


def test_it_lists_gpu_time_intervals_and_never_changes_them(operator: Client,
                                                            org: Organization) -> None:
    endpoint_on(h100_node("gpu-1"), org)
    interval = ReplicaInterval.objects.get()
    url = "/admin/endpoints/replicainterval/"

    listed = operator.get(url, {"q": "chat"})

    assert listed.status_code == 200
    assert b"starting" in listed.content and b"H100" in listed.content
    assert operator.get(f"{url}{interval.id}/change/").status_code == 200  # view only
    assert operator.post(f"{url}{interval.id}/change/", {"phase": "ready"}).status_code == 403
    assert operator.post(f"{url}{interval.id}/delete/", {"post": "yes"}).status_code == 403
    assert ReplicaInterval.objects.get().phase == "starting"


def test_it_searches_endpoints_by_organisation_and_shows_their_gpus(
        operator: Client, org: Organization, other_org: Organization) -> None:
    node = h100_node("gpu-1")
    endpoint_on(node, org, name="acme-chat")
    endpoint_on(node, other_org, name="globex-chat")

    response = operator.get("/admin/endpoints/endpoint/", {"q": "globex"})

    assert response.status_code == 200
    assert b"globex-chat" in response.content and b"acme-chat" not in response.content
    assert f"2 × {node.gpu_type.name}".encode() in response.content


def test_an_endpoint_page_shows_its_replicas_and_cannot_be_changed(operator: Client,
                                                                   org: Organization) -> None:
    endpoint = endpoint_on(h100_node("gpu-1"), org)
    url = f"/admin/endpoints/endpoint/{endpoint.id}/change/"

    page = operator.get(url)
    changed = operator.post(url, {"name": "renamed", "desired_replicas": 5})

    assert page.status_code == 200
    assert b"gpu-1" in page.content and b"4242" in page.content
    assert changed.status_code == 403
    assert Endpoint.objects.get(id=endpoint.id).name == "chat"
    assert operator.get("/admin/endpoints/endpoint/add/").status_code == 403


def test_it_drains_a_node(operator: Client, org: Organization,
                          django_capture_on_commit_callbacks: Callable,
                          sent: list, woken: list) -> None:
    node = h100_node("gpu-1")
    endpoint = endpoint_on(node, org)
    replica = endpoint.replicas.get()

    with django_capture_on_commit_callbacks(execute=True):
        status = post_action(operator, "/admin/endpoints/node/", "drain", node.id)

    assert status == 302
    assert Node.objects.get(id=node.id).draining
    replica.refresh_from_db()
    assert replica.state == State.STOPPING
    assert woken == [node.id]
    assert ("endpoints.reconcile", [str(endpoint.id)], None) in sent
    assert endpoint.events.filter(replica=replica,
                                  message__contains="node gpu-1 is draining").exists()


def test_a_drained_nodes_replica_is_replaced_on_another_node(org: Organization) -> None:
    from endpoints.services import do_drain_node

    first = h100_node("gpu-1")
    endpoint = endpoint_on(first, org)
    second = h100_node("gpu-2")

    assert do_drain_node(node_id=first.id) == 1
    reconcile_endpoint(endpoint_id=endpoint.id)

    fresh = endpoint.replicas.exclude(state=State.STOPPING).get()
    assert (fresh.node, fresh.state) == (second, State.STARTING)


def test_scheduling_skips_a_draining_node(org: Organization) -> None:
    # The draining node is the tightest fit, the one scheduling would pick otherwise.
    draining = h100_node("a-draining")
    endpoint_on(draining, org, name="filler")
    roomy = h100_node("b-roomy")
    Node.objects.filter(id=draining.id).update(draining=True)
    endpoint = endpoint_on(roomy, org, name="chat")
    Replica.objects.filter(endpoint=endpoint).update(state=State.PENDING, node=None,
                                                     device_indices=[])
    replica = endpoint.replicas.get()

    assert do_place_replica(replica_id=replica.id) == roomy

    Node.objects.filter(id=roomy.id).update(draining=True)
    Replica.objects.filter(id=replica.id).update(state=State.PENDING, node=None,
                                                 device_indices=[])
    assert do_place_replica(replica_id=replica.id) is None
    replica.refresh_from_db()
    assert (replica.state, replica.node) == (State.PENDING, None)


def test_a_node_that_registers_again_keeps_draining() -> None:
    node = h100_node("gpu-1")
    Node.objects.filter(id=node.id).update(draining=True)

    h100_node("gpu-1")  # its agent restarted

    assert Node.objects.get(id=node.id).draining


def test_it_undrains_a_node(operator: Client) -> None:
    node = h100_node("gpu-1")
    Node.objects.filter(id=node.id).update(draining=True)

    status = post_action(operator, "/admin/endpoints/node/", "undrain", node.id)

    assert status == 302
    assert not Node.objects.get(id=node.id).draining


def test_it_restarts_an_endpoint_with_fresh_replicas(
        operator: Client, org: Organization, django_capture_on_commit_callbacks: Callable,
        woken: list) -> None:
    endpoint = endpoint_on(h100_node("gpu-1"), org)
    old = endpoint.replicas.get()

    with django_capture_on_commit_callbacks(execute=True):
        status = post_action(operator, "/admin/endpoints/endpoint/", "restart", endpoint.id)

    assert status == 302
    old.refresh_from_db()
    assert old.state == State.STOPPING
    assert woken == [old.node_id]
    assert endpoint.events.filter(message="restarting: replacing 1 replica(s)").exists()

    reconcile_endpoint(endpoint_id=endpoint.id)

    fresh = endpoint.replicas.exclude(id=old.id).get()
    assert fresh.state == State.STARTING
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.RUNNING


def test_a_deleted_endpoint_does_not_restart(org: Organization) -> None:
    endpoint = endpoint_on(h100_node("gpu-1"), org)
    do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)

    with pytest.raises(ValidationError):
        do_restart_endpoint(endpoint=endpoint, actor_role=Role.OWNER)

    assert endpoint.replicas.get().state == State.READY  # the reconciler stops it, not this
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.STOPPED


def test_it_stops_and_starts_endpoints(operator: Client, org: Organization) -> None:
    endpoint = endpoint_on(h100_node("gpu-1"), org)

    stopped = post_action(operator, "/admin/endpoints/endpoint/", "stop", endpoint.id)
    assert stopped == 302
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.STOPPED

    started = post_action(operator, "/admin/endpoints/endpoint/", "start", endpoint.id)
    assert started == 302
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.RUNNING


def test_an_operator_raises_an_organisations_quota(operator: Client, org: Organization,
                                                  settings: object) -> None:
    settings.KVRUN_ORG_MAX_ENDPOINTS = 1
    node = h100_node("gpu-1")
    endpoint_on(node, org, name="one")
    with pytest.raises(ValidationError, match="ask an operator to raise"):
        endpoint_on(node, org, name="two")

    response = operator.post(f"/admin/accounts/organization/{org.id}/change/", {
        "name": org.name, "slug": org.slug, "created_at_0": "2026-01-01",
        "created_at_1": "00:00:00", "max_endpoints": "2",
        "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0"})

    assert response.status_code == 302, response.content
    org.refresh_from_db()
    assert (org.max_endpoints, org.max_gpus, org.memberships.count()) == (2, None, 1)
    assert endpoint_on(node, org, name="two").name == "two"


def test_an_endpoint_past_its_quota_is_not_started_and_the_operator_is_told(
        operator: Client, org: Organization, settings: object) -> None:
    endpoint = endpoint_on(h100_node("gpu-1"), org)
    Endpoint.objects.filter(id=endpoint.id).update(desired_state=DesiredState.STOPPED)
    settings.KVRUN_ORG_MAX_GPUS = 1

    response = operator.post("/admin/endpoints/endpoint/", {
        "action": "start", "_selected_action": [str(endpoint.id)]}, follow=True)

    assert response.status_code == 200
    assert b"may hold 1 GPU(s)" in response.content
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.STOPPED


def test_an_operator_promotes_an_organisation_s_model_and_pre_pulls_it_onto_nodes(
        operator: Client, org: Organization, other_org: Organization, woken: list, hub: Hub,
        hub_url: str) -> None:
    hub.tokens.add("hf_secret_1234")  # a token the hub knows, with no special access
    node = h100_node("n1")
    Node.objects.filter(id=node.id).update(architectures=["LlamaForCausalLM"],
                                           model_cache_bytes=10**12)
    model = do_add_model_from_hub(organization=org, actor_role=Role.OWNER, added_by=None,
                                  repo_id="kvrun/demo", token="hf_secret_1234")
    listing = operator.get("/admin/endpoints/modelspec/?q=kvrun%2Fdemo")
    assert b"Acme" in listing.content
    page = operator.get(f"/admin/endpoints/modelspec/{model.id}/change/")
    assert page.status_code == 200 and b"hf_secret" not in page.content
    assert b"1234" in page.content  # which token it is, by its last four characters

    # Never onto another organisation's own node: its weights and token stay off it.
    theirs, ours = h100_node("globex-1"), h100_node("acme-1")
    Node.objects.filter(id=theirs.id).update(organization=other_org)
    Node.objects.filter(id=ours.id).update(organization=org)
    assert post_action(operator, "/admin/endpoints/modelspec/", "pull_onto_nodes",
                       model.id) == 302
    assert [pulls_for(node_id=each.id) for each in (node, ours, theirs)] == [
        [model.id], [model.id], []]
    assert sorted(woken) == sorted([node.id, ours.id])
    request_pull(model_id=model.id, node=theirs)  # asked by any other path: still refused
    assert do_take_model_pull(node=Node.objects.get(id=theirs.id), model_id=model.id) is None
    assert post_action(operator, "/admin/endpoints/modelspec/", "promote", model.id) == 302
    assert ModelSpec.objects.get(id=model.id).organization is None
    assert model.slug in set(model_catalog().values_list("slug", flat=True))


def test_a_node_s_page_shows_its_model_cache(operator: Client) -> None:
    node = h100_node("n1")
    do_record_model_cache(name="n1", entries=[{
        "repo_id": "acme/llama", "commit": "a" * 40, "bytes": 16_060_000_000,
        "last_used": "2026-12-06T09:00:00+00:00"}])
    Node.objects.filter(id=node.id).update(model_cache_bytes=100 * 10**9)

    page = operator.get(f"/admin/endpoints/node/{node.id}/change/").content.decode()

    assert "acme/llama @ aaaaaaaaaaaa: 16.06 GB, last used 2026-12-06 09:00:00" in page
    assert "16.06 of 100.0 GB used" in page


def test_an_operator_pins_a_catalog_model_to_the_commit_its_hub_id_names_now(
        operator: Client, hub: Hub, hub_url: str) -> None:
    named = ModelSpec.objects.get(slug="llama-3.1-8b-instruct")
    ModelSpec.objects.filter(id=named.id).update(hf_repo="kvrun/demo")
    missing = ModelSpec.objects.get(slug="mistral-7b-instruct-v0.3")
    ModelSpec.objects.filter(id=missing.id).update(hf_repo="kvrun/not-there")

    page = operator.post("/admin/endpoints/modelspec/", {
        "action": "pin", "_selected_action": [str(named.id), str(missing.id)]}, follow=True)

    pinned = ModelSpec.objects.get(id=named.id)
    assert pinned.hf_commit == hub.commit_of("kvrun/demo", "main")
    assert {f["path"] for f in pinned.files} >= {"config.json", "model.safetensors"}
    assert ModelSpec.objects.get(id=missing.id).hf_commit == ""
    assert b"No repository kvrun/not-there on the hub" in page.content
    assert b"1 model(s) pinned" in page.content
