from django.apps import AppConfig


class BillingConfig(AppConfig):
    """Usage records, GPU-second metering, invoices and Stripe (filled by the billing work)."""

    name = "billing"
    verbose_name = "Billing"
