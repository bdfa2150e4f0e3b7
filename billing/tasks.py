import logging

from celery import shared_task

from billing.services import do_ingest_usage

logger = logging.getLogger(__name__)


@shared_task(name="billing.ingest_usage", ignore_result=True)
def ingest_usage() -> None:
    """Move gateway usage records into PostgreSQL; safe to run any number of times."""
    handled = do_ingest_usage()
    if handled:
        logger.info("ingested %d usage record(s)", handled)
