from datetime import UTC, datetime

from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

from endpoints.models import BilledPhase


class UsageRecord(models.Model):
    """One request that the gateway admitted to an engine: what it consumed and how it went.

    Part of the billing ledger: rows are written once by the ingester and never updated, but
    for a record stored as interrupted, which its request's later record replaces
    (billing.ingestion.do_record_usage). `request_id` is unique, so a batch delivered twice
    inserts each request once.
    """

    request_id = models.CharField(max_length=40, unique=True)
    idempotency_key = models.CharField(max_length=255, blank=True)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.PROTECT,
                                     related_name="usage_records")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT,
                                 related_name="usage_records")
    replica = models.ForeignKey("endpoints.Replica", null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="usage_records")
    api_key = models.ForeignKey("accounts.APIKey", null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="usage_records")
    operation = models.CharField(max_length=20, help_text="chat.completions, completions, "
                                 "messages, count_tokens, embeddings, score or rerank")
    stream = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0, help_text="Prompt tokens served "
                                                "from the engine's prefix cache.")
    status_code = models.PositiveSmallIntegerField(help_text="What the client got; 499 when "
                                                   "it went away first.")
    error_code = models.CharField(max_length=40, blank=True)
    client_disconnected = models.BooleanField(default=False)
    started_at = models.DateTimeField()
    time_to_first_token_ms = models.PositiveIntegerField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField()
    # Wide enough for any request the gateway can serve (its overhead is at most its whole
    # duration, itself at most 2**31 ms as duration_ms).
    gateway_overhead_ms = models.DecimalField(max_digits=13, decimal_places=3)
    adapter = models.CharField(max_length=63, blank=True, default="",
                               help_text="The LoRA adapter it called; empty for the "
                                         "endpoint's model.")
    ingested_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["organization", "started_at"]),
            models.Index(fields=["endpoint", "started_at"]),
            # The rollup reads an hour of every endpoint at once by it (billing.rollup).
            models.Index(fields=["started_at"], name="billing_usage_started_at"),
        ]

    def __str__(self) -> str:
        return self.request_id


class StaleUsageHour(models.Model):
    """An hour of an endpoint whose token rollup is behind its usage records: written with
    the records (same transaction), taken and deleted by the rollup that brings it up to date,
    in the order of its key (hour, endpoint)."""

    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE,
                                 related_name="+")
    hour = models.DateTimeField()
    marked_at = models.DateTimeField(help_text="When the hour went stale: how long its "
                                               "records have waited for the rollup.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["hour", "endpoint"],
                                               name="billing_stale_usage_hour_key")]


# The most stale hours one batch of the token rollup takes, and the fewest it falls back to.
MAX_ROLLUP_BATCH_HOURS = 10_000
MIN_ROLLUP_BATCH_HOURS = 100


class RollupState(models.Model):
    """How the token rollup takes its stale hours (billing.rollup), and why it last gave up:
    one row. A batch that runs past the statement timeout halves the batch size for the runs
    after it; a run whose every batch took under a quarter of the timeout doubles it back, up
    to MAX_ROLLUP_BATCH_HOURS."""

    batch_hours = models.PositiveIntegerField(default=MAX_ROLLUP_BATCH_HOURS,
                                              help_text="Stale hours a batch takes at most.")
    timed_out_at = models.DateTimeField(null=True, blank=True,
                                        help_text="When a batch last ran past the timeout.")
    timeout_reason = models.TextField(blank=True, help_text="What ran past it, and what "
                                                            "the rollup did then.")

    class Meta:
        verbose_name = "rollup state"

    def __str__(self) -> str:
        return f"batches of {self.batch_hours:,} stale hours"


class TokenHour(models.Model):
    """Requests and tokens of one endpoint and API key in one UTC hour, rolled up from usage
    records. Derived: the rollup rewrites an hour whenever records for it arrive. Its foreign
    keys have no database constraint: the records it comes from hold theirs, and checking
    each line again would cost the rollup a fifth of its time. Nor have they an index of
    their own: the composite ones below lead with organisation and endpoint, no query reads
    lines by key, and each index more costs the rollup about a microsecond a line."""

    hour = models.DateTimeField()
    organization = models.ForeignKey("accounts.Organization", on_delete=models.DO_NOTHING,
                                     related_name="+", db_constraint=False, db_index=False)
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.DO_NOTHING,
                                 related_name="+", db_constraint=False, db_index=False)
    api_key = models.ForeignKey("accounts.APIKey", null=True, blank=True,
                                on_delete=models.DO_NOTHING, related_name="+",
                                db_constraint=False, db_index=False)
    requests = models.BigIntegerField()
    prompt_tokens = models.BigIntegerField()
    completion_tokens = models.BigIntegerField()
    cached_tokens = models.BigIntegerField()
    adapter = models.CharField(max_length=63, blank=True, default="")
    rolled_up_at = models.DateTimeField(help_text="When the rollup last wrote this hour.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "hour", "api_key", "adapter"],
                                               nulls_distinct=False,
                                               name="billing_token_hour_unique")]
        indexes = [models.Index(fields=["organization", "hour"]), models.Index(fields=["hour"])]

    def __str__(self) -> str:
        return f"{self.endpoint_id} {self.hour:%Y-%m-%d %H:00}"


class GPUHour(models.Model):
    """Device-seconds of one endpoint's replicas in one phase and UTC hour, on shared nodes
    or on its organisation's own, rolled up from replica intervals (endpoints.ReplicaInterval),
    with the region that prices them. Derived: the rollup rewrites the hours
    that intervals still open or recently closed touch. Foreign keys unconstrained and
    unindexed, as TokenHour's."""

    hour = models.DateTimeField()
    organization = models.ForeignKey("accounts.Organization", on_delete=models.DO_NOTHING,
                                     related_name="+", db_constraint=False, db_index=False)
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.DO_NOTHING,
                                 related_name="+", db_constraint=False, db_index=False)
    gpu_type = models.ForeignKey("endpoints.GPUType", on_delete=models.DO_NOTHING,
                                 related_name="+", db_constraint=False, db_index=False)
    price_region = models.ForeignKey("endpoints.Region", null=True, blank=True,
                                     on_delete=models.DO_NOTHING, related_name="+",
                                     db_constraint=False, db_index=False)
    own_node = models.BooleanField(default=False)
    phase = models.CharField(max_length=10, choices=BilledPhase.choices)
    gpu_seconds = models.DecimalField(max_digits=18, decimal_places=6,
                                      help_text="Seconds held times devices held, to the "
                                                "microsecond.")
    rolled_up_at = models.DateTimeField(help_text="When the rollup last wrote this hour.")

    class Meta:
        constraints = [models.UniqueConstraint(
            fields=["endpoint", "hour", "gpu_type", "phase", "own_node", "price_region"],
            nulls_distinct=False, name="billing_gpu_hour_unique")]
        indexes = [models.Index(fields=["organization", "hour"]), models.Index(fields=["hour"])]

    def __str__(self) -> str:
        return f"{self.endpoint_id} {self.phase} {self.hour:%Y-%m-%d %H:00}"


def validate_price_start(effective_from: datetime) -> None:
    """A new price starts at a whole UTC hour from now on: the hours already run, billed or
    not, keep the price they ran at."""
    if effective_from is None:
        return
    if effective_from.astimezone(UTC).replace(minute=0, second=0, microsecond=0) != effective_from:
        raise ValidationError({"effective_from": "A price takes effect at the start of a UTC "
                                                 "hour, such as 2027-01-01 00:00 UTC."})
    if effective_from < timezone.now():
        raise ValidationError({"effective_from": "A new price cannot start in the past: hours "
                                                 "already run keep their price. Pick a time "
                                                 "from the next hour on."})


class GPUPrice(models.Model):
    """What one device of a GPU type costs per hour from `effective_from` on, until the next
    version of the same scope. Versions are added, never changed, so a past hour keeps the
    price it ran at.

    Scopes: the general price (no region); a region's own, which endpoints requiring that
    region pay from its first version on; and the price on an organisation's own nodes,
    zero until an operator sets one."""

    gpu_type = models.ForeignKey("endpoints.GPUType", on_delete=models.PROTECT,
                                 related_name="prices")
    region = models.ForeignKey("endpoints.Region", null=True, blank=True,
                               on_delete=models.PROTECT, related_name="+",
                               help_text="Empty: the general price, or the own-node price.")
    own_nodes = models.BooleanField(default=False, verbose_name="on organisations' own nodes")
    hourly_price_usd = models.DecimalField(max_digits=10, decimal_places=4)
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "GPU price"
        ordering = ["gpu_type", "own_nodes", "region", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["gpu_type", "own_nodes", "region", "effective_from"],
                                    nulls_distinct=False, name="billing_gpu_price_unique_start"),
            models.CheckConstraint(condition=models.Q(hourly_price_usd__gte=0),
                                   name="billing_gpu_price_not_negative"),
            models.CheckConstraint(
                condition=models.Q(own_nodes=False) | models.Q(region=None),
                name="billing_gpu_price_own_nodes_everywhere",
                violation_error_message="The price on organisations' own nodes is one for "
                                        "every region: leave the region empty."),
        ]

    def __str__(self) -> str:
        scope = (" on own nodes" if self.own_nodes else
                 f" in {self.region}" if self.region_id is not None else "")
        return (f"{self.gpu_type}{scope} ${self.hourly_price_usd}/h "
                f"from {self.effective_from:%Y-%m-%d %H:%M}")

    def clean(self) -> None:
        validate_price_start(self.effective_from)


class TokenPrice(models.Model):
    """Optional prices per million tokens of a model, on top of GPU time, from
    `effective_from` on. Prompt tokens served from the prefix cache pay the cached price."""

    model = models.ForeignKey("endpoints.ModelSpec", on_delete=models.PROTECT,
                              related_name="token_prices")
    prompt_per_million_usd = models.DecimalField(max_digits=10, decimal_places=4, default=0)
    completion_per_million_usd = models.DecimalField(max_digits=10, decimal_places=4, default=0)
    cached_per_million_usd = models.DecimalField(max_digits=10, decimal_places=4, default=0)
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["model", "effective_from"],
                                    name="billing_token_price_unique_start"),
            models.CheckConstraint(
                condition=models.Q(prompt_per_million_usd__gte=0,
                                   completion_per_million_usd__gte=0,
                                   cached_per_million_usd__gte=0),
                name="billing_token_price_not_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.model} tokens from {self.effective_from:%Y-%m-%d %H:%M}"

    def clean(self) -> None:
        validate_price_start(self.effective_from)


class PaymentStatus(models.TextChoices):
    UNSENT = "unsent", "not sent to Stripe"
    OPEN = "open", "awaiting payment"
    PAID = "paid", "paid"
    FAILED = "failed", "payment failed"


class Invoice(models.Model):
    """An organisation's finalised bill for one calendar month (UTC). The open month, and a
    month in its grace period, are drafts computed from the rollups (billing.invoicing) and
    stored only when finalised: the row and its lines are then never changed."""

    organization = models.ForeignKey("accounts.Organization", on_delete=models.PROTECT,
                                     related_name="invoices")
    month = models.DateField(help_text="The first day of the month billed.")
    number = models.CharField(max_length=80, unique=True)  # KVR-YYYYMM-<slug>
    currency = models.CharField(max_length=3, default="usd")
    total_cents = models.BigIntegerField()
    finalized_at = models.DateTimeField()
    # How it is paid, as Stripe last said (billing.payments): the only fields that change.
    stripe_invoice_id = models.CharField(max_length=80, blank=True)
    payment_status = models.CharField(max_length=10, choices=PaymentStatus.choices,
                                      default=PaymentStatus.UNSENT)

    class Meta:
        ordering = ["-month"]
        constraints = [models.UniqueConstraint(fields=["organization", "month"],
                                               name="billing_invoice_one_per_month")]

    def __str__(self) -> str:
        return self.number


class LineKind(models.TextChoices):
    GPU_TIME = "gpu_time", "GPU time"
    PROMPT_TOKENS = "prompt_tokens", "prompt tokens"
    CACHED_TOKENS = "cached_tokens", "cached prompt tokens"
    COMPLETION_TOKENS = "completion_tokens", "completion tokens"
    # The prompt tokens of an embedding model's, or a scoring model's, endpoint: its inputs.
    EMBEDDED_TOKENS = "embedded_tokens", "embedded tokens"
    SCORED_TOKENS = "scored_tokens", "scored tokens"


class InvoiceLine(models.Model):
    """One priced quantity of a finalised invoice: GPU time of an endpoint's GPU type and
    phase, or one kind of its tokens, at one unit price, over [period_start, period_end).
    An adjustment line bills usage of an earlier, already finalised `usage_month` that
    arrived after it was finalised. Never changed."""

    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="lines")
    kind = models.CharField(max_length=20, choices=LineKind.choices)
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT,
                                 related_name="+")
    adapter = models.CharField(max_length=63, blank=True, default="",
                               help_text="The LoRA adapter whose tokens a token line bills.")
    gpu_type = models.ForeignKey("endpoints.GPUType", null=True, blank=True,
                                 on_delete=models.PROTECT, related_name="+")
    phase = models.CharField(max_length=10, blank=True, choices=BilledPhase.choices)
    own_node = models.BooleanField(default=False, help_text="GPU time on the organisation's "
                                                            "own nodes.")
    usage_month = models.DateField()
    adjustment = models.BooleanField(default=False)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    description = models.CharField(max_length=200)
    quantity = models.DecimalField(max_digits=20, decimal_places=6)
    unit = models.CharField(max_length=20, help_text="GPU-hour or 1M tokens")
    unit_price_usd = models.DecimalField(max_digits=10, decimal_places=4)
    amount_cents = models.BigIntegerField()

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["endpoint", "usage_month"])]

    def __str__(self) -> str:
        return self.description


class BudgetAction(models.TextChoices):
    ALERT = "alert", "alert only"
    STOP = "stop", "stop the endpoints"


# A handful: each threshold is an alert, and an event each month it is crossed.
MAX_BUDGET_THRESHOLDS = 10


def default_thresholds() -> list[int]:
    return [50, 80, 100]


class Budget(models.Model):
    """An organisation's monthly spend cap: an event at each threshold (a percentage of the
    limit) the month's projected spend crosses, and at 100 % either that alone or its
    endpoints stopped until the budget is raised or the month ends."""

    organization = models.OneToOneField("accounts.Organization", on_delete=models.CASCADE,
                                        related_name="budget")
    monthly_limit_cents = models.PositiveBigIntegerField()
    thresholds = ArrayField(models.PositiveSmallIntegerField(), default=default_thresholds,
                            help_text="Percentages of the limit, such as 50, 80, 100.")
    action = models.CharField(max_length=10, choices=BudgetAction.choices,
                              default=BudgetAction.ALERT)
    # The month, and the limit, for which it stopped the organisation's endpoints: they stay
    # stopped for that month while the limit is unchanged, though the spend no longer grows.
    stopped_month = models.DateField(null=True, blank=True)
    stopped_limit_cents = models.PositiveBigIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.organization}: {self.monthly_limit_cents} cents a month"

    def clean(self) -> None:
        if self.monthly_limit_cents is not None and self.monthly_limit_cents < 1:
            raise ValidationError({"monthly_limit_cents": "Set a limit of at least $0.01."})
        if (not self.thresholds or len(set(self.thresholds)) > MAX_BUDGET_THRESHOLDS
                or any(not 1 <= threshold <= 1000 for threshold in self.thresholds)):
            raise ValidationError({"thresholds": (
                f"Give one to {MAX_BUDGET_THRESHOLDS} percentages of the limit, each from 1 to "
                "1000, such as 50, 80, 100.")})


class BudgetEvent(models.Model):
    """A threshold of a budget's limit crossed in a month: recorded once (unique), never
    changed. A limit changed in the month is crossed, and recorded, afresh."""

    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE,
                                     related_name="budget_events")
    month = models.DateField()
    threshold = models.PositiveSmallIntegerField()
    limit_cents = models.BigIntegerField()
    spend_cents = models.BigIntegerField(help_text="The month's spend when it was crossed.")
    projected_cents = models.BigIntegerField(help_text="What the check projected to its next "
                                                       "run.")
    stopped = models.BooleanField(default=False,
                                  help_text="Whether the organisation's endpoints were stopped.")
    at = models.DateTimeField()

    class Meta:
        ordering = ["-at"]
        constraints = [models.UniqueConstraint(
            fields=["organization", "month", "limit_cents", "threshold"],
            name="billing_budget_event_once")]

    def __str__(self) -> str:
        return f"{self.organization} {self.month:%Y-%m} {self.threshold} %"


class BillingAccount(models.Model):
    """An organisation's side of Stripe: its customer, and since when a payment has failed."""

    organization = models.OneToOneField("accounts.Organization", on_delete=models.CASCADE,
                                        related_name="billing_account")
    stripe_customer_id = models.CharField(max_length=80, blank=True)
    stripe_subscription_id = models.CharField(max_length=80, blank=True)
    payment_method = models.CharField(max_length=80, blank=True,
                                      help_text="What the customer sees, such as visa …4242.")
    delinquent_since = models.DateTimeField(null=True, blank=True)
    delinquent_reason = models.TextField(blank=True)

    def __str__(self) -> str:
        return f"{self.organization}: {self.stripe_customer_id or 'no customer'}"


class StripeEvent(models.Model):
    """One webhook delivery from Stripe, stored before it is handled; a delivery of an event
    already stored changes nothing (unique id)."""

    stripe_id = models.CharField(max_length=80, unique=True)
    type = models.CharField(max_length=80)
    payload = models.JSONField()
    received_at = models.DateTimeField(auto_now_add=True)
    handled_at = models.DateTimeField(null=True, blank=True)
    outcome = models.TextField(blank=True, help_text="What handling it did, or why it failed.")

    class Meta:
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.type} {self.stripe_id}"
