"""What a node agent reports about its own node: its registration, its vLLM build, its
heartbeats and its model cache. A revoked node's reports are refused."""

from collections.abc import Collection

from django.db import transaction
from django.utils import timezone

from endpoints.models import GPUType, Node, NodeState, Replica
from endpoints.selectors import gpu_type_for_device
from endpoints.states import HOLDING_DEVICES
from engine.build import EngineBuild
from engine.devices import HostResources
from engine.sizing import CPU


class NodeRevoked(Exception):
    """The node's credential was revoked: it reports nothing until it is enrolled anew."""


def _build_values(build: EngineBuild) -> dict[str, object]:
    """A node's fields that its vLLM build sets."""
    return {"vllm_version": build.version, "architectures": list(build.architectures),
            "tool_parsers": list(build.tool_parsers),
            "reasoning_parsers": list(build.reasoning_parsers)}


def do_register_node(*, name: str, resources: HostResources, address: str = "127.0.0.1",
                     build: EngineBuild | None = None, model_cache_bytes: int = 0) -> Node:
    """Insert or refresh the node `name` with what its agent detected; it is online again.
    `address` is where its engines listen for the gateway; `build` is its vLLM (which
    architectures adding a model is judged by; None: not read yet, the node's last report
    stands until do_record_node_build), `model_cache_bytes` the disk it keeps for weights.
    The agent has stopped whatever engines its previous run left
    (nodes.agent.stop_engines_left_behind) before it calls this. Raises NodeRevoked for a
    revoked node."""
    with transaction.atomic():
        # Held, so that a revocation (fleet.enrolment.do_revoke_node, which holds it too)
        # either comes first and is seen here, or waits for this registration.
        held = Node.objects.select_for_update().filter(name=name).first()
        if held is not None and held.state == NodeState.REVOKED:
            raise NodeRevoked(f"node {name} was revoked; enrol it anew with a join token")
        if resources.devices:
            first = resources.devices[0]
            gpu_type = gpu_type_for_device(device_name=first.name, memory_bytes=first.memory_bytes)
        else:
            gpu_type = GPUType.objects.filter(slug=CPU).first()
        now = timezone.now()
        reported = _build_values(build or EngineBuild(version="", architectures=()))
        Node.objects.bulk_create(
            [
                Node(
                    name=name, address=address, state=NodeState.ONLINE, gpu_type=gpu_type,
                    devices=resources.devices_as_dicts(), cpu_count=resources.cpu_count,
                    memory_bytes=resources.memory_bytes, disk_bytes=resources.disk_bytes,
                    registered_at=now, last_heartbeat_at=now, **reported,
                    model_cache_bytes=model_cache_bytes,
                )
            ],
            update_conflicts=True,
            unique_fields=["name"],
            update_fields=["address", "state", "gpu_type", "devices", "cpu_count", "memory_bytes",
                           "disk_bytes", "last_heartbeat_at", "model_cache_bytes",
                           *(reported if build else [])],
        )
    return Node.objects.get(name=name)


def do_record_node_build(*, name: str, build: EngineBuild) -> None:
    """The node's vLLM build as its agent read it (after registering: reading it takes
    seconds, and the node takes replicas meanwhile)."""
    Node.objects.filter(name=name).update(**_build_values(build))


def do_record_node_heartbeat(*, name: str, engines: Collection[str]) -> set[str] | None:
    """Note that the node's agent is alive and runs engines for the replica ids `engines`.

    Returns those kvrun no longer expects on the node (replicas settled while it was lost,
    or that failed or stopped while their engine stayed up), which the agent must stop; or
    None when the node is not registered or has no catalog GPU type yet (the catalog came
    later): the agent then registers again. The node is online, and takes replicas, only
    while it reports no such engine; until then it is recovering. Its row is held while its
    replicas are read, as a reconciler pass holds it while it settles a lost node's replicas,
    so the two never cross: the node is never online with an engine of a replica just settled.
    """
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(
            name=name, gpu_type__isnull=False).exclude(state=NodeState.REVOKED).first()
        if node is None:
            return None
        expected = {str(replica_id) for replica_id in Replica.objects.filter(
            node=node, state__in=HOLDING_DEVICES).values_list("id", flat=True)}
        unexpected = set(engines) - expected
        Node.objects.filter(id=node.id).update(
            last_heartbeat_at=timezone.now(),
            state=NodeState.RECOVERING if unexpected else NodeState.ONLINE)
    return unexpected


def do_record_model_cache(*, name: str, entries: list[dict[str, object]]) -> None:
    """What the node's model cache holds now ([{repo_id, commit, bytes, last_used}]): the
    scheduler prefers a node that holds an endpoint's weights, and the console shows it."""
    Node.objects.filter(name=name).update(model_cache=entries)
