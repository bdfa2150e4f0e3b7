"""Placing replicas on nodes: the right GPU type (and region), enough free devices and room
for their KV tiers, tightest fit first."""

from collections.abc import Iterable
from dataclasses import dataclass
from uuid import UUID

from django.db import transaction
from django.db.models import QuerySet

from endpoints.lifecycle import do_transition_replica
from endpoints.models import Endpoint, GPUType, Node, NodeState, Region, Replica
from endpoints.states import HOLDING_DEVICES, ON_NODE, State
from engine.sizing import CPU, GIB

# What KV tiers may take of a node's host memory in all: the rest is its system's, its
# agent's and its engines' own processes'. Of its disk, the model cache's budget is set
# apart first.
TIER_SHARE_OF_HOST_MEMORY = 0.75


@dataclass(frozen=True)
class Room:
    """Host memory and disk, in bytes: what a replica's KV tiers need, or what a node has
    for them."""

    host_bytes: int
    disk_bytes: int

    def holds(self, other: "Room") -> bool:
        return other.host_bytes <= self.host_bytes and other.disk_bytes <= self.disk_bytes


def needs_of(endpoint: Endpoint) -> Room:
    """What one replica of `endpoint` takes of its node beside devices: its host-memory tier
    (and, on a CPU node, its KV pool, which is host memory too) and its disk tier."""
    host = endpoint.host_tier_gib * GIB
    if endpoint.gpu_type.slug == CPU:
        # Endpoints sized before their KV pool was exact were given a whole GiB
        # (fleet.selectors.replica_spec).
        host += int(endpoint.sizing.get("cpu_kv_cache_bytes") or GIB)
    return Room(host_bytes=host, disk_bytes=endpoint.disk_tier_gib * GIB)


def tier_room(node: Node) -> Room:
    """What `node` has for its replicas' KV tiers in all."""
    return Room(host_bytes=int(node.memory_bytes * TIER_SHARE_OF_HOST_MEMORY),
                disk_bytes=max(0, node.disk_bytes - node.model_cache_bytes))


def share_of(node: Node, *, gpu_count: int) -> Room:
    """What a replica holding `gpu_count` of `node`'s GPUs may take of its tier room: the
    GPUs' share (the whole of a CPU node's), so that one tenant's tiers cannot take what
    the node's other GPUs' replicas need."""
    room = tier_room(node)
    if not node.devices:
        return room
    part = min(1.0, gpu_count / len(node.devices))
    return Room(host_bytes=int(room.host_bytes * part), disk_bytes=int(room.disk_bytes * part))


def tier_room_left(node: Node, held: Iterable[Replica]) -> Room:
    """What `node`'s tier room is left once its replicas holding devices there (`held`)
    have theirs."""
    taken = [needs_of(replica.endpoint) for replica in held]
    room = tier_room(node)
    return Room(host_bytes=room.host_bytes - sum(need.host_bytes for need in taken),
                disk_bytes=room.disk_bytes - sum(need.disk_bytes for need in taken))


def nodes_taking_replicas(*, gpu_type: GPUType, region: Region | None) -> QuerySet[Node]:
    """The nodes a new replica on `gpu_type` (in `region`, where given) may go to: online
    and not draining."""
    nodes = Node.objects.filter(state=NodeState.ONLINE, draining=False, gpu_type=gpu_type)
    return nodes if region is None else nodes.filter(region=region)


def largest_share(*, gpu_type: GPUType, gpu_count: int, region: Region | None) -> Room | None:
    """The most any online node of `gpu_type` with `gpu_count` GPUs or more (in `region`,
    where given) gives a replica on that many of them for its tiers; None when there is
    none."""
    shares = [share_of(node, gpu_count=gpu_count)
              for node in nodes_taking_replicas(gpu_type=gpu_type, region=region)
              if not node.devices or len(node.devices) >= gpu_count]
    if not shares:
        return None
    return Room(host_bytes=max(share.host_bytes for share in shares),
                disk_bytes=max(share.disk_bytes for share in shares))


def held_on(nodes: Iterable[Node]) -> dict[int, list[Replica]]:
    """Each node's replicas holding its devices (with their endpoints), by node id: one
    read for all of them."""
    held: dict[int, list[Replica]] = {node.id: [] for node in nodes}
    for replica in Replica.objects.filter(node_id__in=held, state__in=HOLDING_DEVICES
                                          ).select_related("endpoint__gpu_type"):
        held[replica.node_id].append(replica)
    return held


def free_devices(node: Node, held: Iterable[Replica] | None = None) -> list[int]:
    """`node`'s devices that no replica holds (`held`: its replicas holding devices, where
    the caller read them already)."""
    replicas = held_on([node])[node.id] if held is None else held
    used = {index for replica in replicas for index in replica.device_indices}
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
        needs = needs_of(endpoint)
        # A draining node is re-read once its lock is free, so a drain that marked it while
        # this waited keeps the replica off it.
        candidates = list(nodes_taking_replicas(gpu_type=endpoint.gpu_type,
                                                region=endpoint.region)
                          .select_for_update().order_by("name"))
        held = held_on(candidates)
        nodes = [node for node in candidates
                 if share_of(node, gpu_count=endpoint.gpu_count).holds(needs)
                 and tier_room_left(node, held[node.id]).holds(needs)]
        if endpoint.gpu_type.slug == CPU:
            ranked = sorted(nodes, key=lambda node: (
                not node.holds_weights(endpoint.model),
                sum(replica.state in ON_NODE for replica in held[node.id])))
            choice, devices = (ranked[0], []) if ranked else (None, [])
        else:
            fits = [(node, free) for node in nodes
                    if len(free := free_devices(node, held[node.id])) >= endpoint.gpu_count]
            fits.sort(key=lambda pair: (not pair[0].holds_weights(endpoint.model), len(pair[1])))
            choice, devices = (fits[0][0], fits[0][1][: endpoint.gpu_count]) if fits else (None, [])
        if choice is None:
            where = f" in {endpoint.region.slug}" if endpoint.region_id is not None else ""
            tiers = " and KV room" if needs.host_bytes or needs.disk_bytes else ""
            Replica.objects.filter(id=replica_id, state=State.PENDING).update(
                stage=f"waiting for a node{where} with {endpoint.gpu_count} free "
                      f"{endpoint.gpu_type.name}{tiers}"[:80])
            return None
        placed = do_transition_replica(
            replica_id=replica_id, from_states=[State.PENDING], to_state=State.SCHEDULING,
            message=f"placed on {choice.name}" + (f" GPUs {devices}" if devices else ""),
            node=choice, device_indices=devices,
        )
        return choice if placed else None
