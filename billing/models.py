from django.db import models

from endpoints.models import BilledPhase


class UsageRecord(models.Model):
    """One request that the gateway admitted to an engine: what it consumed and how it went.

    Part of the billing ledger: rows are written once by the ingester and never updated.
    `request_id` is unique, so a batch delivered twice inserts each request once.
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
    operation = models.CharField(max_length=20, help_text="chat.completions or completions")
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
    ingested_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["organization", "started_at"]),
            models.Index(fields=["endpoint", "started_at"]),
        ]

    def __str__(self) -> str:
        return self.request_id


class StaleUsageHour(models.Model):
    """An hour of an endpoint whose token rollup is behind its usage records: written with
    the records (same transaction), taken and deleted by the rollup that brings it up to date."""

    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE,
                                 related_name="+")
    hour = models.DateTimeField()
    marked_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "hour"],
                                               name="billing_stale_usage_hour_unique")]


class TokenHour(models.Model):
    """Requests and tokens of one endpoint and API key in one UTC hour, rolled up from usage
    records. Derived: the rollup rewrites an hour whenever records for it arrive."""

    hour = models.DateTimeField()
    organization = models.ForeignKey("accounts.Organization", on_delete=models.PROTECT,
                                     related_name="+")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT,
                                 related_name="+")
    api_key = models.ForeignKey("accounts.APIKey", null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="+")
    requests = models.BigIntegerField()
    prompt_tokens = models.BigIntegerField()
    completion_tokens = models.BigIntegerField()
    cached_tokens = models.BigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "hour", "api_key"],
                                               nulls_distinct=False,
                                               name="billing_token_hour_unique")]
        indexes = [models.Index(fields=["organization", "hour"])]

    def __str__(self) -> str:
        return f"{self.endpoint_id} {self.hour:%Y-%m-%d %H:00}"


class GPUHour(models.Model):
    """Device-seconds of one endpoint's replicas in one phase and UTC hour, rolled up from
    replica intervals (endpoints.ReplicaInterval). Derived: the rollup rewrites the hours
    that intervals still open or recently closed touch."""

    hour = models.DateTimeField()
    organization = models.ForeignKey("accounts.Organization", on_delete=models.PROTECT,
                                     related_name="+")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT,
                                 related_name="+")
    gpu_type = models.ForeignKey("endpoints.GPUType", on_delete=models.PROTECT,
                                 related_name="+")
    phase = models.CharField(max_length=10, choices=BilledPhase.choices)
    gpu_seconds = models.DecimalField(max_digits=18, decimal_places=6,
                                      help_text="Seconds held times devices held, to the "
                                                "microsecond.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "hour", "gpu_type", "phase"],
                                               name="billing_gpu_hour_unique")]
        indexes = [models.Index(fields=["organization", "hour"]), models.Index(fields=["hour"])]

    def __str__(self) -> str:
        return f"{self.endpoint_id} {self.phase} {self.hour:%Y-%m-%d %H:00}"
