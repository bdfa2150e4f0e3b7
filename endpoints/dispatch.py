"""The one place the control plane sends work: to node agents, and reconcile passes to its
own worker.

A node agent serves the Celery queue `Node.queue` with the tasks named here (nodes.tasks);
they are sent by name because endpoints/ does not import the agent. Each is sent once the
transition that asked for it has committed, and takes only the replica's id (a pull, the
model's).
"""

from celery import current_app
from django.db import transaction

from endpoints.models import Endpoint, Node, Replica, State

START_REPLICA = "engine.start_replica"
STOP_REPLICA = "engine.stop_replica"
PULL_MODEL = "engine.pull_model"
SYNC_ADAPTERS = "engine.sync_adapters"


def send_start_after_commit(*, replica: Replica, node: Node) -> None:
    _send_after_commit(START_REPLICA, replica=replica, node=node)


def send_stop_after_commit(*, replica: Replica, node: Node) -> None:
    _send_after_commit(STOP_REPLICA, replica=replica, node=node)


def _send_after_commit(task: str, *, replica: Replica, node: Node) -> None:
    replica_id, queue = str(replica.id), node.queue
    transaction.on_commit(lambda: current_app.send_task(task, args=[replica_id], queue=queue))


def send_adapter_change_after_commit(*, endpoint: Endpoint) -> None:
    """Once this transaction commits, have each ready replica of `endpoint` serve exactly its
    adapters. A replica still starting reads them itself once it is ready, after this commit
    (nodes.agent), so none is missed between the two."""
    def send() -> None:
        for replica in Replica.objects.filter(endpoint=endpoint, state=State.READY,
                                              node__isnull=False).select_related("node"):
            assert replica.node is not None
            current_app.send_task(SYNC_ADAPTERS, args=[str(replica.id)],
                                  queue=replica.node.queue)
    transaction.on_commit(send)


def reconcile_after_commit(endpoint: Endpoint) -> None:
    """A reconcile pass over `endpoint` on the control worker, once this transaction commits."""
    # Here, not at the top: endpoints.tasks imports the reconciler, which imports this module.
    from endpoints.tasks import reconcile

    reconcile.delay_on_commit(str(endpoint.id))


def send_pull(*, model_id: int, node: Node) -> None:
    """Have `node` download a model's weights into its cache before any replica needs them."""
    current_app.send_task(PULL_MODEL, args=[model_id], queue=node.queue)
