import logging

from celery import shared_task

from endpoints.reconciler import endpoints_to_reconcile, reconcile_endpoint
from endpoints.services import do_mark_lost_nodes

logger = logging.getLogger(__name__)


@shared_task(name="endpoints.mark_lost_nodes", ignore_result=True)
def mark_lost_nodes() -> None:
    lost = do_mark_lost_nodes()
    if lost:
        logger.warning("%d node(s) stopped sending heartbeats and are now lost", lost)


@shared_task(name="endpoints.reconcile", ignore_result=True)
def reconcile(endpoint_id: str | None = None) -> None:
    """Reconcile one endpoint, or every endpoint that is running or settling."""
    ids = [endpoint_id] if endpoint_id else endpoints_to_reconcile()
    for one in ids:
        reconcile_endpoint(endpoint_id=one)
