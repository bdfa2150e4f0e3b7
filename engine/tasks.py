"""Tasks a node agent serves on its own queue, node.<name>. They take replica ids."""

from celery import shared_task

from engine import agent


@shared_task(name="engine.start_replica", ignore_result=True)
def start_replica(replica_id: str) -> None:
    agent.start_replica(replica_id)


# Stopping is idempotent (a stopped replica is left alone), so a redelivery after a crash is safe.
@shared_task(name="engine.stop_replica", ignore_result=True, acks_late=True)
def stop_replica(replica_id: str) -> None:
    agent.stop_replica(replica_id)
