"""Placing replicas on nodes: the right GPU type, enough free devices, tightest fit first."""

from uuid import UUID

from django.db import transaction

from endpoints.lifecycle import do_transition_replica
from endpoints.models import Node, NodeState, Replica
from endpoints.states import HOLDING_DEVICES, ON_NODE, State
from engine.sizing import CPU


def free_devices(node: Node) -> list[int]:
    used = {
        index
        for indices in Replica.objects.filter(node=node, state__in=HOLDING_DEVICES)
        .values_list("device_indices", flat=True)
        for index in indices
    }
    return [device["index"] for device in node.devices if device["index"] not in used]


def do_place_replica(*, replica_id: UUID) -> Node | None:
    """Assign a pending replica to a node and its devices (pending → scheduling).

    Only online nodes that are not draining take it, in the endpoint's region where it
    requires one. A node whose model cache holds the
    model's weights comes first (its start downloads nothing); then best fit: the node with
    the fewest free devices that still hold the replica, so that large endpoints find whole
    nodes later. CPU endpoints go to the least busy CPU node.
    Node rows are locked while counting, so two reconcilers never hand out one device twice.
    Returns None, leaving the replica pending, when no node fits now.
    """
    with transaction.atomic():
        replica = Replica.objects.select_related("endpoint__gpu_type", "endpoint__model",
                                                 "endpoint__region").get(id=replica_id)
        if replica.state != State.PENDING:
            return None
        endpoint = replica.endpoint
        # A draining node is re-read once its lock is free, so a drain that marked it while
        # this waited keeps the replica off it.
        candidates = Node.objects.filter(state=NodeState.ONLINE, draining=False,
                                         gpu_type=endpoint.gpu_type)
        if endpoint.region_id is not None:
            candidates = candidates.filter(region_id=endpoint.region_id)
        nodes = list(candidates.select_for_update().order_by("name"))
        if endpoint.gpu_type.slug == CPU:
            ranked = sorted(nodes, key=lambda node: (
                not node.holds_weights(endpoint.model),
                Replica.objects.filter(node=node, state__in=ON_NODE).count()))
            choice, devices = (ranked[0], []) if ranked else (None, [])
        else:
            fits = [(node, free) for node in nodes
                    if len(free := free_devices(node)) >= endpoint.gpu_count]
            fits.sort(key=lambda pair: (not pair[0].holds_weights(endpoint.model), len(pair[1])))
            choice, devices = (fits[0][0], fits[0][1][: endpoint.gpu_count]) if fits else (None, [])
        if choice is None:
            where = f" in {endpoint.region.slug}" if endpoint.region_id is not None else ""
            Replica.objects.filter(id=replica_id, state=State.PENDING).update(
                stage=f"waiting for a node{where} with {endpoint.gpu_count} free "
                      f"{endpoint.gpu_type.name}"[:80])
            return None
        placed = do_transition_replica(
            replica_id=replica_id, from_states=[State.PENDING], to_state=State.SCHEDULING,
            message=f"placed on {choice.name}" + (f" GPUs {devices}" if devices else ""),
            node=choice, device_indices=devices,
        )
        return choice if placed else None
