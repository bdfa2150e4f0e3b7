"""Placing replicas on nodes: the right GPU type, in the endpoint's placement (its region, and
its organisation's own nodes or the shared fleet), enough free devices and room for their
KV tiers; its own nodes first, then the tightest fit."""

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from functools import cached_property
from uuid import UUID

from django.db import transaction
from django.db.models import Q, QuerySet

from endpoints.lifecycle import do_transition_replica
from endpoints.models import Endpoint, GPUType, Node, NodeState, Region, RegionalPrice, Replica
from endpoints.states import HOLDING_DEVICES, ON_NODE, State
from engine.sizing import CPU, GIB

# What KV tiers may take of a node's host memory in all: the rest is its system's, its
# agent's and its engines' own processes'. Of its disk, the model cache's budget is set
# apart first.
TIER_SHARE_OF_HOST_MEMORY = 0.75


@dataclass(frozen=True)
class Placement:
    """The nodes an endpoint's replicas may run on, and so the hardware it is sized and
    priced for: the shared fleet and its organisation's own nodes (those alone where it
    requires them), in its region where it requires one. Placement() is the shared fleet,
    anywhere. Nobody's replicas run on another organisation's nodes."""

    region: Region | None = None
    organization_id: UUID | None = None
    own_nodes_only: bool = False

    @classmethod
    def of(cls, endpoint: Endpoint) -> "Placement":
        return cls(region=endpoint.region, organization_id=endpoint.organization_id,
                   own_nodes_only=endpoint.own_nodes_only)

    def nodes(self, prefix: str = "") -> Q:
        """The condition on a node (through `prefix`, such as "node__") of being in placement."""
        owner = f"{prefix}organization_id"
        if self.own_nodes_only:
            # Without an organisation (the public planner) there are no own nodes.
            found = (Q(**{owner: self.organization_id}) if self.organization_id is not None
                     else Q(**{f"{prefix}pk__in": []}))
        else:
            found = Q(**{owner: None}) | Q(**{owner: self.organization_id})
        if self.region is not None:
            found &= Q(**{f"{prefix}region": self.region})
        return found

    def hourly_price(self, gpu: GPUType) -> Decimal:
        """What one device of `gpu` is quoted per hour here: the own-node price where the
        endpoint requires its own nodes, else its region's where the operator set one, else
        the general one (billing keeps the three from its price versions)."""
        if self.own_nodes_only:
            return gpu.own_node_price_usd
        return self._regional_prices.get(gpu.id, gpu.hourly_price_usd)

    @cached_property
    def _regional_prices(self) -> dict[int, Decimal]:
        if self.region is None:
            return {}
        return dict(RegionalPrice.objects.filter(region=self.region)
                    .values_list("gpu_type_id", "hourly_price_usd"))

    def where(self) -> str:
        """` in <region>` and ` on its own nodes`, as they apply, for a sentence."""
        return ((f" in {self.region.name}" if self.region is not None else "")
                + (" on its organisation's own nodes" if self.own_nodes_only else ""))


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


def nodes_taking_replicas(*, gpu_type: GPUType, placement: Placement) -> QuerySet[Node]:
    """The nodes in `placement` a new replica on `gpu_type` may go to: online and not
    draining."""
    return Node.objects.filter(placement.nodes(), state=NodeState.ONLINE, draining=False,
                               gpu_type=gpu_type)


def largest_share(*, gpu_type: GPUType, gpu_count: int, placement: Placement) -> Room | None:
    """The most any online node of `gpu_type` in `placement` with `gpu_count` GPUs or more
    gives a replica on that many of them for its tiers; None when there is none."""
    shares = [share_of(node, gpu_count=gpu_count)
              for node in nodes_taking_replicas(gpu_type=gpu_type, placement=placement)
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


# A pending replica's stage when no node online could take it even were the node idle (and
# why): the gateway fails the requests held for its endpoint at once rather than at the end of
# the hold. One that waits for a busy node to free its GPUs says "waiting for a node".
UNPLACED_STAGE = "no node"


def do_place_replica(*, replica_id: UUID) -> Node | None:
    """Assign a pending replica to a node and its devices (pending → scheduling).

    Only online nodes that are not draining take it, in the endpoint's placement (Placement). Its
    organisation's own nodes come first (they are its own to fill), then a node whose model
    cache holds the model's weights (its start downloads nothing); then best fit: the node
    with the fewest free devices that still hold the replica, so that large endpoints find
    whole nodes later. CPU endpoints go to the least busy CPU node.
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
                                                placement=Placement.of(endpoint))
                          .select_for_update().order_by("name"))
        held = held_on(candidates)
        nodes = [node for node in candidates
                 if share_of(node, gpu_count=endpoint.gpu_count).holds(needs)
                 and tier_room_left(node, held[node.id]).holds(needs)]
        if endpoint.gpu_type.slug == CPU:
            ranked = sorted(nodes, key=lambda node: (
                node.organization_id is None, not node.holds_weights(endpoint.model),
                sum(replica.state in ON_NODE for replica in held[node.id])))
            choice, devices = (ranked[0], []) if ranked else (None, [])
        else:
            fits = [(node, free) for node in nodes
                    if len(free := free_devices(node, held[node.id])) >= endpoint.gpu_count]
            fits.sort(key=lambda pair: (pair[0].organization_id is None,
                                        not pair[0].holds_weights(endpoint.model), len(pair[1])))
            choice, devices = (fits[0][0], fits[0][1][: endpoint.gpu_count]) if fits else (None, [])
        if choice is None:
            where = ((" of its own" if endpoint.own_nodes_only else "")
                     + (f" in {endpoint.region.slug}" if endpoint.region_id is not None else ""))
            tiers = " and KV room" if needs.host_bytes or needs.disk_bytes else ""
            capable = [node for node in candidates
                       if share_of(node, gpu_count=endpoint.gpu_count).holds(needs)
                       and (not node.devices or len(node.devices) >= endpoint.gpu_count)]
            stage = (f"waiting for a node{where} with {endpoint.gpu_count} free "
                     f"{endpoint.gpu_type.name}{tiers}" if capable else
                     f"{UNPLACED_STAGE}{where} online fits {endpoint.gpu_count} × "
                     f"{endpoint.gpu_type.name}{tiers}")
            Replica.objects.filter(id=replica_id, state=State.PENDING).update(stage=stage[:80])
            return None
        placed = do_transition_replica(
            replica_id=replica_id, from_states=[State.PENDING], to_state=State.SCHEDULING,
            message=f"placed on {choice.name}" + (f" GPUs {devices}" if devices else ""),
            node=choice, device_indices=devices,
        )
        return choice if placed else None
