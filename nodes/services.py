"""Writes a node agent makes about its own node: registering it and its heartbeats."""

from django.utils import timezone

from endpoints.models import GPUType, Node, NodeState
from endpoints.selectors import gpu_type_for_device
from engine.devices import HostResources
from engine.sizing import CPU


def do_register_node(*, name: str, resources: HostResources, address: str = "127.0.0.1") -> Node:
    """Insert or refresh the node `name` with what its agent detected; it is online again.
    `address` is where its engines listen for the gateway."""
    if resources.devices:
        first = resources.devices[0]
        gpu_type = gpu_type_for_device(device_name=first.name, memory_bytes=first.memory_bytes)
    else:
        gpu_type = GPUType.objects.filter(slug=CPU).first()
    now = timezone.now()
    Node.objects.bulk_create(
        [
            Node(
                name=name, address=address, state=NodeState.ONLINE, gpu_type=gpu_type,
                devices=resources.devices_as_dicts(), cpu_count=resources.cpu_count,
                memory_bytes=resources.memory_bytes, registered_at=now, last_heartbeat_at=now,
            )
        ],
        update_conflicts=True,
        unique_fields=["name"],
        update_fields=["address", "state", "gpu_type", "devices", "cpu_count", "memory_bytes",
                       "last_heartbeat_at"],
    )
    return Node.objects.get(name=name)


def do_record_node_heartbeat(*, name: str) -> bool:
    """Note that the node's agent is alive. Returns False when the node is not registered or
    has no catalog GPU type yet (the catalog came later): the agent then registers again."""
    return Node.objects.filter(name=name, gpu_type__isnull=False).update(
        last_heartbeat_at=timezone.now(), state=NodeState.ONLINE
    ) == 1
