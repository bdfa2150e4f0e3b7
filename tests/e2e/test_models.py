"""A model added by its Hugging Face id, end to end: REST API → hub on loopback → the node's model
cache → a real vLLM engine that loads the downloaded snapshot offline."""

import shutil
import uuid
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from accounts.models import Organization
from bench.hub_server import Hub
from endpoints.models import Endpoint, ModelSpec, Node, Replica, ReplicaInterval, State
from tests.e2e.test_provisioning import complete, delete_and_settle
from tests.helpers import ENGINE_READY_WITHIN, drive

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

KIB = 1024


def test_a_model_added_by_id_downloads_once_is_never_billed_for_it_and_answers(
        ready_node: Node, owner_api: APIClient, org: Organization, hub: Hub, hub_url: str,
        tmp_path: Path) -> None:
    # A repository no earlier run fetched: the node's cache outlives the suite.
    folder = shutil.copytree(hub.root / "kvrun/demo" / hub.commit_of("kvrun/demo", "main"),
                             tmp_path / "demo")
    (folder / "generation_config.json").write_text(f'{{"run": "{uuid.uuid4()}"}}')
    repo = f"acme/demo-{uuid.uuid4().hex[:8]}"
    commit = hub.publish(repo, folder)
    added = owner_api.post(f"/api/v1/organizations/{org.slug}/models/", {"hf_repo": repo},
                           format="json")
    assert added.status_code == 201, added.content
    model = ModelSpec.objects.get(slug=added.json()["slug"])
    hub.rate_bytes_per_second = 256 * KIB  # about six seconds: long enough to watch
    sent_before = hub.bytes_sent

    response = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
        "name": "byo", "model": model.slug, "context_length": 2048, "concurrency": 2,
        "gpu_type": "cpu"},
        format="json")
    assert response.status_code == 201, response.content
    stages: set[str] = set()

    def ready() -> bool:
        stages.update(Replica.objects.filter(endpoint__name="byo", state=State.DOWNLOADING)
                      .values_list("stage", flat=True))
        return Endpoint.objects.get(name="byo", deleted_at=None).state == State.READY
    try:
        assert drive(ready, ENGINE_READY_WITHIN), Endpoint.objects.get(
            name="byo").events.values_list("message", flat=True)
    finally:
        hub.rate_bytes_per_second = None

    downloaded = sum(file["size"] for file in model.files)
    assert hub.bytes_sent - sent_before == downloaded
    assert any(stage.startswith("downloading weights: ") and stage.endswith(" left")
               and f" of {downloaded / 1e3:.1f} kB, " in stage and "kB/s" in stage
               for stage in stages), stages
    replica = Replica.objects.get(endpoint__name="byo", state=State.READY)
    assert replica.events.filter(message__startswith=f"downloaded {downloaded / 1e3:.1f} kB "
                                                     "of weights in ").exists()
    answer = complete(replica, "byo")
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 5
    predicted = Endpoint.objects.get(name="byo").sizing["kv_cache_tokens"]
    assert replica.kv_cache_tokens == predicted  # as vLLM logged it
    # The download was never billed: no interval of the ledger overlaps it.
    events = dict(replica.events.values_list("message", "at"))
    began = events[f"downloading the weights of {repo} at {commit[:12]}"]
    ended = events["starting the engine"]
    for interval in ReplicaInterval.objects.filter(replica=replica):
        assert interval.ended_at is None or interval.ended_at <= began or (
            interval.started_at >= ended), (interval.phase, interval.started_at, began, ended)
    node = Node.objects.get(name=ready_node.name)
    assert node.holds_weights(model)

    # A second start on the same node downloads nothing.
    assert owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/byo/stop/").status_code \
        == 200
    assert drive(lambda: Endpoint.objects.get(name="byo").state == State.STOPPED, 60)
    sent_before = hub.bytes_sent
    assert owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/byo/start/").status_code \
        == 200
    assert drive(lambda: Endpoint.objects.get(name="byo").state == State.READY, ENGINE_READY_WITHIN)
    second = Replica.objects.get(endpoint__name="byo", state=State.READY)
    assert hub.bytes_sent == sent_before
    assert not second.events.filter(state=State.DOWNLOADING).exists()
    delete_and_settle(owner_api, org, "byo")
