"""LoRA adapters through the gateway: `<endpoint>:<adapter>` reaches only the replicas whose
engines serve the adapter, is listed with its endpoint as parent, is another organisation's
secret like its endpoints, can be a key's one allowed model, and is metered per adapter.

The gateway's ASGI app in this process before stand-in engines (tests.stub_upstream); the
same on a real vLLM engine is in tests/e2e/test_adapters.py."""

import httpx
import pytest

from accounts.models import Organization
from billing.models import UsageRecord
from endpoints.models import Adapter, Endpoint, Replica
from tests.factories import inference_key, ready_endpoint
from tests.gateway.helpers import InProcessGateway, received, stored

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def served(org: Organization, stub_ports: list[int]) -> Endpoint:
    """"chat" on two stand-in replicas, with the adapter "legal" served by the second only
    and "draft" added but served by none yet."""
    endpoint = ready_endpoint(org, "chat", stub_ports[:2], lora_adapters=2, prefix_affinity=False)
    for name in ("legal", "draft"):
        Adapter.objects.create(endpoint=endpoint, name=name, source="hub", rank=8,
                               size_bytes=1, hf_repo=f"kvrun/{name}", hf_commit="c" * 40)
    Replica.objects.filter(endpoint=endpoint, port=stub_ports[1]).update(adapters=["legal"])
    return endpoint


def test_an_adapter_is_routed_to_the_replicas_that_serve_it_and_metered_apart(
        gateway: InProcessGateway, served: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    answers = [gateway.post(secret, {"model": "chat:legal", "prompt": f"hello {n}"})
               for n in range(4)]
    base = gateway.post(secret, {"model": "chat", "prompt": "hello"})

    assert [answer.status_code for answer in answers] == [200] * 4 and base.status_code == 200
    first, second = (received(stub) for stub in stubs[:2])
    assert [sent["body"]["model"] for sent in second if sent["body"]["model"] != "chat"] == [
        "chat:legal"] * 4
    assert all(sent["body"]["model"] == "chat" for sent in first)
    assert stored(5)
    assert sorted(UsageRecord.objects.values_list("adapter", flat=True)) == [
        "", "legal", "legal", "legal", "legal"]
    assert {record.endpoint_id for record in UsageRecord.objects.all()} == {served.id}


def test_an_adapter_no_replica_serves_yet_is_not_ready_and_an_unknown_one_not_found(
        gateway: InProcessGateway, served: Endpoint, secret: str) -> None:
    waiting = gateway.post(secret, {"model": "chat:draft", "prompt": "hello"})
    unknown = gateway.post(secret, {"model": "chat:nope", "prompt": "hello"})

    assert waiting.status_code == 503 and waiting.headers["retry-after"] == "5"
    assert waiting.json()["error"]["code"] == "adapter_not_ready"
    assert waiting.json()["error"]["message"].startswith(
        "No replica of 'chat' serves the adapter 'draft' yet")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_models_lists_each_served_adapter_with_its_endpoint(
        gateway: InProcessGateway, served: Endpoint, secret: str) -> None:
    listed = gateway.get(secret, "/v1/models").json()["data"]

    assert [(model["id"], model.get("parent")) for model in listed] == [
        ("chat", None), ("chat:legal", "chat")]
    assert gateway.get(secret, "/v1/models/chat:legal").json()["parent"] == "chat"


def test_another_organisation_s_adapter_does_not_exist_for_a_stranger(
        gateway: InProcessGateway, served: Endpoint, other_org: Organization) -> None:
    _, stranger = inference_key(other_org)

    answer = gateway.post(stranger, {"model": "chat:legal", "prompt": "hello"})

    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found"
    assert gateway.get(stranger, "/v1/models").json()["data"] == []


def test_a_key_restricted_to_an_adapter_calls_only_that_adapter(
        gateway: InProcessGateway, served: Endpoint, org: Organization) -> None:
    _, adapter_only = inference_key(org, endpoint_names=["chat:legal"])
    _, endpoint_wide = inference_key(org, endpoint_names=["chat"])

    assert gateway.post(adapter_only, {"model": "chat:legal", "prompt": "hi"}).status_code == 200
    refused = gateway.post(adapter_only, {"model": "chat", "prompt": "hi"})
    assert refused.status_code == 403
    assert "may call only these endpoints: chat:legal" in refused.json()["error"]["message"]
    assert [m["id"] for m in gateway.get(adapter_only, "/v1/models").json()["data"]] == [
        "chat:legal"]
    # A key for the endpoint calls its adapters too.
    assert gateway.post(endpoint_wide, {"model": "chat:legal", "prompt": "hi"}).status_code == 200
