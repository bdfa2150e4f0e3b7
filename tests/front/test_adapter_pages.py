"""An endpoint's LoRA adapters on its page: listed with what serves them and their usage, added
from the hub or by upload, refused with the reason under the field, removed; the wizard's
LoRA settings in the sizing; the playground's choice of adapter."""

from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import time_machine
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from accounts.models import Organization
from bench.hub_server import Hub
from billing.models import TokenHour
from billing.rollup import hour_of
from endpoints.models import Adapter, Endpoint, Replica
from engine import demo_model, lora
from nodes.weights import DEMO_SLUG
from tests.billing.helpers import record
from tests.factories import inference_key, ready_endpoint

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint(org: Organization) -> Endpoint:
    return ready_endpoint(org, "chat", [41001], lora_adapters=2, lora_max_rank=8)


@pytest.fixture(autouse=True)
def no_tasks() -> mock.MagicMock:
    """The replicas here have no agent: none is woken."""
    with mock.patch("endpoints.dispatch.wake_node") as wake_node:
        yield wake_node


def test_the_page_lists_each_adapter_with_its_replicas_and_usage(
        owner_client: Client, member_client: Client, org: Organization,
        endpoint: Endpoint) -> None:
    Adapter.objects.create(endpoint=endpoint, name="legal", source="hub", rank=8,
                           hf_repo="acme/legal-lora", hf_commit="ab" * 20, size_bytes=1,
                           target_modules=["q_proj", "v_proj"])
    Replica.objects.filter(endpoint=endpoint).update(adapters=["legal"])
    TokenHour.objects.create(hour=hour_of(timezone.now()), organization=org, endpoint=endpoint,
                             adapter="legal", requests=3, prompt_tokens=1500,
                             completion_tokens=40, cached_tokens=0,
                             rolled_up_at=timezone.now() - timedelta(minutes=1))

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/").content.decode()
    seen = member_client.get(f"/orgs/{org.slug}/endpoints/chat/").content.decode()

    assert "<code>chat:legal</code>" in page and "<code>chat</code>" in page
    assert "acme/legal-lora @ abababababab" in page and "q_proj, v_proj" in page
    assert "1 of 1 ready replica</td>" in page
    assert "<td>3</td>" in page and "1,500 / 40" in page
    assert "Add an adapter from Hugging Face" in page and "Upload an adapter" in page
    assert "<code>chat:legal</code>" in seen
    assert "Add an adapter" not in seen and "Remove</button>" not in seen  # members read only


def test_an_adapter_added_on_the_page_is_listed(owner_client: Client, org: Organization,
                                                endpoint: Endpoint, hub: Hub,
                                                hub_url: str) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/adapters/",
                                 {"name": "legal", "hf_repo": "kvrun/demo-lora-a"}, follow=True)

    assert response.status_code == 200
    assert "Adapter legal added from kvrun/demo-lora-a, pinned at commit" in (
        response.content.decode())
    assert Adapter.objects.get().hf_commit == hub.commit_of("kvrun/demo-lora-a", "main")


def test_a_refused_adapter_shows_why_under_its_field(owner_client: Client, org: Organization,
                                                     endpoint: Endpoint, hub: Hub,
                                                     hub_url: str) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/adapters/",
                                 {"name": "big", "hf_repo": "kvrun/demo-lora-r16"})

    assert response.status_code == 400
    page = response.content.decode()
    assert 'id="id_hf_repo_error"' in page
    assert "rank 16, above this endpoint&#x27;s largest LoRA rank, 8" in page
    assert "<details class=\"kv-policy\" open id=\"adapter-hub\">" in page
    assert not Adapter.objects.exists()


def test_an_uploaded_adapter_is_listed_and_removed(owner_client: Client, org: Organization,
                                                   endpoint: Endpoint, tmp_path: Path) -> None:
    folder = lora.build_demo_adapter(tmp_path / "up", seed=5, base_model=DEMO_SLUG,
                                     shape=demo_model.lora_shape())
    added = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/adapters/upload/", {
        "name": "support",
        "config": SimpleUploadedFile(lora.CONFIG_FILE, (folder / lora.CONFIG_FILE).read_bytes()),
        "weights": SimpleUploadedFile(lora.WEIGHTS_FILE,
                                      (folder / lora.WEIGHTS_FILE).read_bytes())}, follow=True)
    assert "Adapter support added from the uploaded files" in added.content.decode()
    assert "upload, 0.1 MiB" in added.content.decode()

    removed = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/adapters/support/remove/",
                                follow=True)

    assert "Adapter support removed" in removed.content.decode()
    assert not Adapter.objects.exists()


def test_an_endpoint_without_slots_says_how_to_serve_adapters(
        owner_client: Client, org: Organization, endpoint: Endpoint) -> None:
    Adapter.objects.create(endpoint=endpoint, name="legal", source="hub", rank=8, size_bytes=1,
                           hf_repo="acme/legal-lora", hf_commit="ab" * 20)
    Endpoint.objects.filter(id=endpoint.id).update(lora_adapters=0)

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/").content.decode()

    assert "so the adapters below are not served" in page
    assert "Add an adapter from Hugging Face" not in page


def test_the_wizard_sizes_the_lora_slots_into_the_memory_bar(
        owner_client: Client, org: Organization, cpu_node: object) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/endpoints/new/sizing/", {
        "model": DEMO_SLUG, "context_length": 2048, "concurrency": 2, "kv_cache_dtype": "auto",
        "lora_adapters": 4, "lora_max_rank": 16})

    assert response.status_code == 200
    page = response.content.decode()
    assert "LoRA adapters" in page
    assert "+ LoRA" in page and "4 adapter(s) of rank 16" in page


def test_the_playground_offers_the_adapters_and_refuses_an_unknown_one(
        owner_client: Client, org: Organization, endpoint: Endpoint) -> None:
    Adapter.objects.create(endpoint=endpoint, name="legal", source="hub", rank=8, size_bytes=1,
                           hf_repo="acme/legal-lora", hf_commit="ab" * 20)

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/playground/").content.decode()
    refused = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/playground/chat/",
                                {"messages": [{"role": "user", "content": "hi"}],
                                 "adapter": "nope"}, content_type="application/json")

    assert '<option value="legal">chat:legal (LoRA adapter)</option>' in page
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "Endpoint chat has no adapter 'nope'; pick one from the list.")


def test_the_usage_charts_split_generated_tokens_by_adapter(
        owner_client: Client, org: Organization, endpoint: Endpoint) -> None:
    Adapter.objects.create(endpoint=endpoint, name="legal", source="hub", rank=8, size_bytes=1,
                           hf_repo="acme/legal-lora", hf_commit="ab" * 20)
    key, _ = inference_key(org)
    now = timezone.now().replace(second=30)
    with time_machine.travel(now, tick=False):  # the records' minute is the chart's last
        for adapter, tokens in (("legal", 600), ("legal", 60), ("", 120)):
            record(endpoint, key, now, completion_tokens=tokens, adapter=adapter)
        usage = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/usage/").json()
        page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/").content.decode()

    assert usage["model:chat:legal"][-1] == 11.0 and usage["model:chat"][-1] == 2.0
    assert sum(usage["model:chat:legal"]) == 11.0 and usage["tokens_per_second"][-1] == 13.0
    assert 'data-series="model:chat,model:chat:legal"' in page
