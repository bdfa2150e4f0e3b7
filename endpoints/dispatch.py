"""The one place the control plane tells node agents there is work, and sends reconcile
passes to its own worker.

A node's work is what its replicas' rows say (a replica starting there is to be started,
one stopping to be stopped, a ready one's adapters to be served) and the pulls asked of it;
its agent reads it through the node channel's long poll (fleet.feed). Whatever gives a node
work wakes that poll once the transaction commits, on the Redis channel
node_work_channel(node). A wake that is lost (Redis restarting) costs seconds: the poll
looks again on its own.
"""

import logging

from django.db import transaction
from redis.exceptions import RedisError

from endpoints.models import Endpoint, Node, Replica, State
from kvrun.common.redis import redis_client

logger = logging.getLogger(__name__)

# How long a node may take to come for a pull an operator asked of it.
PULL_WAITS_SECONDS = 3600


def node_work_channel(node_id: int) -> str:
    return f"kvrun:node-work:{node_id}"


def wake_node(node_id: int) -> None:
    """Wake the node's long poll now, if it is waiting. With Redis away the wake is lost,
    and the poll finds the change when it looks again."""
    try:
        redis_client().publish(node_work_channel(node_id), b"1")
    except RedisError:
        logger.warning("node %s was not woken: Redis is unreachable", node_id)


def wake_node_after_commit(*, node: Node) -> None:
    """Once this transaction commits, wake `node`'s agent: its replicas changed."""
    node_id = node.id
    transaction.on_commit(lambda: wake_node(node_id))


def wake_adapter_servers_after_commit(*, endpoint: Endpoint) -> None:
    """Once this transaction commits, wake the agents of `endpoint`'s ready replicas: each
    makes its engine serve exactly the endpoint's adapters. A replica still starting reads
    them itself once it is ready, after this commit (nodes.agent), so none is missed."""
    def wake() -> None:
        for node_id in set(Replica.objects.filter(
                endpoint=endpoint, state=State.READY, node__isnull=False).values_list(
                "node_id", flat=True)):
            wake_node(node_id)
    transaction.on_commit(wake)


def reconcile_after_commit(endpoint: Endpoint) -> None:
    """A reconcile pass over `endpoint` on the control worker, once this transaction commits."""
    # Here, not at the top: endpoints.tasks imports the reconciler, which imports this module.
    from endpoints.tasks import reconcile

    reconcile.delay_on_commit(str(endpoint.id))


def _pulls_key(node_id: int) -> str:
    return f"kvrun:node-pulls:{node_id}"


def request_pull(*, model_id: int, node: Node) -> None:
    """Have `node` download a model's weights into its cache before any replica needs them:
    the pull waits in the node's work (at most PULL_WAITS_SECONDS) until its agent takes it."""
    with redis_client().pipeline() as pipeline:
        pipeline.sadd(_pulls_key(node.id), model_id)
        pipeline.expire(_pulls_key(node.id), PULL_WAITS_SECONDS)
        pipeline.execute()
    wake_node(node.id)


def pulls_for(*, node_id: int) -> list[int]:
    """The models whose pull waits for the node, by id; none while Redis is away (the
    node's replicas' work, in PostgreSQL, still reaches it)."""
    try:
        return sorted(int(model_id) for model_id in redis_client().smembers(_pulls_key(node_id)))
    except RedisError:
        logger.warning("the pulls waiting for node %s could not be read: Redis is unreachable",
                       node_id)
        return []


def take_pull(*, node_id: int, model_id: int) -> bool:
    """Whether a pull of the model waited for the node; taking it ends it (a node has a
    model's token for a pull only once per asking)."""
    return bool(redis_client().srem(_pulls_key(node_id), model_id))
