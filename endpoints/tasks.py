import logging

from celery import shared_task

from endpoints.services import do_mark_lost_nodes

logger = logging.getLogger(__name__)


@shared_task(name="endpoints.mark_lost_nodes", ignore_result=True)
def mark_lost_nodes() -> None:
    lost = do_mark_lost_nodes()
    if lost:
        logger.warning("%d node(s) stopped sending heartbeats and are now lost", lost)
