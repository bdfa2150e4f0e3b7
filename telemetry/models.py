from datetime import timedelta

from django.db import models

# Samples as scraped (every KVRUN_ENGINE_SCRAPE_SECONDS) are kept for RAW_KEPT, then one per
# minute until MINUTE_KEPT, one per hour until HOUR_KEPT, then none.
RAW_KEPT = timedelta(hours=2)
MINUTE_KEPT = timedelta(days=3)
HOUR_KEPT = timedelta(days=90)


class EngineSample(models.Model):
    """One scrape of a replica's engine /metrics (engine.metrics.EngineSnapshot).

    Counters and histogram buckets are the engine's cumulative totals, as it reports them;
    rates are the differences between a replica's consecutive samples (selectors), so that
    no chart ever divides lifetime totals. Old samples are thinned to one per minute and
    then one per hour (services.do_downsample_samples): the last sample of each, which keeps
    every counter exact, with the peak of its gauges over the span it stands for.
    """

    replica = models.ForeignKey("endpoints.Replica", on_delete=models.CASCADE,
                                related_name="+", db_index=False)
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE,
                                 related_name="+", db_index=False)
    at = models.DateTimeField()
    resolution_seconds = models.PositiveIntegerField(
        default=0, help_text="0 as scraped; 60 or 3600 once it stands for its minute or hour.")
    kv_cache_usage = models.FloatField(help_text="Share of KV cache blocks in use, 0 to 1.")
    running = models.PositiveIntegerField()
    waiting = models.PositiveIntegerField()
    prefix_queries = models.BigIntegerField()
    prefix_hits = models.BigIntegerField()
    external_queries = models.BigIntegerField(null=True, blank=True,
                                              help_text="A KV connector's tier, if any.")
    external_hits = models.BigIntegerField(null=True, blank=True)
    preemptions = models.BigIntegerField()
    prompt_tokens = models.BigIntegerField()
    generation_tokens = models.BigIntegerField()
    requests = models.BigIntegerField()
    ttft_buckets = models.JSONField(default=dict, help_text="Time to first token: cumulative "
                                                            "count per bucket bound (s).")
    itl_buckets = models.JSONField(default=dict, help_text="Inter-token latency, likewise.")
    prompt_buckets = models.JSONField(default=dict, help_text="Prompt tokens per request, "
                                                              "likewise.")
    max_tokens_buckets = models.JSONField(
        default=dict, help_text="The max_tokens of each request (asked, or what its context "
                                "left it), likewise.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["replica", "at"],
                                               name="telemetry_sample_once_per_moment")]
        indexes = [models.Index(fields=["endpoint", "at"]),
                   models.Index(fields=["resolution_seconds", "at"])]

    def __str__(self) -> str:
        return f"{self.replica_id} at {self.at:%Y-%m-%d %H:%M:%S}"


class AdviceKind(models.TextChoices):
    CACHE_BOUND = "cache_bound", "cache-bound"
    CONTEXT_OVERSIZED = "context_oversized", "context budget far above the prompts"


class Advice(models.Model):
    """A change that an endpoint's measured figures call for (telemetry.advice): open while
    its condition holds, at most one open of each kind per endpoint. `change` is a KV policy
    change that applies it in one click, or empty where it needs a person (another GPU)."""

    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE,
                                 related_name="advice")
    kind = models.CharField(max_length=20, choices=AdviceKind.choices)
    message = models.TextField()
    figures = models.JSONField(help_text="The measurements behind it.")
    change = models.JSONField(default=dict, blank=True)
    opened_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at"]
        verbose_name_plural = "advice"
        constraints = [models.UniqueConstraint(fields=["endpoint", "kind"],
                                               condition=models.Q(resolved_at=None),
                                               name="telemetry_advice_one_open_per_kind")]

    def __str__(self) -> str:
        return f"{self.endpoint_id} {self.kind}"

    @property
    def change_text(self) -> str:
        """The change in words, for its button: "kv cache dtype fp8"."""
        return ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in self.change.items())
