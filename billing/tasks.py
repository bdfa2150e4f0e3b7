import logging

from celery import shared_task
from django.utils import timezone

from billing import payments
from billing.budgets import do_enforce_budgets
from billing.ingestion import do_ingest_usage
from billing.invoicing import do_finalize_due_invoices
from billing.models import Invoice, PaymentStatus
from billing.rollup import do_quote_prices_in_effect, do_roll_up_usage

logger = logging.getLogger(__name__)


@shared_task(name="billing.ingest_usage", ignore_result=True)
def ingest_usage() -> None:
    """Move gateway usage records into PostgreSQL; safe to run any number of times."""
    handled = do_ingest_usage()
    if handled:
        logger.info("ingested %d usage record(s)", handled)


@shared_task(name="billing.roll_up_usage", ignore_result=True)
def roll_up_usage() -> None:
    """Bring the hourly token and GPU-time lines up to date, and the prices quoted to the
    versions in effect; safe to run any number of times."""
    repriced = do_quote_prices_in_effect(now=timezone.now())
    if repriced:
        logger.info("%d endpoint(s) quote a new price in effect", repriced)
    rollup = do_roll_up_usage()
    if rollup is not None:
        logger.info("rolled up %d usage hour(s) in %.3f s, wrote %d GPU-hour line(s) in %.3f s",
                    rollup.token_hours, rollup.token_seconds, rollup.gpu_hours,
                    rollup.gpu_seconds)


@shared_task(name="billing.finalize_invoices", ignore_result=True)
def finalize_invoices() -> None:
    """Finalise the invoices of months past their grace period, from up-to-date rollups, and
    send every finalised invoice not yet sent to Stripe."""
    do_roll_up_usage()
    finalized = do_finalize_due_invoices()
    if finalized:
        logger.info("finalised %d invoice(s)", finalized)
    if payments.configured():
        for invoice_id in Invoice.objects.filter(payment_status=PaymentStatus.UNSENT
                                                 ).values_list("id", flat=True):
            push_invoice.delay(invoice_id)


@shared_task(name="billing.push_invoice", ignore_result=True,
             autoretry_for=(payments.StripeUnavailable,), max_retries=5, retry_backoff=30)
def push_invoice(invoice_id: int) -> None:
    """Send one finalised invoice to Stripe and charge it; returns quietly if it is gone."""
    payments.do_push_invoice(invoice_id=invoice_id)


@shared_task(name="billing.enforce_budgets", ignore_result=True)
def enforce_budgets() -> None:
    """Check every budget against the month's spend, rolled up just before."""
    do_roll_up_usage()
    events = do_enforce_budgets()
    if events:
        logger.info("%d budget threshold(s) crossed", events)


@shared_task(name="billing.prune_stripe_events", ignore_result=True)
def prune_stripe_events() -> None:
    """Delete the stored webhook deliveries past their retention."""
    pruned = payments.do_prune_stripe_events(now=timezone.now())
    if pruned:
        logger.info("pruned %d stored Stripe event(s)", pruned)
