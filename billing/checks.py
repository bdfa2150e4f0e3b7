"""Deployment checks of billing's settings (`manage.py check --deploy`)."""

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register

# How long Stripe retries a webhook delivery it could not hand over.
STRIPE_RETRY_DAYS = 3


@register(Tags.security, deploy=True)
def check_stripe_configured_whole(app_configs: Any, **kwargs: Any) -> list[Error]:
    """Stripe takes both its secret key and the webhook's signing secret, or neither: with
    the key alone invoices are charged but payments and cancellations never come back; with
    the webhook secret alone deliveries would be taken for an account kvrun cannot ask."""
    key, secret = bool(settings.STRIPE_SECRET_KEY), bool(settings.STRIPE_WEBHOOK_SECRET)
    if key == secret:
        return []
    missing, present = (("STRIPE_WEBHOOK_SECRET", "STRIPE_SECRET_KEY") if key
                        else ("STRIPE_SECRET_KEY", "STRIPE_WEBHOOK_SECRET"))
    return [Error(f"Stripe is half configured: {present} is set and {missing} is not.",
                  hint=f"Set {missing} too (docs/billing.md, \"Payments\"), or unset {present} "
                       "to keep invoices in kvrun only.",
                  id="kvrun.billing.E001")]


@register(Tags.compatibility)
def check_stripe_event_retention(app_configs: Any, **kwargs: Any) -> list[Error]:
    """Stored deliveries outlive Stripe's retries (three days), or a delivery retried after
    its row was pruned would be handled a second time."""
    if settings.KVRUN_STRIPE_EVENT_KEPT_DAYS >= STRIPE_RETRY_DAYS:
        return []
    return [Error(f"KVRUN_STRIPE_EVENT_KEPT_DAYS is {settings.KVRUN_STRIPE_EVENT_KEPT_DAYS}; "
                  f"Stripe retries a delivery for {STRIPE_RETRY_DAYS} days.",
                  hint=f"Keep deliveries at least {STRIPE_RETRY_DAYS} days (90 by default).",
                  id="kvrun.billing.E002")]
