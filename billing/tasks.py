import logging

from celery import shared_task

from billing.budgets import do_enforce_budgets
from billing.invoicing import do_finalize_due_invoices
from billing.rollup import do_roll_up_usage
from billing.services import do_ingest_usage

logger = logging.getLogger(__name__)


@shared_task(name="billing.ingest_usage", ignore_result=True)
def ingest_usage() -> None:
    """Move gateway usage records into PostgreSQL; safe to run any number of times."""
    handled = do_ingest_usage()
    if handled:
        logger.info("ingested %d usage record(s)", handled)


@shared_task(name="billing.roll_up_usage", ignore_result=True)
def roll_up_usage() -> None:
    """Bring the hourly token and GPU-time lines up to date; safe to run any number of times."""
    rollup = do_roll_up_usage()
    if rollup is not None:
        logger.info("rolled up %d usage hour(s), wrote %d GPU-hour line(s)", rollup.token_hours,
                    rollup.gpu_hours)


@shared_task(name="billing.finalize_invoices", ignore_result=True)
def finalize_invoices() -> None:
    """Finalise the invoices of months past their grace period, from up-to-date rollups."""
    do_roll_up_usage()
    finalized = do_finalize_due_invoices()
    if finalized:
        logger.info("finalised %d invoice(s)", finalized)


@shared_task(name="billing.enforce_budgets", ignore_result=True)
def enforce_budgets() -> None:
    """Check every budget against the month's spend, rolled up just before."""
    do_roll_up_usage()
    events = do_enforce_budgets()
    if events:
        logger.info("%d budget threshold(s) crossed", events)
