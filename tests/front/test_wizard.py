"""The create-endpoint wizard: live sizing, advice that fits the cause, launching."""

import pytest
from django.test import Client

from accounts.models import Organization
from endpoints.models import Endpoint, EndpointEvent, ModelSpec, Node

pytestmark = pytest.mark.django_db

DEMO = {"model": "kvrun-demo-tiny", "context_length": "2048", "concurrency": "8",
        "kv_cache_dtype": "auto", "prefix_caching": "on", "gpu_type": ""}


def sizing(client: Client, org: Organization, **change: str) -> bytes:
    response = client.post(f"/orgs/{org.slug}/endpoints/new/sizing/", {**DEMO, **change})
    assert response.status_code == 200
    return response.content.decode()


def test_the_wizard_lists_the_catalog_and_what_runs_online(owner_client: Client,
                                                           org: Organization,
                                                           cpu_node: Node) -> None:
    response = owner_client.get(f"/orgs/{org.slug}/endpoints/new/?model=kvrun-demo-tiny")

    assert response.status_code == 200
    runs = {m["spec"].slug for m in response.context["models"] if m["runs_online"]}
    assert "kvrun-demo-tiny" in runs
    assert "llama-3.1-8b-instruct" not in runs  # 16 GB of weights, 8 GiB per CPU engine
    assert "llama-3.2-3b-instruct" not in runs  # its weights leave KV room for ~150 tokens
    assert b'value="kvrun-demo-tiny" checked' in response.content
    assert b"1 \xc3\x97 CPU" in response.content  # sizing for the chosen model, on load


def test_live_sizing_shows_hardware_memory_capacity_and_price(owner_client: Client,
                                                              org: Organization,
                                                              cpu_node: Node) -> None:
    panel = sizing(owner_client, org)

    assert "$0.10/hour · $2.40/day" in panel
    # K and V × 2 layers × 1 KV head × 64 dims × 2 bytes
    assert "KV cache per token</dt><dd>512 B" in panel
    # What the engine's 8 GiB could hold, beside the budget the KV cache is sized to.
    assert "The hardware could hold, at 2k</dt><dd>6,143 concurrent requests</dd>" in panel
    assert "With fp8 KV cache" in panel
    assert 'class="part weights"' in panel and 'class="part kv-cache"' in panel


def test_a_model_too_big_for_anything_online_says_what_would_hold_it(owner_client: Client,
                                                                      org: Organization,
                                                                      cpu_node: Node) -> None:
    panel = sizing(owner_client, org, model="llama-3.1-8b-instruct", context_length="8192")

    assert "weights need 16 GB" in panel
    assert ("2 × NVIDIA L4 24 GB ($1.60/h) would hold the weights and the KV cache for "
            "8 × 8,192 tokens") in panel
    assert "the hardware online (CPU only: 8.0 GiB per engine)" in panel
    assert "no NVIDIA L4 24 GB node is online" in panel
    assert "node_agent" in panel
    assert "Models that fit what is online: kvrun demo" in panel
    assert 'data-pick-model="kvrun-demo-tiny"' in panel
    # The old advice, which no knob could follow, is gone.
    assert "Lower the context length or the concurrency" not in panel


def test_a_kv_cache_that_does_not_fit_names_the_largest_that_does(owner_client: Client,
                                                                   org: Organization,
                                                                   cpu_node: Node) -> None:
    panel = sizing(owner_client, org, model="llama-3.1-8b-instruct", context_length="131072",
                   concurrency="64", gpu_type="l4")

    assert "The KV cache does not fit" in panel
    assert "8 × NVIDIA L4 24 GB has" in panel
    assert "lower the concurrency to 8" in panel
    assert "lower the context length to" in panel
    assert "use fp8 KV cache (16 requests at this context)" in panel


def test_weights_that_leave_almost_no_kv_room_say_so(owner_client: Client, org: Organization,
                                                      cpu_node: Node) -> None:
    panel = sizing(owner_client, org, model="llama-3.2-3b-instruct", context_length="4096")

    assert "which holds 0 at this context" in panel
    assert "too little to serve this model here" in panel
    assert "1 × NVIDIA L4 24 GB ($0.80/h) would hold the weights" in panel


def test_launching_creates_the_endpoint_and_opens_its_page(owner_client: Client,
                                                           org: Organization,
                                                           cpu_node: Node) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/endpoints/new/",
                                 {**DEMO, "name": "chat", "min_replicas": "1"})

    assert response.status_code == 302
    assert response["Location"] == f"/orgs/{org.slug}/endpoints/chat/"
    endpoint = Endpoint.objects.get()
    assert (endpoint.name, endpoint.gpu_type.slug, endpoint.context_length) == ("chat", "cpu",
                                                                                2048)
    assert EndpointEvent.objects.filter(endpoint=endpoint, state="pending").exists()


def test_an_endpoint_launched_with_no_fewest_replicas_scales_to_zero_when_idle(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    sizing = owner_client.post(f"/orgs/{org.slug}/endpoints/new/sizing/", DEMO)
    short = owner_client.post(f"/orgs/{org.slug}/endpoints/new/", {
        **DEMO, "name": "Not A Name", "min_replicas": "0", "scale_to_zero_after_seconds": "5"})
    launched = owner_client.post(f"/orgs/{org.slug}/endpoints/new/", {
        **DEMO, "name": "chat", "min_replicas": "0", "scale_to_zero_after_seconds": "600"})

    assert b"idle 50 % of the time, about <strong>$" in sizing.content
    assert short.status_code == 400 and b"Wait at least 60 s without a request" in short.content
    assert b'id="id_name_error"' in short.content  # with the other fields' errors, at once
    assert launched.status_code == 302
    endpoint = Endpoint.objects.get()
    assert (endpoint.min_replicas, endpoint.max_replicas, endpoint.desired_replicas,
            endpoint.scale_to_zero_after_seconds) == (0, 1, 1, 600)


def test_errors_show_next_to_their_fields_and_nothing_is_created(owner_client: Client,
                                                                 org: Organization,
                                                                 cpu_node: Node) -> None:
    missing = owner_client.post(f"/orgs/{org.slug}/endpoints/new/",
                                {**DEMO, "name": "Not a slug!", "min_replicas": "1"})
    too_big = owner_client.post(f"/orgs/{org.slug}/endpoints/new/", {
        **DEMO, "model": "llama-3.1-8b-instruct", "name": "big", "min_replicas": "1"})

    assert missing.status_code == 400
    assert b'id="id_name_error"' in missing.content
    assert too_big.status_code == 400
    assert b'id="id_model_error"' in too_big.content
    assert b"weights need 16 GB" in too_big.content
    assert not Endpoint.objects.exists()


def test_alternatives_are_other_hardware_never_the_same_gpu_at_a_higher_count(
        owner_client: Client, org: Organization) -> None:
    from endpoints.services import do_load_catalogs

    do_load_catalogs()  # no node online: sized against the GPU catalog
    response = owner_client.post(f"/orgs/{org.slug}/endpoints/new/sizing/", {
        **DEMO, "model": "qwen2.5-7b-instruct", "context_length": "32768", "concurrency": "16"})

    plan = response.context["plan"]
    alternatives = response.context["alternatives"]
    assert alternatives
    assert all(alt["gpu_type"] != plan.gpu_type.slug for alt in alternatives)
    chosen_price = plan.gpu_type.hourly_price_usd * plan.gpu_count
    for alt in alternatives:
        cheaper = float(alt["hourly_price_usd"]) < chosen_price
        more = alt["max_concurrency_at_context"] > response.context["summary"][
            "max_concurrency_at_context"]
        assert cheaper or more


def test_a_launch_past_the_quota_says_so_above_the_form(owner_client: Client, org: Organization,
                                                        cpu_node: Node, settings: object) -> None:
    settings.KVRUN_ORG_MAX_ENDPOINTS = 0

    response = owner_client.post(f"/orgs/{org.slug}/endpoints/new/",
                                 {**DEMO, "name": "chat", "min_replicas": "1"})

    assert response.status_code == 400
    assert b"may have 0 endpoint(s) and has 0" in response.content
    assert b"ask an operator to raise the organisation" in response.content
    assert not Endpoint.objects.exists()


def test_a_name_that_does_not_start_with_a_letter_is_refused(owner_client: Client,
                                                             org: Organization,
                                                             cpu_node: Node) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/endpoints/new/",
                                 {**DEMO, "name": "--trust-remote-code", "min_replicas": "1"})

    assert response.status_code == 400
    assert b'id="id_name_error"' in response.content
    assert b"Start the name with a letter" in response.content
    assert not Endpoint.objects.exists()


def test_a_pasted_hugging_face_id_is_added_sized_and_chosen(owner_client: Client,
                                                            org: Organization,
                                                            other_org: Organization,
                                                            cpu_node: Node,
                                                            hub_url: str) -> None:
    added = owner_client.post(f"/orgs/{org.slug}/endpoints/new/model/",
                              {"hf_repo": "kvrun/demo", "hf_revision": "", "hf_token": ""})

    model = ModelSpec.objects.get(organization=org)
    assert added.status_code == 302
    assert added["Location"] == f"/orgs/{org.slug}/endpoints/new/?model={model.slug}"
    page = owner_client.get(added["Location"])
    assert f'value="{model.slug}" checked'.encode() in page.content
    assert b"your organisation&#x27;s" in page.content or b"your organisation's" in page.content
    assert f"Added kvrun/demo, pinned at commit {model.hf_commit[:12]}".encode() in page.content
    assert b"1 \xc3\x97 CPU" in page.content  # sized on arrival, nothing launched
    assert not Endpoint.objects.exists()
    launched = owner_client.post(f"/orgs/{org.slug}/endpoints/new/", {
        **DEMO, "model": model.slug, "name": "mine", "min_replicas": "1"})
    assert launched.status_code == 302 and Endpoint.objects.get().model == model
    # Nobody else sees it, in the wizard or when launching.
    stranger = Client()
    stranger.force_login(other_org.memberships.get().user)
    theirs = stranger.get(f"/orgs/{other_org.slug}/endpoints/new/")
    assert model.slug not in {m["spec"].slug for m in theirs.context["models"]}
    refused = stranger.post(f"/orgs/{other_org.slug}/endpoints/new/", {
        **DEMO, "model": model.slug, "name": "theirs", "min_replicas": "1"})
    assert refused.status_code == 400 and Endpoint.objects.count() == 1


def test_a_hugging_face_id_kvrun_cannot_serve_is_refused_beside_its_field(
        owner_client: Client, org: Organization, cpu_node: Node, hub_url: str) -> None:
    response = owner_client.post(f"/orgs/{org.slug}/endpoints/new/model/",
                                 {"hf_repo": "kvrun/nothing-here", "hf_token": ""})

    assert response.status_code == 400
    assert b"No repository kvrun/nothing-here on the hub, or it is private" in response.content
    assert b'id="hub-model" open' in response.content
    assert not ModelSpec.objects.filter(organization=org).exists()
