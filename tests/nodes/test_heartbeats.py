"""What a node's heartbeat reports (the engines its agent runs) and what kvrun makes of it."""

import pytest
from django.core.management import CommandError, call_command

from accounts.models import Role
from endpoints.models import Endpoint, ModelSpec, Node, NodeState, Replica, State
from endpoints.policies import EndpointPolicy
from endpoints.reconciler import reconcile_endpoint
from endpoints.services import do_create_endpoint, do_load_catalogs, do_mark_lost_nodes
from engine.build import EngineBuild
from engine.devices import Device, HostResources
from fleet.reports import do_record_node_build, do_record_node_heartbeat, do_register_node
from tests.factories import organization_with_owner

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(db: None) -> Node:
    do_load_catalogs()
    devices = [Device(index=i, name="NVIDIA H100 80GB HBM3", memory_bytes=81559 * 2**20)
               for i in range(2)]
    return do_register_node(name="gpu-1", resources=HostResources(
        devices=devices, cpu_count=64, memory_bytes=2**40))


def placed_endpoint(node: Node) -> Endpoint:
    """An endpoint of two of `node`'s GPUs, its replica placed there by the reconciler."""
    endpoint = do_create_endpoint(
        organization=organization_with_owner("Acme"), actor_role=Role.OWNER, created_by=None,
        name="chat", model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"),
        gpu_type=node.gpu_type, gpu_count=2,
        policy=EndpointPolicy(context_length=8192, concurrency=8))
    reconcile_endpoint(endpoint_id=endpoint.id)
    return endpoint


def test_a_node_back_from_lost_takes_no_replica_until_its_old_engines_are_gone(
        node: Node) -> None:
    endpoint = placed_endpoint(node)
    old = endpoint.replicas.get()
    Replica.objects.filter(id=old.id).update(state=State.READY)
    Node.objects.filter(id=node.id).update(state=NodeState.LOST)
    reconcile_endpoint(endpoint_id=endpoint.id)  # settles the old replica; its engine may run on
    assert Replica.objects.get(id=old.id).state == State.STOPPED

    # Back: its agent still runs the old replica's engine, on the devices the new one wants.
    assert do_record_node_heartbeat(name="gpu-1", engines=[str(old.id)]) == {str(old.id)}
    reconcile_endpoint(endpoint_id=endpoint.id)

    assert Node.objects.get(id=node.id).state == NodeState.RECOVERING
    new = endpoint.replicas.exclude(id=old.id).get()
    assert (new.state, new.node) == (State.PENDING, None)

    # The agent stopped it; the next heartbeat says so, and the devices are handed out again.
    assert do_record_node_heartbeat(name="gpu-1", engines=[]) == set()
    reconcile_endpoint(endpoint_id=endpoint.id)

    assert Node.objects.get(id=node.id).state == NodeState.ONLINE
    new.refresh_from_db()
    assert (new.state, new.node_id, new.device_indices) == (State.STARTING, node.id, [0, 1])


def test_engines_kvrun_expects_keep_a_node_online(node: Node) -> None:
    endpoint = placed_endpoint(node)
    replica = endpoint.replicas.get()
    for state in [State.LOADING, State.READY, State.STOPPING]:
        Replica.objects.filter(id=replica.id).update(state=state)

        assert do_record_node_heartbeat(name="gpu-1", engines=[str(replica.id)]) == set()
        assert Node.objects.get(id=node.id).state == NodeState.ONLINE

    # A failed replica whose engine still runs is not expected: the agent must stop it.
    Replica.objects.filter(id=replica.id).update(state=State.FAILED)
    assert do_record_node_heartbeat(name="gpu-1", engines=[str(replica.id)]) == {str(replica.id)}
    assert Node.objects.get(id=node.id).state == NodeState.RECOVERING


def test_a_recovering_node_that_goes_quiet_is_lost_again(node: Node, settings: object) -> None:
    settings.KVRUN_NODE_LOST_AFTER_SECONDS = 0
    do_record_node_heartbeat(name="gpu-1", engines=["00000000-0000-0000-0000-000000000001"])

    assert do_mark_lost_nodes() == 1
    assert Node.objects.get(id=node.id).state == NodeState.LOST


def test_an_unregistered_node_is_told_to_register(db: None) -> None:
    assert do_record_node_heartbeat(name="nobody", engines=[]) is None


def test_a_node_s_vllm_build_survives_its_registering_again_until_it_reads_a_new_one(
        node: Node) -> None:
    build = EngineBuild(version="0.32.0", architectures=("LlamaForCausalLM",))
    do_record_node_build(name="gpu-1", build=build)
    resources = HostResources(devices=[], cpu_count=64, memory_bytes=2**40)

    do_register_node(name="gpu-1", resources=resources)  # its agent restarted: not read yet
    assert Node.objects.get(name="gpu-1").architectures == ["LlamaForCausalLM"]
    do_register_node(name="gpu-1", resources=resources, build=EngineBuild(
        version="0.33.0", architectures=("LlamaForCausalLM", "Qwen3ForCausalLM"),
        tool_parsers=("hermes",), reasoning_parsers=("qwen3",)))
    node = Node.objects.get(name="gpu-1")
    assert (node.vllm_version, node.architectures, node.tool_parsers,
            node.reasoning_parsers) == (
        "0.33.0", ["LlamaForCausalLM", "Qwen3ForCausalLM"], ["hermes"], ["qwen3"])


def test_waiting_for_a_node_ends_once_it_takes_replicas_and_fails_while_it_does_not(
        node: Node) -> None:
    call_command("wait_for_node", "gpu-1", timeout=0)

    Node.objects.filter(name="gpu-1").update(draining=True)
    with pytest.raises(CommandError, match="node gpu-1 has not registered within 0 s"):
        call_command("wait_for_node", "gpu-1", timeout=0)
    with pytest.raises(CommandError, match="node gpu-2 has not registered"):
        call_command("wait_for_node", "gpu-2", timeout=0)
