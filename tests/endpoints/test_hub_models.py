"""Adding a model by its Hugging Face id (endpoints.services.hub_models), through the REST API,
against the hub on loopback."""

import json
import shutil
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from accounts.models import Membership, Organization, Role
from bench.hub_server import Hub
from endpoints.models import Endpoint, ModelSpec, Node
from endpoints.services import do_add_model_from_hub
from engine import demo_model
from fleet.selectors import model_spec
from kvrun.common.sealing import unseal
from nodes import weights
from nodes.config import AgentConfig
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

TOKEN = "hf_acme_reads_gated_0042"


def models_url(org: Organization, rest: str = "") -> str:
    return f"/api/v1/organizations/{org.slug}/models/{rest}"


def add(client: APIClient, org: Organization, **body: str) -> dict:
    """The answer's fields, or its error's field messages, with its status."""
    response = client.post(models_url(org), body, format="json")
    answer = response.json()
    return {"status": response.status_code, **answer.get("error", {}).get("fields", answer)}


def test_a_model_added_by_id_is_pinned_sized_and_the_organisation_s_alone(
        owner_api: APIClient, org: Organization, other_org: Organization, cpu_node: Node,
        hub: Hub, hub_url: str) -> None:
    answer = add(owner_api, org, hf_repo="kvrun/demo")

    assert answer["status"] == 201, answer
    model = ModelSpec.objects.get(slug=answer["slug"])
    assert (model.organization, model.hf_repo, model.hf_revision) == (org, "kvrun/demo", "")
    assert model.hf_commit == hub.commit_of("kvrun/demo", "main") == answer["hf_commit"]
    assert (model.parameters, model.layers, model.kv_heads, model.head_dim) == (
        demo_model.parameter_count(), 2, 1, 64)
    assert model.weights_bytes == 2 * demo_model.parameter_count()
    assert (model.licence, model.chat_template, model.trust_remote_code) == (
        "apache-2.0", True, False)
    assert {f["path"] for f in model.files} >= {"config.json", "model.safetensors",
                                                 "tokenizer.json"}
    assert answer["download_bytes"] == sum(f["size"] for f in model.files)
    # Sized before anything runs: one request at its longest context, on the CPU node.
    assert answer["sizing"]["gpu_type"] == "cpu"
    assert answer["sizing"]["kv_bytes_per_token"] == 2 * 2 * 1 * 64 * 2

    assert [m["slug"] for m in owner_api.get(models_url(org)).json()["results"]] == [model.slug]
    assert model.slug not in {m["slug"] for m in owner_api.get("/api/v1/models/").json()[
        "results"]}
    stranger = APIClient()
    stranger.force_authenticate(other_org.memberships.get().user)
    assert stranger.get(models_url(other_org)).json()["results"] == []
    assert stranger.get(models_url(org)).status_code == 404
    endpoint = {"name": "mine", "model": model.slug, "context_length": 2048, "concurrency": 2}
    refused = stranger.post(f"/api/v1/organizations/{other_org.slug}/endpoints/", endpoint,
                            format="json")
    assert refused.status_code == 400
    assert refused.json()["error"]["fields"]["model"][0].startswith(f"Unknown model {model.slug!r}")
    assert owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", endpoint,
                          format="json").status_code == 201
    assert Endpoint.objects.get(name="mine").model == model


def test_a_revision_is_pinned_to_the_commit_it_named_when_added(
        owner_api: APIClient, org: Organization, cpu_node: Node, hub: Hub, hub_url: str,
        tmp_path: Path) -> None:
    folder = shutil.copytree(demo_model.build(tmp_path / "demo"), tmp_path / "v1")
    first = hub.publish("kvrun/moving", folder, tags=("v1",))
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    hub.publish("kvrun/moving", folder)

    pinned = add(owner_api, org, hf_repo="kvrun/moving", hf_revision="v1")
    latest = add(owner_api, org, hf_repo="kvrun/moving")

    assert (pinned["status"], latest["status"]) == (201, 201)
    assert pinned["hf_commit"] == first and latest["hf_commit"] != first
    assert (pinned["hf_revision"], pinned["slug"]) == ("v1", "acme--moving")
    assert latest["slug"] == f"acme--moving-{latest['hf_commit'][:7]}"
    again = add(owner_api, org, hf_repo="kvrun/moving", hf_revision=first)
    assert again["status"] == 400
    assert again["hf_repo"] == [f"kvrun/moving at {first[:12]} is already this organisation's "
                                "model 'acme--moving'."]


def test_a_gated_repository_needs_a_granted_token_which_is_kept_sealed(
        owner_api: APIClient, org: Organization, cpu_node: Node, hub: Hub, hub_url: str,
        tmp_path: Path) -> None:
    hub.publish("kvrun/gated", demo_model.build(tmp_path / "demo"), gated=True,
                readers=(TOKEN,))

    refused = add(owner_api, org, hf_repo="kvrun/gated")
    assert refused["status"] == 400
    assert refused["hf_token"] == ["kvrun/gated is gated: request access on its hub page, then "
                                   "add an access token of an account that has been granted "
                                   "it."]
    assert not ModelSpec.objects.filter(hf_repo="kvrun/gated").exists()

    response = owner_api.post(models_url(org), {"hf_repo": "kvrun/gated", "hf_token": TOKEN},
                              format="json")
    assert response.status_code == 201
    assert TOKEN not in response.content.decode() and response.json()["hf_token"] == "…0042"
    model = ModelSpec.objects.get(hf_repo="kvrun/gated")
    assert TOKEN not in model.hf_token_sealed and unseal(model.hf_token_sealed) == TOKEN
    assert TOKEN not in owner_api.get(models_url(org, f"{model.slug}/")).content.decode()


def test_what_no_engine_online_can_serve_is_refused_with_its_reason(
        owner_api: APIClient, org: Organization, cpu_node: Node, hub: Hub, hub_url: str,
        settings: object, tmp_path: Path) -> None:
    folder = shutil.copytree(demo_model.build(tmp_path / "demo"), tmp_path / "custom")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForX"]}))
    hub.publish("kvrun/unknown-arch", folder)
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForCausalLM": "modeling.Custom"}}))
    (folder / "modeling.py").write_text("class Custom: ...\n")
    hub.publish("kvrun/remote-code", folder)

    arch = add(owner_api, org, hf_repo="kvrun/unknown-arch")
    assert arch["hf_repo"] == ["kvrun/unknown-arch is a MambaForX, which the engines online "
                               "(vLLM 0.32.0) cannot run: pick a model of an architecture vLLM "
                               "supports, or ask an operator for a node whose vLLM runs it."]
    code = add(owner_api, org, hf_repo="kvrun/remote-code")
    assert "needs code from its own repository" in code["hf_repo"][0]
    assert "KVRUN_REMOTE_CODE_REPOS" in code["hf_repo"][0]
    assert not ModelSpec.objects.filter(organization=org).exists()

    # Allowed by name: its default branch only, never another revision (anyone can open a
    # pull request on a hub repository); allowed by commit: that commit.
    (folder / "modeling.py").write_text("class Custom: ...  # a stranger's pull request\n")
    proposed = hub.publish("kvrun/remote-code", folder, branch="refs-pr-1")
    settings.KVRUN_REMOTE_CODE_REPOS = ["kvrun/remote-code"]  # type: ignore[attr-defined]
    pull_request = add(owner_api, org, hf_repo="kvrun/remote-code", hf_revision="refs-pr-1")
    assert "needs code from its own repository" in pull_request["hf_repo"][0]
    allowed = add(owner_api, org, hf_repo="kvrun/remote-code")
    assert allowed["status"] == 201 and allowed["trust_remote_code"] is True
    settings.KVRUN_REMOTE_CODE_REPOS = [  # type: ignore[attr-defined]
        f"kvrun/remote-code@{proposed}"]
    assert add(owner_api, org, hf_repo="kvrun/remote-code",
               hf_revision="refs-pr-1")["status"] == 201
    assert "modeling.py" in {f["path"] for f in ModelSpec.objects.get(
        slug=allowed["slug"]).files}

    Node.objects.update(model_cache_bytes=1000)
    small = add(owner_api, org, hf_repo="kvrun/demo")
    assert small["hf_repo"][0].startswith("kvrun/demo's weights take 0.0 GB, more than any "
                                          "node's model cache holds")
    Node.objects.update(state="lost")
    assert add(owner_api, org, hf_repo="kvrun/demo")["hf_repo"][0].startswith(
        "No node online says which architectures its engines run")


def test_only_managers_add_models_and_bad_input_changes_nothing(
        api: APIClient, org: Organization, cpu_node: Node, hub_url: str) -> None:
    member = UserFactory(email="member@acme.test")
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    api.force_authenticate(member)

    assert api.post(models_url(org), {"hf_repo": "kvrun/demo"}, format="json").status_code == 403
    api.force_authenticate(org.memberships.get(role=Role.OWNER).user)
    assert add(api, org, hf_repo="")["hf_repo"] == ["This field may not be blank."]
    assert add(api, org, hf_repo="kvrun/demo", extra="x")["status"] == 400
    assert add(api, org, hf_repo="no such/repo")["hf_repo"][0].startswith(
        "'no such/repo' is not a hub id")
    assert add(api, org, hf_repo="kvrun/demo", hf_token="hf_é")["hf_token"] == [
        "An access token is letters, digits and punctuation without spaces (hf_…); paste it "
        "again from the hub's settings."]
    assert not ModelSpec.objects.filter(organization=org).exists()


def test_a_model_added_by_id_gets_its_family_s_parsers_or_those_its_owner_names(
        owner_api: APIClient, org: Organization, cpu_node: Node, hub: Hub, hub_url: str,
        tmp_path: Path) -> None:
    # The demo is a Llama whose tokenizer has Llama 3's tool-call marker.
    assert add(owner_api, org, hf_repo="kvrun/demo")["tool_call_parser"] == "llama3_json"
    hub.publish("kvrun/demo-b", demo_model.build(tmp_path / "b"))
    chosen = add(owner_api, org, hf_repo="kvrun/demo-b", tool_call_parser="llama3_json",
                 reasoning_parser="")
    assert (chosen["tool_call_parser"], chosen["reasoning_parser"]) == ("llama3_json", "")
    hub.publish("kvrun/demo-c", demo_model.build(tmp_path / "c"))
    assert add(owner_api, org, hf_repo="kvrun/demo-c", tool_call_parser="")[
        "tool_call_parser"] == ""

    # Parsers that would keep its engines from starting are refused, and nothing is saved:
    # one that no node online offers, and one whose markers its tokenizer lacks.
    hub.publish("kvrun/demo-d", demo_model.build(tmp_path / "d"))
    refused = add(owner_api, org, hf_repo="kvrun/demo-d", tool_call_parser="pythonic")
    assert refused["tool_call_parser"] == [
        "No engine online offers the tool-call parser 'pythonic'; those they offer: hermes, "
        "llama3_json. Leave it out to take the model family's, or send \"\" for none."]
    unfit = add(owner_api, org, hf_repo="kvrun/demo-d", reasoning_parser="qwen3")
    assert unfit["reasoning_parser"] == [
        "kvrun/demo-d's tokenizer has no <think>, </think>, which the reasoning parser "
        "'qwen3' reads: its engines would not start. Pick the parser its model card names, "
        "or send \"\" for none."]
    assert not ModelSpec.objects.filter(hf_repo="kvrun/demo-d").exists()
    # A node whose vLLM offers none (an older agent): the family's parser is not taken.
    Node.objects.update(tool_parsers=[])
    hub.publish("kvrun/demo-e", demo_model.build(tmp_path / "e"))
    assert add(owner_api, org, hf_repo="kvrun/demo-e")["tool_call_parser"] == ""


def test_a_model_added_by_id_serves_what_its_config_says_or_embeds_when_asked(
        owner_api: APIClient, org: Organization, cpu_node: Node, hub: Hub, hub_url: str,
        tmp_path: Path) -> None:
    hub.publish("kvrun/reranker", demo_model.build(tmp_path / "r",
                                                   demo_model.BUILT_IN["kvrun-demo-rerank"]))
    reranker = add(owner_api, org, hf_repo="kvrun/reranker")
    # A generative checkpoint trained to embed says so only when it is added.
    embedder = add(owner_api, org, hf_repo="kvrun/demo", task="embed")

    assert (reranker["status"], reranker["task"], reranker["tool_call_parser"]) == (
        201, "score", "")
    assert (embedder["status"], embedder["task"], embedder["tool_call_parser"]) == (
        201, "embed", "")
    assert embedder["sizing"]["explanation"].startswith("weights ")
    assert "for a batch of" in embedder["sizing"]["explanation"]

    # What its architecture cannot serve, and parsers for a model that generates nothing,
    # are refused, and nothing is saved.
    hub.publish("kvrun/demo-f", demo_model.build(tmp_path / "f"))
    scoring = add(owner_api, org, hf_repo="kvrun/demo-f", task="score")
    assert scoring["task"] == [
        "kvrun/demo-f is a LlamaForCausalLM, a generative model: only a reranker (a "
        "classifier of one label) scores. Leave the task out to take what its config says "
        "(chat and completions)."]
    parsed = add(owner_api, org, hf_repo="kvrun/demo-f", task="embed",
                 tool_call_parser="llama3_json")
    assert parsed["tool_call_parser"] == [
        "Parsers read generated text; an embedding model or a reranker generates none. "
        "Leave them out."]
    unknown = add(owner_api, org, hf_repo="kvrun/demo-f", task="classify")
    assert unknown["status"] == 400 and "task" in unknown
    assert not ModelSpec.objects.filter(hf_repo="kvrun/demo-f").exists()
    # A classifier of several labels serves nothing kvrun offers; a reranker does not embed.
    labelled = demo_model.build(tmp_path / "g", demo_model.BUILT_IN["kvrun-demo-rerank"])
    config = json.loads((labelled / "config.json").read_text())
    config.update(num_labels=3, id2label={"0": "a", "1": "b", "2": "c"})
    (labelled / "config.json").write_text(json.dumps(config))
    hub.publish("kvrun/classifier", labelled)
    assert add(owner_api, org, hf_repo="kvrun/classifier")["hf_repo"] == [
        "kvrun/classifier is a LlamaForSequenceClassification of several labels: kvrun serves "
        "generative models, embedding models and rerankers (classifiers of one label)."]
    assert add(owner_api, org, hf_repo="kvrun/reranker", task="embed")["task"][0].startswith(
        "kvrun/reranker is a LlamaForSequenceClassification, a reranker")


def test_an_organisation_sizes_its_own_model_and_nobody_else_can(
        owner_api: APIClient, org: Organization, other_org: Organization, cpu_node: Node,
        hub_url: str) -> None:
    slug = add(owner_api, org, hf_repo="kvrun/demo")["slug"]
    asked = {"model": slug, "context_length": 2048, "concurrency": 4}

    own = owner_api.post(f"/api/v1/organizations/{org.slug}/sizing/", asked, format="json")
    public = owner_api.post("/api/v1/sizing/", asked, format="json")
    stranger = APIClient()
    stranger.force_authenticate(other_org.memberships.get().user)
    theirs = stranger.post(f"/api/v1/organizations/{other_org.slug}/sizing/", asked,
                           format="json")

    assert own.status_code == 200 and own.json()["kv_cache_tokens"] == 4 * 2048
    for refused in (public, theirs):
        assert refused.status_code == 400
        assert refused.json()["error"]["fields"]["model"][0].startswith(
            f"Unknown model {slug!r}")


def test_an_organisation_s_model_never_loads_from_a_folder_named_like_it(
        org: Organization, cpu_node: Node, hub_url: str, settings: object,
        tmp_path: Path) -> None:
    model = do_add_model_from_hub(organization=org, actor_role="owner", added_by=None,
                                  repo_id="kvrun/demo")
    (tmp_path / model.slug).mkdir()  # an operator's folder, or one named to look like it

    as_sent = model_spec(model=model)  # as the node channel sends it to a node

    node = AgentConfig(model_dir=tmp_path)
    assert weights.local_weights(as_sent, config=node) is None
    assert weights.weights_dir(as_sent, config=node) == weights.model_cache(node).snapshot(
        model.hf_repo, model.hf_commit)
