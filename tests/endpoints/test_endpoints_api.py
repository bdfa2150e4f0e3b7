import pytest
from rest_framework.test import APIClient

from accounts.models import Membership, Organization, Role, Scope
from endpoints.models import Endpoint, EndpointEvent, Node, Replica, State
from endpoints.services import do_load_catalogs
from tests.factories import UserFactory, api_key

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


def url(org: Organization, rest: str = "") -> str:
    return f"/api/v1/organizations/{org.slug}/endpoints/{rest}"


DEMO = {"name": "demo", "model": "kvrun-demo-tiny", "context_length": 2048, "concurrency": 4}


def test_it_creates_a_sized_endpoint(owner_api: APIClient, org: Organization,
                                     cpu_node: Node) -> None:
    response = owner_api.post(url(org), DEMO, format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["gpu_type"], body["gpu_count"], body["state"]) == ("cpu", 1, "pending")
    assert body["hourly_price_usd"] == "0.1000"
    assert body["sizing"]["kv_bytes_per_token"] == 512
    assert body["sizing"]["kv_needed_bytes_per_gpu"] == 4 * 2048 * 512
    assert "→ 1 × CPU only" in body["sizing"]["explanation"]
    endpoint = Endpoint.objects.get()
    assert endpoint.desired_state == "running"
    assert EndpointEvent.objects.filter(endpoint=endpoint, state=State.PENDING).exists()


def test_without_nodes_it_sizes_against_the_gpu_catalog(owner_api: APIClient,
                                                        org: Organization) -> None:
    body = {"name": "big", "model": "llama-3.1-70b-instruct", "context_length": 32768,
            "concurrency": 4}

    response = owner_api.post(url(org), body, format="json")

    assert response.status_code == 201, response.content
    sizing = response.json()["sizing"]
    assert sizing["gpu_count"] >= 2
    assert sizing["kv_bytes_per_token"] * sizing["gpu_count"] == 327_680
    assert "weights 141 GB + KV 40.0 GiB for 4 × 32k tokens" in sizing["explanation"]


@pytest.mark.parametrize(
    ("change", "field", "phrase"),
    [
        ({"model": "gpt-17"}, "model", "Unknown model"),
        ({"context_length": 4096}, "context_length", "at most 2,048"),
        ({"min_replicas": 0}, "min_replicas", "at least one"),
        ({"min_replicas": -2}, "min_replicas", "at least one"),
        ({"concurrency": 0}, "concurrency", "greater than or equal to 1"),
        ({"gpu_type": "tpu-v9"}, "gpu_type", "Unknown GPU type"),
        ({"name": "Not A Slug!"}, "name", "letters"),
        ({"colour": "blue"}, "colour", "Unknown field"),
    ],
)
def test_bad_input_says_what_to_change_and_writes_nothing(
    owner_api: APIClient, org: Organization, cpu_node: Node, change: dict, field: str,
    phrase: str,
) -> None:
    response = owner_api.post(url(org), {**DEMO, **change}, format="json")

    assert response.status_code == 400
    assert phrase in " ".join(response.json()["error"]["fields"][field])
    assert not Endpoint.objects.exists()


def test_a_request_that_fits_no_gpu_says_what_would(owner_api: APIClient,
                                                    org: Organization) -> None:
    body = {"name": "huge", "model": "llama-3.1-8b-instruct", "context_length": 131072,
            "concurrency": 64, "gpu_type": "l4"}

    response = owner_api.post(url(org), body, format="json")

    assert response.status_code == 400
    message = response.json()["error"]["fields"]["gpu_type"][0]
    assert "8 × NVIDIA L4 24 GB has" in message
    assert "which holds 8 at this context" in message
    assert "lower the concurrency to 8" in message
    assert "would hold the weights and the KV cache for 64 × 131,072 tokens, but no" in message
    assert not Endpoint.objects.exists()


def test_a_duplicate_name_is_refused(owner_api: APIClient, org: Organization,
                                     cpu_node: Node) -> None:
    assert owner_api.post(url(org), DEMO, format="json").status_code == 201

    response = owner_api.post(url(org), DEMO, format="json")

    assert response.status_code == 400
    assert "already exists" in response.json()["error"]["fields"]["name"][0]
    assert Endpoint.objects.count() == 1


def test_scale_stop_start_and_delete(owner_api: APIClient, org: Organization,
                                     cpu_node: Node) -> None:
    owner_api.post(url(org), {**DEMO, "max_replicas": 3}, format="json")

    assert owner_api.post(url(org, "demo/scale/"), {"replicas": 4}, format="json"
                          ).status_code == 400
    assert owner_api.post(url(org, "demo/scale/"), {"replicas": 0}, format="json"
                          ).status_code == 400
    assert owner_api.post(url(org, "demo/scale/"), {"replicas": 3}, format="json"
                          ).json()["desired_replicas"] == 3
    assert owner_api.post(url(org, "demo/stop/")).json()["desired_state"] == "stopped"
    assert owner_api.post(url(org, "demo/start/")).json()["desired_state"] == "running"
    assert owner_api.delete(url(org, "demo/")).status_code == 204
    assert owner_api.get(url(org, "demo/")).status_code == 404
    assert Endpoint.objects.get().deleted_at is not None
    # The name is free again once the endpoint is deleted.
    assert owner_api.post(url(org), DEMO, format="json").status_code == 201


@pytest.mark.parametrize("who", ["member", "inference key"])
def test_members_and_inference_keys_cannot_create_scale_stop_or_delete_endpoints(
    owner_api: APIClient, org: Organization, cpu_node: Node, who: str
) -> None:
    owner_api.post(url(org), DEMO, format="json")
    client = APIClient()
    if who == "member":
        member = UserFactory(email="member@acme.test")
        Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
        client.force_authenticate(member)
        refusal = "Only owners and admins can"
        assert client.get(url(org, "demo/")).status_code == 200  # members read
    else:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key(org, scope=Scope.INFERENCE)[1]}")
        refusal = "inference scope"

    for response in (client.post(url(org), {**DEMO, "name": "another"}, format="json"),
                     client.post(url(org, "demo/scale/"), {"replicas": 1}, format="json"),
                     client.post(url(org, "demo/stop/")),
                     client.delete(url(org, "demo/"))):
        assert response.status_code == 403, response.content
        assert refusal in response.json()["error"]["message"]

    endpoint = Endpoint.objects.get()
    assert (endpoint.name, endpoint.desired_state, endpoint.deleted_at) == (
        "demo", "running", None)


def test_events_list_the_lifecycle(owner_api: APIClient, org: Organization,
                                   cpu_node: Node) -> None:
    owner_api.post(url(org), DEMO, format="json")

    events = owner_api.get(url(org, "demo/events/")).json()["results"]

    assert events[-1]["state"] == "pending" and events[-1]["message"].startswith("created:")
    assert all(event["at"] for event in events)


def test_another_organisation_cannot_see_or_touch_an_endpoint(
    owner_api: APIClient, org: Organization, other_org: Organization, cpu_node: Node
) -> None:
    owner_api.post(url(org), DEMO, format="json")
    outsider = APIClient()
    outsider.force_authenticate(other_org.memberships.get().user)

    assert outsider.get(url(org, "demo/")).status_code == 404
    assert outsider.post(url(org, "demo/stop/")).status_code == 404
    assert outsider.delete(url(org, "demo/")).status_code == 404
    assert outsider.get(url(other_org)).json()["count"] == 0
    assert Endpoint.objects.get().desired_state == "running"


def test_sizing_preview_creates_nothing(owner_api: APIClient, cpu_node: Node) -> None:
    response = owner_api.post("/api/v1/sizing/", {"model": "llama-3.1-8b-instruct",
                                                  "context_length": 8192, "concurrency": 16,
                                                  "gpu_type": "l4"}, format="json")

    assert response.status_code == 200, response.content
    assert response.json()["gpu_type"] == "l4"
    assert response.json()["kv_bytes_per_token"] * response.json()["gpu_count"] >= 131_072
    assert not Endpoint.objects.exists()
    assert not Replica.objects.exists()
