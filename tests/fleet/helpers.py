"""What the fleet tests share: a host's report, a client holding a node's credential, a node
enrolled through the channel, a replica placed on a node."""

from rest_framework.test import APIClient

from accounts.models import Role
from endpoints.models import ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy
from endpoints.reconciler import reconcile_endpoint
from endpoints.services import do_create_endpoint
from fleet.enrolment import do_create_join_token
from tests.factories import organization_with_owner

H100 = "NVIDIA H100 80GB HBM3"


def host(gpus: int = 8) -> dict[str, object]:
    """What an agent on an 8-GPU H100 host says of it when it enrols or registers."""
    return {"resources": {"devices": [{"index": i, "name": H100, "memory_bytes": 81559 * 2**20}
                                      for i in range(gpus)],
                          "cpu_count": 64, "memory_bytes": 2**40, "disk_bytes": 2**42},
            "address": "10.0.0.7", "model_cache_bytes": 500 * 2**30}


def as_node(credential: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {credential}")
    return client


def enrolled(name: str) -> str:
    """The credential of a node `name` just enrolled through the channel."""
    _, token = do_create_join_token(node_name=name)
    response = APIClient().post("/node/v1/enrol", {"join_token": token, "name": name, **host()},
                                format="json")
    assert response.status_code == 201
    return response.json()["credential"]


def placed_replica(node: Node) -> Replica:
    """A ready replica of a new organisation's endpoint, placed on `node` (two GPUs)."""
    endpoint = do_create_endpoint(
        organization=organization_with_owner(f"Org of {node.name}"), actor_role=Role.OWNER,
        created_by=None, name="chat", model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"),
        gpu_type=node.gpu_type, gpu_count=2,
        policy=EndpointPolicy(context_length=8192, concurrency=8))
    reconcile_endpoint(endpoint_id=endpoint.id)
    replica = endpoint.replicas.get()
    Replica.objects.filter(id=replica.id).update(state=State.READY, port=8001)
    return replica
