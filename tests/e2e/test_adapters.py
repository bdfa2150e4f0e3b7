"""LoRA adapters end to end: an endpoint with LoRA slots on a real vLLM CPU engine, adapters
from the hub on loopback and by upload, served through the gateway of a web process and
metered per adapter."""

import time
from pathlib import Path

import httpx
import pytest
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from accounts.models import Organization
from bench.hub_server import Hub
from endpoints.models import Adapter, Endpoint, Node, Replica, State
from endpoints.services import do_add_adapter_from_hub, do_add_adapter_from_upload
from engine import demo_model, lora
from nodes.weights import DEMO_SLUG
from tests.e2e.test_provisioning import delete_and_settle
from tests.factories import inference_key
from tests.helpers import (
    ENGINE_READY_WITHIN,
    drive,
    engine_client,
    records_for,
    story_of,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PROMPT = "The key-value cache holds the attention keys and values of every token"


def answer(web: str, secret: str, model: str) -> httpx.Response:
    return httpx.post(f"{web}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                            "temperature": 0})


def cached_tokens(web: str, secret: str, model: str, prompt: str) -> int:
    response = httpx.post(f"{web}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {secret}"},
                          json={"model": model, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return (response.json()["usage"].get("prompt_tokens_details") or {}).get(
        "cached_tokens") or 0


def upload(endpoint: Endpoint, name: str, *, seed: int, folder: Path) -> None:
    """A random demo adapter of `seed`, made in `folder` and uploaded as `name`."""
    made = lora.build_demo_adapter(folder, seed=seed, base_model=DEMO_SLUG,
                                   shape=demo_model.lora_shape())
    do_add_adapter_from_upload(
        endpoint=endpoint, actor_role="owner", added_by=None, name=name,
        config_json=(made / lora.CONFIG_FILE).read_bytes(),
        weights=(made / lora.WEIGHTS_FILE).read_bytes())


def serves(replica: Replica, adapters: list[str]) -> bool:
    replica.refresh_from_db()
    return replica.adapters == adapters


def test_adapters_answer_apart_arrive_without_a_restart_on_every_replica_metered_each(
        ready_node: Node, web: str, owner_api: APIClient, org: Organization, hub: Hub,
        hub_url: str, tmp_path: Path) -> None:
    created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
        "name": "tuned", "model": DEMO_SLUG, "context_length": 2048, "concurrency": 4,
        "gpu_type": "cpu", "lora_adapters": 2, "lora_max_rank": 8}, format="json")
    assert created.status_code == 201, created.content
    endpoint = Endpoint.objects.get(name="tuned", deleted_at=None)
    assert created.json()["sizing"]["lora_bytes_per_gpu"] == lora.device_bytes(
        demo_model.lora_shape(), adapters=2, max_rank=8)
    # Added while the first replica starts: it loads the adapter before it takes traffic.
    do_add_adapter_from_hub(endpoint=endpoint, actor_role="owner", added_by=None, name="a",
                            repo_id="kvrun/demo-lora-a")
    assert drive(lambda: Endpoint.objects.get(id=endpoint.id).state == State.READY,
                 ENGINE_READY_WITHIN), endpoint.events.values_list("message", flat=True)
    replica = Replica.objects.get(endpoint=endpoint, state=State.READY)
    assert wait_until(lambda: serves(replica, ["a"]), 30), replica.events.values_list(
        "message", flat=True)
    _, secret = inference_key(org)
    base, first = (answer(web, secret, model) for model in ("tuned", "tuned:a"))
    assert base.status_code == first.status_code == 200, (base.text, first.text)

    # Added while the endpoint runs: served without a restart.
    added = time.monotonic()
    upload(endpoint, "b", seed=2, folder=tmp_path / "b")
    assert wait_until(lambda: answer(web, secret, "tuned:b").status_code == 200, 60)
    ready_after = time.monotonic() - added
    second = answer(web, secret, "tuned:b")
    texts = [response.json()["choices"][0]["text"] for response in (base, first, second)]
    assert len(set(texts)) == 3, texts  # the base and each adapter answer apart
    assert Replica.objects.filter(endpoint=endpoint).count() == 1
    assert Replica.objects.get(id=replica.id).ready_at == replica.ready_at  # not restarted
    print(f"adapter served {ready_after:.2f} s after it was added")

    # Metered per adapter.
    request_ids = [response.headers["x-request-id"] for response in (base, first, second)]
    assert {record.request_id: record.adapter for record in records_for(request_ids)} == dict(
        zip(request_ids, ["", "a", "b"], strict=True))

    # Prefix caches never mix: a prompt the model has cached is new to an adapter.
    long_prompt = " ".join([PROMPT] * 30)  # a few 128-token blocks on the CPU engine
    cached = [cached_tokens(web, secret, model, long_prompt)
              for model in ("tuned", "tuned", "tuned:a", "tuned:a", "tuned:b")]
    assert cached[0] == 0 and cached[1] >= 128, cached
    assert cached[2] == 0 and cached[3] >= 128 and cached[4] == 0, cached

    with pytest.raises(ValidationError, match="rank 16, above this endpoint's largest LoRA"):
        do_add_adapter_from_hub(endpoint=endpoint, actor_role="owner", added_by=None,
                                name="big", repo_id="kvrun/demo-lora-r16")

    # Removed: the engine unloads it and the gateway no longer knows it.
    assert owner_api.delete(f"/api/v1/organizations/{org.slug}/endpoints/tuned/adapters/a/"
                            ).status_code == 204
    assert wait_until(lambda: serves(replica, ["b"]), 30)
    with engine_client(replica) as engine:
        listed = engine.get("/v1/models")
    assert [model["id"] for model in listed.json()["data"]] == ["tuned", "tuned:b"]
    assert wait_until(lambda: answer(web, secret, "tuned:a").status_code == 404, 30)
    assert not Adapter.objects.filter(name="a").exists()

    # Its name taken again by other weights: those are served, not the engine's old ones.
    upload(endpoint, "a", seed=9, folder=tmp_path / "a2")
    assert wait_until(lambda: answer(web, secret, "tuned:a").status_code == 200, 60)
    again = answer(web, secret, "tuned:a").json()["choices"][0]["text"]
    assert again not in texts, (again, texts)

    # A replica started later serves every adapter before it takes traffic, and one added
    # then reaches both replicas.
    scaled = owner_api.patch(f"/api/v1/organizations/{org.slug}/endpoints/tuned/scaling/",
                             {"min_replicas": 2, "max_replicas": 2}, format="json")
    assert scaled.status_code == 200, scaled.content
    assert drive(lambda: Replica.objects.filter(endpoint=endpoint, state=State.READY).count()
                 == 2, ENGINE_READY_WITHIN), story_of(endpoint.id)
    [later] = Replica.objects.filter(endpoint=endpoint, state=State.READY).exclude(id=replica.id)
    assert later.adapters == ["a", "b"], later.events.values_list("message", flat=True)
    upload(endpoint, "c", seed=3, folder=tmp_path / "c")
    assert wait_until(lambda: serves(replica, ["a", "b", "c"])
                      and serves(later, ["a", "b", "c"]), 60)
    delete_and_settle(owner_api, org, "tuned")
