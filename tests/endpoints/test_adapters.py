"""LoRA adapters of an endpoint (endpoints.services.adapters) through the REST API: added from
the hub on loopback or uploaded, judged against the endpoint, sent to its ready replicas, and
removed."""

import json
from pathlib import Path
from unittest import mock

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from accounts.models import Organization
from bench.hub_server import Hub
from endpoints.models import Adapter, AdapterFile, Endpoint, EndpointEvent, Node, Replica, State
from engine import demo_model, lora
from fleet.selectors import node_work
from kvrun.common.sealing import unseal
from nodes import weights
from nodes.config import AgentConfig
from tests.factories import demo_endpoint
from tests.nodes.helpers import channel_of

pytestmark = pytest.mark.django_db

TOKEN = "hf_acme_reads_gated_0042"


def adapters_url(org: Organization, endpoint: str = "chat", rest: str = "") -> str:
    return f"/api/v1/organizations/{org.slug}/endpoints/{endpoint}/adapters/{rest}"


def add(client: APIClient, org: Organization, **body: object) -> dict:
    """The answer's fields, or its error's field messages, with its status."""
    multipart = "config" in body or "weights" in body
    response = client.post(adapters_url(org, rest="upload/" if multipart else ""), body,
                           format="multipart" if multipart else "json")
    answer = response.json()
    return {"status": response.status_code, **answer.get("error", {}).get("fields", answer)}


@pytest.fixture
def endpoint(org: Organization, cpu_node: Node) -> Endpoint:
    """The demo model on the CPU with two LoRA slots of rank 8, one replica ready."""
    endpoint = demo_endpoint(org)
    Endpoint.objects.filter(id=endpoint.id).update(lora_adapters=2, lora_max_rank=8)
    Replica.objects.create(endpoint=endpoint, node=cpu_node, state=State.READY, port=41000)
    endpoint.refresh_from_db()
    return endpoint


@pytest.fixture
def sent() -> mock.MagicMock:
    """Wakes of node agents (endpoints.dispatch.wake_node), by node id."""
    with mock.patch("endpoints.dispatch.wake_node") as wake_node:
        yield wake_node


def test_an_adapter_from_the_hub_is_pinned_and_sent_to_ready_replicas(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, hub: Hub, hub_url: str,
        sent: mock.MagicMock, django_capture_on_commit_callbacks: object) -> None:
    with django_capture_on_commit_callbacks(execute=True):  # type: ignore[operator]
        answer = add(owner_api, org, name="legal", hf_repo="kvrun/demo-lora-a")

    assert answer["status"] == 201, answer
    assert answer["model"] == "chat:legal"
    adapter = Adapter.objects.get(endpoint=endpoint, name="legal")
    assert adapter.hf_commit == hub.commit_of("kvrun/demo-lora-a", "main") == answer["hf_commit"]
    assert (adapter.rank, adapter.target_modules, adapter.base_model) == (
        8, sorted(lora.ATTENTION_MODULES), weights.DEMO_SLUG)
    assert {f["path"] for f in adapter.files} == {lora.CONFIG_FILE, lora.WEIGHTS_FILE}
    replica = endpoint.replicas.get()
    # Its node is woken, and reads in its work that the replica is to serve it.
    sent.assert_called_once_with(replica.node_id)
    [work] = node_work(node=replica.node)["replicas"]  # type: ignore[arg-type]
    assert work["adapters"] == [["legal", adapter.folder]]
    assert "adapter legal added from kvrun/demo-lora-a" in endpoint.events.last().message
    listed = owner_api.get(adapters_url(org)).json()["results"]
    assert [(a["name"], a["replicas_serving"]) for a in listed] == [("legal", 0)]
    Replica.objects.filter(id=replica.id).update(adapters=["legal"])
    assert owner_api.get(adapters_url(org, rest="legal/")).json()["replicas_serving"] == 1


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"hf_repo": "kvrun/demo-lora-r16"}, "hf_repo",
     "rank 16, above this endpoint's largest LoRA rank, 8"),
    ({"hf_repo": "kvrun/demo"}, "hf_repo", "is not a LoRA adapter"),
    ({"hf_repo": "kvrun/none"}, "hf_repo", "No repository kvrun/none"),
    ({"hf_repo": "kvrun/demo-lora-a", "hf_revision": "v9"}, "hf_revision", "no branch"),
    ({"name": "-bad", "hf_repo": "kvrun/demo-lora-a"}, "name", "Start the name with a letter"),
])
def test_an_adapter_that_cannot_be_served_is_refused_and_changes_nothing(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, hub: Hub, hub_url: str,
        sent: mock.MagicMock, body: dict, field: str, words: str) -> None:
    events = endpoint.events.count()
    answer = add(owner_api, org, **{"name": "legal", **body})

    assert answer["status"] == 400, answer
    assert words in " ".join(answer[field]), answer
    assert not Adapter.objects.exists()
    assert endpoint.events.count() == events
    sent.assert_not_called()


def test_an_endpoint_without_lora_slots_takes_no_adapter(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, hub: Hub,
        hub_url: str) -> None:
    Endpoint.objects.filter(id=endpoint.id).update(lora_adapters=0)

    answer = add(owner_api, org, name="legal", hf_repo="kvrun/demo-lora-a")

    assert answer["status"] == 400
    assert "serves no LoRA adapters: set how many it holds at once" in answer["name"][0]
    assert not Adapter.objects.exists()


def test_a_name_is_one_adapter_per_endpoint(owner_api: APIClient, org: Organization,
                                            endpoint: Endpoint, hub: Hub, hub_url: str) -> None:
    assert add(owner_api, org, name="legal", hf_repo="kvrun/demo-lora-a")["status"] == 201
    again = add(owner_api, org, name="legal", hf_repo="kvrun/demo-lora-b")

    assert again["status"] == 400
    assert "already has an adapter named 'legal'" in again["name"][0]
    assert Adapter.objects.get().hf_repo == "kvrun/demo-lora-a"


def test_a_gated_adapter_needs_a_granted_token_kept_sealed(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, hub: Hub, hub_url: str,
        tmp_path: Path) -> None:
    hub.publish("kvrun/gated-lora", lora.build_demo_adapter(
        tmp_path / "gated", seed=4, base_model=weights.DEMO_SLUG, shape=demo_model.lora_shape()),
        gated=True, readers=(TOKEN,))

    refused = add(owner_api, org, name="legal", hf_repo="kvrun/gated-lora")
    assert refused["status"] == 400 and "is gated" in refused["hf_token"][0]
    answer = add(owner_api, org, name="legal", hf_repo="kvrun/gated-lora", hf_token=TOKEN)

    assert answer["status"] == 201, answer
    assert "hf_token" not in answer and answer["hf_token_last4"] == TOKEN[-4:]
    assert unseal(Adapter.objects.get().hf_token_sealed) == TOKEN


def upload(folder: Path, **changes: object) -> dict[str, SimpleUploadedFile]:
    config = {**json.loads((folder / lora.CONFIG_FILE).read_text()), **changes}
    return {"config": SimpleUploadedFile(lora.CONFIG_FILE, json.dumps(config).encode()),
            "weights": SimpleUploadedFile(lora.WEIGHTS_FILE,
                                          (folder / lora.WEIGHTS_FILE).read_bytes())}


def test_an_uploaded_adapter_is_kept_for_the_nodes_to_write_out(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, cpu_node: Node,
        tmp_path: Path, settings: object) -> None:
    folder = lora.build_demo_adapter(tmp_path / "up", seed=5, base_model=weights.DEMO_SLUG,
                                     shape=demo_model.lora_shape())
    node = AgentConfig(model_dir=tmp_path / "models")

    answer = add(owner_api, org, name="support", **upload(folder))

    assert answer["status"] == 201, answer
    adapter = Adapter.objects.get()
    assert (adapter.source, adapter.rank, answer["model"]) == ("upload", 8, "chat:support")
    # A node writes it out from the control plane's copy, through its channel.
    channel, replica = channel_of(cpu_node, tmp_path), endpoint.replicas.get()
    [sent_to_node] = channel.adapters(replica.id)
    written = weights.adapter_dir(sent_to_node, replica_id=str(replica.id), channel=channel,
                                  config=node)
    assert (written / lora.WEIGHTS_FILE).read_bytes() == (folder / lora.WEIGHTS_FILE).read_bytes()
    assert written == weights.adapter_dir(sent_to_node, replica_id=str(replica.id),
                                          channel=channel, config=node)  # written once
    # A copy that does not match the digest taken when it was added is never served.
    AdapterFile.objects.filter(path=lora.WEIGHTS_FILE).update(content=b"tampered")
    Adapter.objects.filter(id=adapter.id).update(files=[
        {**f, "sha256": "0" * 64} if f["path"] == lora.WEIGHTS_FILE else f
        for f in adapter.files])
    [tampered] = channel.adapters(replica.id)
    with pytest.raises(Exception, match="does not match the digest"):
        weights.adapter_dir(tampered, replica_id=str(replica.id), channel=channel, config=node)


@pytest.mark.parametrize(("changes", "files", "field", "words"), [
    ({"r": 16}, None, "weights", "rank 16, above this endpoint's largest LoRA rank, 8"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.1-8B"}, None, "weights",
     "trained on meta-llama/Llama-3.1-8B"),
    ({}, {"weights": b"not safetensors"}, "weights", "is not a safetensors file"),
    ({}, {"config": b"{not json"}, "config", "is not JSON"),
])
def test_an_upload_that_cannot_be_served_is_refused(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, tmp_path: Path,
        changes: dict, files: dict | None, field: str, words: str) -> None:
    folder = lora.build_demo_adapter(tmp_path / "up", seed=5, base_model=weights.DEMO_SLUG,
                                     shape=demo_model.lora_shape())
    body = upload(folder, **changes)
    for name, content in (files or {}).items():
        body[name] = SimpleUploadedFile(name, content)

    answer = add(owner_api, org, name="support", **body)

    assert answer["status"] == 400
    assert words in " ".join(answer[field]), answer
    assert not Adapter.objects.exists() and not AdapterFile.objects.exists()


def test_an_upload_over_the_limit_is_refused_unread(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, tmp_path: Path,
        settings: object) -> None:
    settings.KVRUN_ADAPTER_UPLOAD_MIB = 0  # type: ignore[attr-defined]
    folder = lora.build_demo_adapter(tmp_path / "up", seed=5, base_model=weights.DEMO_SLUG,
                                     shape=demo_model.lora_shape())

    answer = add(owner_api, org, name="support", **upload(folder))

    assert answer["status"] == 400
    assert "more than uploads may (0 MiB): publish the adapter on the hub" in answer["config"][0]
    assert not Adapter.objects.exists()


def test_an_upload_takes_both_files(owner_api: APIClient, org: Organization,
                                    endpoint: Endpoint, tmp_path: Path) -> None:
    folder = lora.build_demo_adapter(tmp_path / "up", seed=5, base_model=weights.DEMO_SLUG,
                                     shape=demo_model.lora_shape())
    answer = add(owner_api, org, name="x", config=upload(folder)["config"])
    assert answer["status"] == 400 and answer["weights"] == ["No file was submitted."]
    assert not Adapter.objects.exists()


def test_a_removed_adapter_is_unloaded_and_its_row_goes(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, hub: Hub, hub_url: str,
        sent: mock.MagicMock, django_capture_on_commit_callbacks: object) -> None:
    assert add(owner_api, org, name="legal", hf_repo="kvrun/demo-lora-a")["status"] == 201
    sent.reset_mock()

    with django_capture_on_commit_callbacks(execute=True):  # type: ignore[operator]
        response = owner_api.delete(adapters_url(org, rest="legal/"))

    assert response.status_code == 204
    assert not Adapter.objects.exists()
    sent.assert_called_once_with(endpoint.replicas.get().node_id)
    assert node_work(node=endpoint.replicas.get().node)["replicas"][0]["adapters"] == []
    assert EndpointEvent.objects.filter(endpoint=endpoint,
                                        message="adapter legal removed").exists()
    assert owner_api.delete(adapters_url(org, rest="legal/")).status_code == 404


def test_another_organisation_s_endpoint_has_no_adapters_to_see(
        org: Organization, other_org: Organization, endpoint: Endpoint) -> None:
    stranger = APIClient()
    stranger.force_authenticate(other_org.memberships.get().user)
    assert stranger.get(adapters_url(org)).status_code == 404
    assert stranger.post(adapters_url(org), {"name": "x", "hf_repo": "kvrun/demo-lora-a"},
                         format="json").status_code == 404


def test_lora_slots_are_sized_and_changed_like_the_rest_of_the_kv_policy(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
        "name": "tuned", "model": weights.DEMO_SLUG, "context_length": 2048, "concurrency": 2,
        "gpu_type": "cpu", "lora_adapters": 2, "lora_max_rank": 8}, format="json")
    assert created.status_code == 201, created.content
    slots = lora.device_bytes(demo_model.lora_shape(), adapters=2, max_rank=8)
    assert created.json()["sizing"]["lora_bytes_per_gpu"] == slots
    assert "+ LoRA" in created.json()["sizing"]["explanation"]

    changed = owner_api.patch(f"/api/v1/organizations/{org.slug}/endpoints/tuned/policy/",
                              {"lora_adapters": 4, "lora_max_rank": 16}, format="json")

    assert changed.status_code == 200, changed.content
    endpoint = Endpoint.objects.get(name="tuned")
    assert (endpoint.lora_adapters, endpoint.lora_max_rank, endpoint.policy_version) == (4, 16, 2)
    assert endpoint.sizing["lora_bytes_per_gpu"] == 4 * slots  # twice the slots, twice the rank
    assert "restarts" in changed.json()["rollout"]


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"lora_max_rank": 7}, "lora_max_rank",
     "Choose a rank vLLM takes: 1, 8, 16, 32, 64, 128, 256, 320 or 512."),
    ({"lora_adapters": 4, "lora_host_adapters": 2}, "lora_host_adapters",
     "Keep between 4 (the adapters on the device) and 256"),
    ({"lora_adapters": 33}, "lora_adapters", "less than or equal to 32"),
])
def test_lora_settings_out_of_range_are_refused(owner_api: APIClient, org: Organization,
                                                cpu_node: Node, body: dict, field: str,
                                                words: str) -> None:
    response = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
        "name": "tuned", "model": weights.DEMO_SLUG, "context_length": 2048, "concurrency": 2,
        "gpu_type": "cpu", **body}, format="json")

    assert response.status_code == 400
    assert words in " ".join(response.json()["error"]["fields"][field]), response.json()
    assert not Endpoint.objects.exists()


@pytest.mark.parametrize(("model", "words"), [("deepseek-v3", "latent attention"),
                                           ("mixtral-8x7b-instruct-v0.1", "mixture of experts")])
def test_a_model_whose_lora_layers_are_not_sized_takes_no_slots(
        owner_api: APIClient, org: Organization, cpu_node: Node, model: str, words: str) -> None:
    response = owner_api.post(f"/api/v1/organizations/{org.slug}/sizing/", {
        "model": model, "context_length": 4096, "concurrency": 1, "lora_adapters": 1},
        format="json")
    created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
        "name": "deep", "model": model, "context_length": 4096, "concurrency": 1,
        "lora_adapters": 1}, format="json")

    for refused in (response, created):
        assert refused.status_code == 400
        assert words in refused.json()["error"]["fields"]["lora_adapters"][0]


def test_a_disk_tier_beside_adapters_is_refused_for_keeping_their_kv_apart(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    body = {"model": "llama-3.1-8b-instruct", "context_length": 8192, "concurrency": 4,
            "gpu_type": "h100-80gb", "lora_adapters": 2, "lora_max_rank": 8, "host_tier_gib": 8}
    sized = owner_api.post(f"/api/v1/organizations/{org.slug}/sizing/",
                           {**body, "disk_tier_gib": 100}, format="json")
    created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                             {**body, "name": "tuned", "disk_tier_gib": 100}, format="json")
    for refused in (sized, created):
        assert refused.status_code == 400, refused.content
        assert "keys KV by tokens alone" in refused.json()["error"]["fields"]["disk_tier_gib"][0]
    assert not Endpoint.objects.exists()

    # A host tier alone is vLLM's own offloading, which keys blocks by adapter too.
    assert owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                          {**body, "name": "tuned"}, format="json").status_code == 201
    changed = owner_api.patch(f"/api/v1/organizations/{org.slug}/endpoints/tuned/policy/",
                              {"disk_tier_gib": 100}, format="json")
    assert changed.status_code == 400
    assert "keys KV by tokens alone" in changed.json()["error"]["fields"]["disk_tier_gib"][0]
    assert Endpoint.objects.get(name="tuned").disk_tier_gib == 0


def test_an_upload_of_several_mib_is_taken(owner_api: APIClient, org: Organization,
                                           endpoint: Endpoint, tmp_path: Path) -> None:
    Endpoint.objects.filter(id=endpoint.id).update(lora_max_rank=256)
    folder = lora.build_demo_adapter(tmp_path / "big", seed=6, base_model=weights.DEMO_SLUG,
                                     shape=demo_model.lora_shape(), rank=256)
    assert (folder / lora.WEIGHTS_FILE).stat().st_size > 1024**2  # past Django's own limit

    answer = add(owner_api, org, name="big", **upload(folder))

    assert answer["status"] == 201, answer
    assert Adapter.objects.get().rank == 256


def test_the_same_weights_under_another_config_are_another_folder(endpoint: Endpoint) -> None:
    files = [{"path": lora.WEIGHTS_FILE, "size": 1, "sha256": "a" * 64},
             {"path": lora.CONFIG_FILE, "size": 1, "sha256": "b" * 64}]
    first = Adapter(endpoint=endpoint, name="x", source="upload", files=files)
    other = Adapter(endpoint=endpoint, name="y", source="upload",
                    files=[files[0], {**files[1], "sha256": "c" * 64}])
    assert first.folder != other.folder and first.folder.startswith("uploads/")


def test_an_upload_removed_while_it_is_written_out_leaves_nothing(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, cpu_node: Node,
        tmp_path: Path, settings: object) -> None:
    node = AgentConfig(model_dir=tmp_path / "models")
    folder = lora.build_demo_adapter(tmp_path / "up", seed=5, base_model=weights.DEMO_SLUG,
                                     shape=demo_model.lora_shape())
    assert add(owner_api, org, name="support", **upload(folder))["status"] == 201
    channel, replica = channel_of(cpu_node, tmp_path), endpoint.replicas.get()
    [adapter] = channel.adapters(replica.id)
    AdapterFile.objects.all().delete()  # removed between the agent's read and its write

    with pytest.raises(Exception, match="was removed while it was written out"):
        weights.adapter_dir(adapter, replica_id=str(replica.id), channel=channel, config=node)
    assert not weights.adapter_folder(adapter, config=node).exists()
    assert not list(weights.adapter_folder(adapter, config=node).parent.glob("*.partial"))


def test_a_policy_change_keeps_room_for_the_adapters_served(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, hub: Hub,
        hub_url: str) -> None:
    assert add(owner_api, org, name="legal", hf_repo="kvrun/demo-lora-a")["status"] == 201
    policy = f"/api/v1/organizations/{org.slug}/endpoints/chat/policy/"

    no_slots = owner_api.patch(policy, {"lora_adapters": 0}, format="json")
    lower = owner_api.patch(policy, {"lora_max_rank": 1}, format="json")

    assert no_slots.status_code == 400 and lower.status_code == 400
    assert no_slots.json()["error"]["fields"]["lora_adapters"] == [
        "chat serves the adapters legal: remove them first, or keep at least one LoRA slot."]
    assert lower.json()["error"]["fields"]["lora_max_rank"] == [
        "chat serves legal (rank 8): keep the largest rank at 8 or more, or remove them first."]
    endpoint.refresh_from_db()
    assert (endpoint.lora_adapters, endpoint.lora_max_rank, endpoint.policy_version) == (2, 8, 1)


def test_a_hub_adapter_with_a_broken_config_is_refused(
        owner_api: APIClient, org: Organization, endpoint: Endpoint, hub: Hub, hub_url: str,
        tmp_path: Path) -> None:
    folder = lora.build_demo_adapter(tmp_path / "broken", seed=8, base_model=weights.DEMO_SLUG,
                                     shape=demo_model.lora_shape())
    (folder / lora.CONFIG_FILE).write_text("[1, 2, 3]")
    hub.publish("kvrun/broken-lora", folder)

    answer = add(owner_api, org, name="broken", hf_repo="kvrun/broken-lora")

    assert answer["status"] == 400
    assert answer["hf_repo"] == ["kvrun/broken-lora's adapter_config.json is not a JSON object."]
    assert not Adapter.objects.exists()
