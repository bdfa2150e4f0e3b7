"""The node channel is scoped to the calling node: a node's credential reaches its own node's
reports and nothing of another node or of any tenant; nothing else opens the channel."""

import pytest
from rest_framework.test import APIClient

from accounts.models import Organization
from endpoints.models import Node, NodeState, State
from fleet.api import NodeRateThrottle
from tests.factories import api_key
from tests.fleet.helpers import as_node, enrolled, host, placed_replica

pytestmark = pytest.mark.django_db


def test_a_node_cannot_report_for_another_node_s_replica() -> None:
    enrolled("gpu-1")
    thief = enrolled("gpu-2")
    replica = placed_replica(Node.objects.get(name="gpu-1"))
    assert replica.node.name == "gpu-1"

    # Naming gpu-1's replica as its own engine only tells gpu-2 to stop an engine it has not.
    beat = as_node(thief).post("/node/v1/heartbeat", {"engines": [str(replica.id)]},
                               format="json")

    assert (beat.status_code, beat.json()) == (200, {"stop": [str(replica.id)],
                                                     "rotate": False})
    replica.refresh_from_db()
    assert (replica.state, replica.node.name) == (State.READY, "gpu-1")
    assert Node.objects.get(name="gpu-1").state == NodeState.ONLINE
    # gpu-2 is recovering until it has stopped that engine: its own state, nobody else's.
    assert Node.objects.get(name="gpu-2").state == NodeState.RECOVERING


@pytest.mark.parametrize("path", ["/api/v1/me/", "/api/v1/organizations/",
                                  "/admin/"])
def test_a_node_credential_opens_nothing_outside_the_node_channel(path: str) -> None:
    response = as_node(enrolled("gpu-1")).get(path)

    assert response.status_code in {401, 403, 302}
    if response.status_code == 302:  # the console sends it to sign in
        assert "/admin/login/" in response["Location"]


def test_users_and_api_keys_cannot_open_the_node_channel(owner_api: APIClient,
                                                        org: Organization) -> None:
    enrolled("gpu-1")
    _, secret = api_key(org)
    keyed = APIClient()
    keyed.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")

    heard = Node.objects.get(name="gpu-1").last_heartbeat_at

    answers = [client.post("/node/v1/heartbeat", {"engines": []}, format="json")
               for client in [owner_api, keyed, APIClient()]]

    assert [(answer.status_code, answer.json()["error"]["type"]) for answer in answers] == [
        (403, "permission_denied"), (401, "authentication_failed"),
        (401, "not_authenticated")]
    assert Node.objects.get(name="gpu-1").last_heartbeat_at == heard


def test_a_node_that_calls_too_often_is_slowed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    busy, quiet = as_node(enrolled("gpu-1")), as_node(enrolled("gpu-2"))
    limit = 5  # per minute, for the test: 1,200 in the product
    monkeypatch.setattr(NodeRateThrottle, "rate", f"{limit}/min")

    answers = [busy.post("/node/v1/heartbeat", {"engines": []}, format="json").status_code
               for _ in range(limit + 1)]

    assert answers[:limit] == [200] * limit and answers[limit] == 429
    assert quiet.post("/node/v1/heartbeat", {"engines": []}, format="json").status_code == 200


@pytest.mark.parametrize("change, field", [
    ({"address": "127.0.0.1"}, "address"),  # loopback, from another host
    ({"address": "169.254.169.254"}, "address"),  # link-local: a cloud's metadata service
    ({"address": "0.0.0.0"}, "address"),
    ({"resources": {**host()["resources"], "cpu_count": 2**31}}, "resources"),
    ({"resources": {**host()["resources"], "devices": [
        {"index": 40000, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 1}]}}, "resources"),
    ({"resources": {**host()["resources"], "devices": [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 1}] * 2}}, "resources"),
    ({"model_cache_bytes": 2**63}, "model_cache_bytes"),
])
def test_a_node_s_report_out_of_bounds_is_refused(change: dict, field: str) -> None:
    node = as_node(enrolled("gpu-1"))
    before = Node.objects.values().get(name="gpu-1")

    response = node.post("/node/v1/register", {**host(), **change}, format="json",
                         REMOTE_ADDR="10.0.0.7")

    assert response.status_code == 400
    assert field in response.json()["error"]["fields"]
    assert Node.objects.values().get(name="gpu-1") == before


def test_a_node_on_the_control_plane_s_host_may_listen_on_loopback() -> None:
    response = as_node(enrolled("gpu-1")).post("/node/v1/register",
                                               {**host(), "address": "127.0.0.1"},
                                               format="json", REMOTE_ADDR="127.0.0.1")

    assert response.status_code == 200
    assert Node.objects.get(name="gpu-1").address == "127.0.0.1"
