"""A node agent reads and moves its own replicas through the channel: what starting one
needs, the steps of its start and stop, failures, progress, samples, and the secrets and
files it needs only while it fetches them. Another node's replica is a 404 everywhere."""

from datetime import timedelta

import pytest
from django.utils import timezone

from bench.hub_server import Hub
from endpoints.models import Adapter, AdapterFile, AdapterSource, ModelSpec, Node, Replica, State
from engine import tls
from kvrun.common.digests import engine_api_key
from kvrun.common.sealing import seal
from telemetry.models import EngineSample
from tests.fleet.helpers import as_node, enrolled, placed_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def replica(credential: str) -> Replica:
    """A replica of gpu-1 that its agent is to start."""
    replica = placed_replica(Node.objects.get(name="gpu-1"))
    Replica.objects.filter(id=replica.id).update(state=State.STARTING, port=None)
    replica.refresh_from_db()
    return replica


def url(replica: Replica, step: str = "") -> str:
    return f"/node/v1/replicas/{replica.id}" + (f"/{step}" if step else "")


def test_the_start_spec_carries_what_the_engine_needs_and_its_key(credential: str,
                                                                   replica: Replica) -> None:
    response = as_node(credential).get(url(replica))

    assert response.status_code == 200
    spec = response.json()
    assert spec["engine_key"] == engine_api_key(replica_id=replica.id, node_id=replica.node_id)
    assert (spec["state"], spec["device_indices"]) == ("starting", [0, 1])
    endpoint = replica.endpoint
    assert spec["endpoint"] == {
        "id": str(endpoint.id), "organization": str(endpoint.organization_id), "name": "chat",
        "device": "gpu", "gpu_count": 2, "context_length": 8192, "concurrency": 8,
        "kv_cache_dtype": "auto", "prefix_caching": True, "host_tier_gib": 0,
        "disk_tier_gib": 0, "cpu_kv_cache_bytes": 2**30, "lora_adapters": 0,
        "lora_max_rank": endpoint.lora_max_rank, "lora_host_adapters": 0}
    assert spec["model"]["slug"] == "llama-3.1-8b-instruct" and spec["model"]["catalog"]
    listed = as_node(credential).get("/node/v1/replicas").json()["replicas"]
    assert [(item["id"], item["state"]) for item in listed] == [(str(replica.id), "starting")]


def test_an_agent_walks_its_replica_through_start_and_stop(credential: str,
                                                           replica: Replica) -> None:
    agent = as_node(credential)

    def move(from_states: list[str], to_state: str, **fields: object) -> bool:
        response = agent.post(url(replica, "move"), {
            "from_states": from_states, "to_state": to_state, "message": f"to {to_state}",
            **fields}, format="json")
        assert response.status_code == 200, response.json()
        return response.json()["moved"]

    assert move(["starting"], "loading", port=8123, policy_version=1,
                tool_call_parser="llama3_json", reasoning_parser="")
    # What its engine was started with: the gateway goes by it.
    assert Replica.objects.filter(id=replica.id, tool_call_parser="llama3_json",
                                  reasoning_parser="").exists()
    assert agent.post(url(replica, "pid"), {"pid": 4321}, format="json").status_code == 204
    progress = agent.post(url(replica, "progress"), {
        "state": "loading", "stage": "loading weights", "percent": 50}, format="json")
    assert progress.json() == {"current": True}
    # Gateways reach engines over TLS only: an engine without its certificate is not ready.
    untrusted = agent.post(url(replica, "move"), {"from_states": ["loading"],
                                                  "to_state": "ready", "message": ""},
                           format="json")
    assert untrusted.status_code == 403
    assert "serves only over TLS" in untrusted.json()["error"]["message"]
    signed = agent.post(url(replica, "certificate"),
                        {"signing_request": tls.new_key_and_request()[1]}, format="json")
    assert signed.status_code == 201
    assert move(["loading"], "ready", kv_cache_tokens=9000, log_tail="ready\n")
    assert not move(["loading"], "ready")  # said twice: moves nothing
    replica.refresh_from_db()
    assert (replica.state, replica.port, replica.pid, replica.kv_cache_tokens, replica.tls) == (
        State.READY, 8123, 4321, 9000, True)
    assert replica.ready_at is not None and replica.restarts == 0

    Replica.objects.filter(id=replica.id).update(state=State.STOPPING)
    assert move(["stopping"], "stopped", log_tail="bye\n")
    replica.refresh_from_db()
    assert (replica.state, replica.pid, replica.log_tail) == (State.STOPPED, None, "bye\n")
    assert replica.stopped_at is not None
    # A stopped replica's step is over: its progress is no longer current.
    assert agent.post(url(replica, "progress"), {
        "state": "loading", "stage": "late", "percent": 60}, format="json").json() == {
        "current": False}


@pytest.mark.parametrize("body, says", [
    ({"from_states": ["pending"], "to_state": "ready"}, "does not move a replica from"),
    ({"from_states": ["starting"], "to_state": "stopping"}, "does not move a replica from"),
    ({"from_states": ["starting"], "to_state": "loading", "kv_cache_tokens": 1},
     "does not set ['kv_cache_tokens']"),
])
def test_an_agent_cannot_make_moves_that_are_not_its_own(
        credential: str, replica: Replica, body: dict, says: str) -> None:
    response = as_node(credential).post(url(replica, "move"), {"message": "", **body},
                                        format="json")

    assert response.status_code == 403
    assert says in response.json()["error"]["message"]
    replica.refresh_from_db()
    assert replica.state == State.STARTING


def test_a_failure_keeps_the_engine_s_last_lines(credential: str, replica: Replica) -> None:
    Replica.objects.filter(id=replica.id).update(state=State.LOADING)

    response = as_node(credential).post(url(replica, "failure"), {
        "from_states": ["loading"], "reason": "the engine exited with status 1",
        "log_tail": "CUDA out of memory"}, format="json")

    assert response.json() == {"moved": True}
    replica.refresh_from_db()
    assert (replica.state, replica.restarts) == (State.FAILED, 1)
    assert replica.failure_reason.endswith("Last engine log lines:\nCUDA out of memory")
    refused = as_node(credential).post(url(replica, "failure"), {
        "from_states": ["stopped"], "reason": "x", "log_tail": ""}, format="json")
    assert refused.status_code == 403


REPLICA_ROUTES = [
    ("get", ""), ("post", "move"), ("post", "failure"), ("post", "progress"), ("post", "pid"),
    ("post", "log"), ("post", "events"), ("get", "adapters"), ("post", "adapters"),
    ("get", "adapters/1/files/adapter_config.json"), ("post", "hub-token"), ("post", "pin"),
    ("post", "certificate"),
]


def test_every_replica_route_is_scoped_to_the_node() -> None:
    from fleet.urls import urlpatterns

    routes = {str(pattern.pattern).removeprefix("replicas/<uuid:replica_id>").lstrip("/")
              for pattern in urlpatterns if "<uuid:replica_id>" in str(pattern.pattern)}
    assert routes == {path.replace("1/files/adapter_config.json",
                                   "<int:adapter_id>/files/<path:path>")
                      for _, path in REPLICA_ROUTES}


@pytest.mark.parametrize("method, step", REPLICA_ROUTES)
def test_another_node_s_replica_is_not_found(replica: Replica, method: str, step: str) -> None:
    thief = as_node(enrolled("gpu-2"))
    Replica.objects.filter(id=replica.id).update(state=State.READY, port=8001)
    before = Replica.objects.values().get(id=replica.id)

    response = getattr(thief, method)(url(replica, step), {}, format="json")

    assert response.status_code == 404
    assert Replica.objects.values().get(id=replica.id) == before
    assert thief.get("/node/v1/replicas").json() == {"replicas": []}


def test_a_hub_token_is_given_only_while_the_replica_downloads(credential: str,
                                                               replica: Replica) -> None:
    model = replica.endpoint.model
    model.hf_token_sealed = seal("hf_secret")
    model.save()
    agent = as_node(credential)

    refused = agent.post(url(replica, "hub-token"), {}, format="json")
    assert refused.status_code == 403
    assert "not downloading" in refused.json()["error"]["message"]

    Replica.objects.filter(id=replica.id).update(state=State.DOWNLOADING)
    assert agent.post(url(replica, "hub-token"), {}, format="json").json() == {
        "token": "hf_secret"}


def test_an_uploaded_adapter_s_files_come_while_the_replica_serves_it(
        credential: str, replica: Replica) -> None:
    adapter = Adapter.objects.create(
        endpoint=replica.endpoint, name="legal", source=AdapterSource.UPLOAD, rank=8,
        files=[{"path": "adapter_config.json", "size": 2, "sha256": "x"}], size_bytes=2)
    AdapterFile.objects.create(adapter=adapter, path="adapter_config.json", content=b"{}",
                               sha256="x")
    agent = as_node(credential)
    file_url = url(replica, f"adapters/{adapter.id}/files/adapter_config.json")

    assert agent.get(file_url).status_code == 404  # still starting: it serves none yet
    Replica.objects.filter(id=replica.id).update(state=State.READY)
    listed = agent.get(url(replica, "adapters")).json()["adapters"]
    assert [(item["name"], item["source"]) for item in listed] == [("legal", "upload")]
    response = agent.get(file_url)
    assert (response.status_code, response.content) == (200, b"{}")
    assert agent.get(url(replica, f"adapters/{adapter.id}/files/other.json")
                     ).status_code == 404


def sample(replica: Replica, **fields: object) -> dict[str, object]:
    return {"replica": str(replica.id), "at": timezone.now().isoformat(),
            "kv_cache_usage": 0.25, "running": 1, "waiting": 0, "prefix_queries": 256,
            "prefix_hits": 128, "external_queries": None, "external_hits": None,
            "preemptions": 0, "prompt_tokens": 300, "generation_tokens": 20, "requests": 2,
            "ttft_buckets": {"0.1": 1.0, "+Inf": 2.0}, "itl_buckets": {},
            "prompt_buckets": {}, "max_tokens_buckets": {}, **fields}


def test_samples_are_kept_for_the_node_s_own_replicas_only(credential: str,
                                                           replica: Replica) -> None:
    thief = as_node(enrolled("gpu-2"))

    mine = as_node(credential).post("/node/v1/samples", {"samples": [sample(replica)]},
                                    format="json")
    stolen = thief.post("/node/v1/samples", {"samples": [sample(replica)]}, format="json")

    assert (mine.json(), stolen.json()) == ({"kept": 1}, {"kept": 0})
    assert list(EngineSample.objects.values_list("replica_id", "prefix_hits")) == [
        (replica.id, 128)]


@pytest.mark.parametrize("fields", [
    {"prefix_hits": 512}, {"kv_cache_usage": 1.5}, {"running": -1},
    {"ttft_buckets": {str(n): 1.0 for n in range(101)}}, {"at": "yesterday"},
])
def test_implausible_samples_are_refused_whole(credential: str, replica: Replica,
                                               fields: dict) -> None:
    response = as_node(credential).post("/node/v1/samples", {
        "samples": [sample(replica), sample(replica, **fields)]}, format="json")

    assert response.status_code == 400
    assert not EngineSample.objects.exists()


def test_the_model_cache_report_is_the_node_s_own(credential: str) -> None:
    used = (timezone.now() - timedelta(hours=1)).replace(microsecond=0)
    response = as_node(credential).post("/node/v1/model-cache", {"entries": [
        {"repo_id": "kvrun/demo", "commit": "a" * 40, "bytes": 1000,
         "last_used": used.isoformat()}]}, format="json")

    assert response.status_code == 204
    assert Node.objects.get(name="gpu-1").model_cache == [
        {"repo_id": "kvrun/demo", "commit": "a" * 40, "bytes": 1000,
         "last_used": used.isoformat()}]


def test_the_first_node_to_fetch_a_hub_model_pins_it_through_the_channel(
        credential: str, replica: Replica, hub: Hub, hub_url: str) -> None:
    model = replica.endpoint.model
    ModelSpec.objects.filter(id=model.id).update(hf_repo="kvrun/demo", hf_commit="", files=[])
    agent = as_node(credential)
    assert agent.post(url(replica, "pin"), {}, format="json").status_code == 403  # starting

    Replica.objects.filter(id=replica.id).update(state=State.DOWNLOADING)
    response = agent.post(url(replica, "pin"), {}, format="json")

    assert response.status_code == 200
    commit = hub.commit_of("kvrun/demo", "main")
    assert (response.json()["hf_repo"], response.json()["hf_commit"]) == ("kvrun/demo", commit)
    assert {file["path"] for file in response.json()["files"]} >= {"config.json",
                                                                   "model.safetensors"}
    assert ModelSpec.objects.get(id=model.id).hf_commit == commit


def test_a_hub_adapter_s_token_is_given_while_the_replica_serves_adapters(
        credential: str, replica: Replica) -> None:
    adapter = Adapter.objects.create(
        endpoint=replica.endpoint, name="legal", source=AdapterSource.HUB, rank=8,
        hf_repo="acme/legal", hf_commit="b" * 40, hf_token_sealed=seal("hf_adapter"),
        size_bytes=2)
    agent = as_node(credential)
    ask = {"adapter": adapter.id}

    assert agent.post(url(replica, "hub-token"), ask, format="json").status_code == 403
    Replica.objects.filter(id=replica.id).update(state=State.READY)
    assert agent.post(url(replica, "hub-token"), ask, format="json").json() == {
        "token": "hf_adapter"}
    assert agent.post(url(replica, "hub-token"), {"adapter": "1"}, format="json"
                      ).status_code == 400


def test_a_download_s_time_is_the_control_plane_s_own(credential: str,
                                                       replica: Replica) -> None:
    agent = as_node(credential)
    assert agent.post(url(replica, "move"), {"from_states": ["starting"],
                                             "to_state": "downloading", "message": "fetching"},
                      format="json").json() == {"moved": True}
    claimed = agent.post(url(replica, "move"), {
        "from_states": ["downloading"], "to_state": "loading", "message": "", "port": 8123,
        "download_seconds": 1e300}, format="json")
    assert claimed.status_code == 400  # not a field an agent sets

    moved = agent.post(url(replica, "move"), {"from_states": ["downloading"],
                                              "to_state": "loading", "message": "",
                                              "port": 8123}, format="json")

    assert moved.json() == {"moved": True}
    replica.refresh_from_db()
    assert replica.download_seconds is not None and 0 <= replica.download_seconds < 60


@pytest.mark.parametrize("step, body", [
    ("move", {"from_states": ["starting"], "to_state": "loading", "message": "",
              "policy_version": 2**31}),
    ("move", {"from_states": ["loading"], "to_state": "ready", "message": "",
              "kv_cache_tokens": 2**60}),
    ("move", {"from_states": ["starting"], "to_state": "loading", "message": "a\x00b"}),
    ("pid", {"pid": 2**31}),
    ("log", {"log_tail": "x" * (64 * 1024 + 1)}),
    ("events", {"message": "x" * 501}),
    ("hub-token", {"adapter": "1"}),
    ("hub-token", {"adapter": 1, "rogue": True}),
])
def test_bodies_out_of_bounds_are_refused_and_change_nothing(
        credential: str, replica: Replica, step: str, body: dict) -> None:
    before = Replica.objects.values().get(id=replica.id)

    response = as_node(credential).post(url(replica, step), body, format="json")

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request"
    assert Replica.objects.values().get(id=replica.id) == before


def test_a_node_tells_a_tenant_nothing_of_a_replica_it_does_not_run(
        credential: str, replica: Replica) -> None:
    agent = as_node(credential)
    events = replica.endpoint.events.count()
    Replica.objects.filter(id=replica.id).update(state=State.STOPPED)

    refused = agent.post(url(replica, "events"), {"message": "Visit evil.example"},
                         format="json")

    assert refused.status_code == 403
    assert replica.endpoint.events.count() == events
    Replica.objects.filter(id=replica.id).update(state=State.READY)
    assert agent.post(url(replica, "events"), {"message": "KV tier self-test passed"},
                      format="json").status_code == 204
    assert replica.endpoint.events.count() == events + 1


def test_another_endpoint_s_adapters_are_out_of_reach(credential: str,
                                                      replica: Replica) -> None:
    elsewhere = placed_replica(Node.objects.get(name="gpu-1"))
    hub_adapter = Adapter.objects.create(
        endpoint=elsewhere.endpoint, name="theirs", source=AdapterSource.HUB, rank=8,
        hf_repo="other/legal", hf_commit="c" * 40, hf_token_sealed=seal("hf_theirs"),
        size_bytes=2)
    upload = Adapter.objects.create(
        endpoint=elsewhere.endpoint, name="secret", source=AdapterSource.UPLOAD, rank=8,
        files=[{"path": "adapter_config.json", "size": 2, "sha256": "x"}], size_bytes=2)
    AdapterFile.objects.create(adapter=upload, path="adapter_config.json", content=b"{}",
                               sha256="x")
    Replica.objects.filter(id=replica.id).update(state=State.READY)
    agent = as_node(credential)

    token = agent.post(url(replica, "hub-token"), {"adapter": hub_adapter.id}, format="json")
    file = agent.get(url(replica, f"adapters/{upload.id}/files/adapter_config.json"))
    nul = agent.get(url(replica, f"adapters/{upload.id}/files/a%00b"))

    assert (token.status_code, file.status_code, nul.status_code) == (403, 404, 404)
    assert "hf_theirs" not in token.content.decode()


@pytest.mark.parametrize("fields, says", [
    ({"at": "2000-01-01T00:00:00Z"}, "more than five minutes"),
    ({"ttft_buckets": {"abc": 1.0}}, "a number, or +Inf"),
    ({"ttft_buckets": {"1\x00": 1.0}}, ""),
])
def test_sample_times_and_bucket_bounds_are_checked(credential: str, replica: Replica,
                                                    fields: dict, says: str) -> None:
    response = as_node(credential).post("/node/v1/samples", {
        "samples": [sample(replica, **fields)]}, format="json")

    assert response.status_code == 400
    assert says in response.json()["error"]["message"]
    assert not EngineSample.objects.exists()
