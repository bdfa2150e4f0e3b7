from django.apps import AppConfig


class BillingConfig(AppConfig):
    """Usage records and their ingestion; GPU-second metering, invoices and Stripe next."""

    name = "billing"
    verbose_name = "Billing"

    def ready(self) -> None:
        from billing import checks  # noqa: F401  registers the deployment checks
