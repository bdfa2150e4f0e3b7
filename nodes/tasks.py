"""Tasks a node agent serves on its own queue, node.<name> (endpoints.dispatch sends them).
They take replica ids."""

from celery import shared_task

from endpoints.dispatch import START_REPLICA, STOP_REPLICA
from nodes import agent


@shared_task(name=START_REPLICA, ignore_result=True)
def start_replica(replica_id: str) -> None:
    agent.serving().start_replica(replica_id)


# Stopping is idempotent (a stopped replica is left alone), so a redelivery after a crash is safe.
@shared_task(name=STOP_REPLICA, ignore_result=True, acks_late=True)
def stop_replica(replica_id: str) -> None:
    agent.serving().stop_replica(replica_id)
