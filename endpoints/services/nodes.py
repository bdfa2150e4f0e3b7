"""Node liveness and draining as the control plane decides them; a node's agent registers
and heartbeats through fleet.reports."""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from endpoints.dispatch import reconcile_after_commit
from endpoints.lifecycle import do_stop_replica
from endpoints.models import Endpoint, Node, NodeState, Replica
from endpoints.states import ON_NODE


def do_mark_lost_nodes() -> int:
    """Mark online or recovering nodes whose heartbeats stopped as lost. Returns how many."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVRUN_NODE_LOST_AFTER_SECONDS)
    return Node.objects.filter(state__in=[NodeState.ONLINE, NodeState.RECOVERING],
                               last_heartbeat_at__lt=cutoff).update(
        state=NodeState.LOST
    )


def do_drain_node(*, node_id: int) -> int:
    """Take no new replicas on the node and move its replicas to other nodes.

    Marks the node draining (scheduling skips it from then on), then stops each replica on it
    the way the reconciler stops one: an event saying the node drains, and the stop sent to
    its agent once that commits; each endpoint's next reconcile places a replacement
    elsewhere. Draining a node that already drains stops whatever is still on it.
    Call it outside a transaction: the mark commits before the replicas are read, so a
    placement that held the node row when it was marked has finished and its replica is moved
    too; and no endpoint row is locked while the node row is held (a reconciler pass locks
    them the other way round). Returns how many replicas it stopped.
    """
    Node.objects.filter(id=node_id, draining=False).update(draining=True)
    name = Node.objects.values_list("name", flat=True).get(id=node_id)
    on_node = Replica.objects.filter(node_id=node_id, state__in=ON_NODE)
    stopped = 0
    for endpoint_id in set(on_node.values_list("endpoint_id", flat=True)):
        with transaction.atomic():
            # The endpoint first, then its replicas, the order a reconciler pass locks them in.
            endpoint = Endpoint.objects.select_for_update().get(id=endpoint_id)
            for replica in on_node.filter(endpoint=endpoint).select_related("node"):
                stopped += do_stop_replica(
                    replica=replica, reason=f"node {name} is draining; moving to another node")
        reconcile_after_commit(endpoint)
    return stopped


def do_undrain_node(*, node_id: int) -> bool:
    """Let scheduling place replicas on the node again; replicas that moved off stay where they
    are. Returns False when the node was not draining."""
    return Node.objects.filter(id=node_id, draining=True).update(draining=False) == 1
