"""Tasks a node agent serves on its own queue, node.<name> (endpoints.dispatch sends them).
They take replica ids, or a model's id."""

from celery import shared_task

from endpoints.dispatch import PULL_MODEL, START_REPLICA, STOP_REPLICA, SYNC_ADAPTERS
from nodes import agent


@shared_task(name=START_REPLICA, ignore_result=True)
def start_replica(replica_id: str) -> None:
    agent.serving().start_replica(replica_id)


# Stopping is idempotent (a stopped replica is left alone), so a redelivery after a crash is safe.
@shared_task(name=STOP_REPLICA, ignore_result=True, acks_late=True)
def stop_replica(replica_id: str) -> None:
    agent.serving().stop_replica(replica_id)


# A pull of a model already cached downloads nothing, so a redelivery is harmless.
@shared_task(name=PULL_MODEL, ignore_result=True, acks_late=True)
def pull_model(model_id: int) -> None:
    agent.serving().pull_model(model_id)


# Makes the engine serve exactly its endpoint's adapters now, whatever came before: safe to
# deliver twice or late.
@shared_task(name=SYNC_ADAPTERS, ignore_result=True, acks_late=True)
def sync_adapters(replica_id: str) -> None:
    agent.serving().sync_adapters(replica_id)
