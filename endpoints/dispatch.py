"""The one place the control plane sends work: to node agents, and reconcile passes to its
own worker.

A node agent serves the Celery queue `Node.queue` with the tasks named here (nodes.tasks);
they are sent by name because endpoints/ does not import the agent. Each is sent once the
transition that asked for it has committed, and takes only the replica's id (a pull, the
model's).
"""

from celery import current_app
from django.db import transaction

from endpoints.models import Endpoint, Node, Replica

START_REPLICA = "engine.start_replica"
STOP_REPLICA = "engine.stop_replica"
PULL_MODEL = "engine.pull_model"


def send_start_after_commit(*, replica: Replica, node: Node) -> None:
    _send_after_commit(START_REPLICA, replica=replica, node=node)


def send_stop_after_commit(*, replica: Replica, node: Node) -> None:
    _send_after_commit(STOP_REPLICA, replica=replica, node=node)


def _send_after_commit(task: str, *, replica: Replica, node: Node) -> None:
    replica_id, queue = str(replica.id), node.queue
    transaction.on_commit(lambda: current_app.send_task(task, args=[replica_id], queue=queue))


def reconcile_after_commit(endpoint: Endpoint) -> None:
    """A reconcile pass over `endpoint` on the control worker, once this transaction commits."""
    # Here, not at the top: endpoints.tasks imports the reconciler, which imports this module.
    from endpoints.tasks import reconcile

    reconcile.delay_on_commit(str(endpoint.id))


def send_pull(*, model_id: int, node: Node) -> None:
    """Have `node` download a model's weights into its cache before any replica needs them."""
    current_app.send_task(PULL_MODEL, args=[model_id], queue=node.queue)
