"""Reads of engine samples as the charts and the advice need them: per-interval rates from
consecutive samples of each replica, summed over replicas into even time steps."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from uuid import UUID

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from engine.metrics import quantile
from telemetry.models import EngineSample

POINTS_PER_CHART = 120
USAGE_HIGH = 0.9  # a KV cache this full has little room for new requests or kept prefixes
COUNTERS = ("prefix_queries", "prefix_hits", "external_queries", "external_hits",
            "preemptions", "prompt_tokens", "generation_tokens", "requests")
# Counters that every engine's life moves: one that went down is a restart.
RESETS = ("requests", "prompt_tokens", "generation_tokens")


@dataclass
class _Step:
    deltas: dict = field(default_factory=lambda: defaultdict(float))
    ttft: dict = field(default_factory=lambda: defaultdict(float))
    itl: dict = field(default_factory=lambda: defaultdict(float))
    prompts: dict = field(default_factory=lambda: defaultdict(float))
    max_tokens: dict = field(default_factory=lambda: defaultdict(float))
    usage: list = field(default_factory=list)  # (replica, kv usage)
    running: dict = field(default_factory=dict)  # replica → its latest gauge in the step
    waiting: dict = field(default_factory=dict)


def series(*, endpoint_id: UUID, since: datetime, until: datetime,
           replica_id: UUID | None = None, steps: int = POINTS_PER_CHART
           ) -> tuple[int, list[dict]]:
    """(step seconds, points) over [since, until): each point the step's rates and gauges,
    over the endpoint's replicas or the one asked. Hit rates are hits over lookups in the
    step; tokens and requests per second; preemptions counted; latency percentiles from the
    histograms' bucket increases; KV usage the busiest replica's peak; running and waiting
    summed over replicas; the share of samples with the KV cache at least USAGE_HIGH full, and
    the 99th percentile of prompt lengths. A step is a whole number of sampling periods (a
    scrape's, or the minute or hour that thinned samples stand for, as old as the window
    reaches), so that every step holds as many samples; steps without samples are left out,
    and so is a step that samples are still arriving in, which would read low. With
    `steps=1`, one point sums up the whole window."""
    scrape = math.ceil(settings.KVRUN_ENGINE_SCRAPE_SECONDS)
    window = EngineSample.objects.filter(endpoint_id=endpoint_id, at__lt=until)
    if replica_id is not None:
        window = window.filter(replica_id=replica_id)
    # Thinned samples stand for a minute or an hour each: every step holds whole ones.
    thinned = window.filter(at__gte=since).aggregate(most=Max("resolution_seconds"))["most"]
    unit = math.lcm(scrape, thinned or scrape)
    step = unit * max(1, math.ceil((until - since).total_seconds() / steps / unit))
    complete_until = timezone.now() - timedelta(seconds=scrape)
    samples = window.filter(at__gte=since - timedelta(seconds=step)).order_by("replica_id", "at")
    buckets: dict[int, _Step] = defaultdict(_Step)
    previous: EngineSample | None = None
    for sample in samples.iterator(chunk_size=2000):
        if sample.at >= since:
            bucket = buckets[int((sample.at - since).total_seconds()) // step]
            bucket.usage.append(sample.kv_cache_usage)
            bucket.running[sample.replica_id] = sample.running
            bucket.waiting[sample.replica_id] = sample.waiting
            if previous is not None and previous.replica_id == sample.replica_id:
                _add_increase(bucket, previous, sample)
        previous = sample
    ends = {index: since + timedelta(seconds=(index + 1) * step) for index in buckets}
    return step, [_point(ends[index], buckets[index], step) for index in sorted(buckets)
                  if steps == 1 or ends[index] <= complete_until]


def _increase(before: float | None, after: float | None) -> float:
    """A counter's increase; a counter that went down was reset (the engine restarted)."""
    if after is None:
        return 0.0
    if before is None or after < before:
        return float(after)
    return float(after - before)


def _add_increase(bucket: _Step, before: EngineSample, after: EngineSample) -> None:
    for name in COUNTERS:
        bucket.deltas[name] += _increase(getattr(before, name), getattr(after, name))
    bucket.deltas["has_external"] += after.external_queries is not None
    for histogram, into in (("ttft_buckets", bucket.ttft), ("itl_buckets", bucket.itl),
                            ("prompt_buckets", bucket.prompts),
                            ("max_tokens_buckets", bucket.max_tokens)):
        old, new = getattr(before, histogram), getattr(after, histogram)
        for bound, count in new.items():
            into[bound] += _increase(old.get(bound), count)


def _point(at: datetime, bucket: _Step, step: int) -> dict:
    deltas = bucket.deltas
    return {
        "at": at,
        "kv_cache_usage": max(bucket.usage) if bucket.usage else None,
        "kv_cache_high_share": (sum(usage >= USAGE_HIGH for usage in bucket.usage)
                                / len(bucket.usage) if bucket.usage else None),
        "running": sum(bucket.running.values()),
        "waiting": sum(bucket.waiting.values()),
        "prefix_hit_rate": _ratio(deltas["prefix_hits"], deltas["prefix_queries"]),
        "external_hit_rate": (_ratio(deltas["external_hits"], deltas["external_queries"])
                              if deltas["has_external"] else None),
        "preemptions": int(deltas["preemptions"]),
        "prompt_tokens_per_s": deltas["prompt_tokens"] / step,
        "generation_tokens_per_s": deltas["generation_tokens"] / step,
        "requests_per_s": deltas["requests"] / step,
        "ttft_p50_s": quantile(0.5, bucket.ttft), "ttft_p95_s": quantile(0.95, bucket.ttft),
        "itl_p50_s": quantile(0.5, bucket.itl), "itl_p95_s": quantile(0.95, bucket.itl),
        "prompt_tokens_p99": quantile(0.99, bucket.prompts),
    }


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def served_over(*, endpoint_id: UUID, since: datetime, until: datetime
                ) -> tuple[int, float | None, float | None]:
    """(requests finished, 99th percentiles of their prompt lengths and of their max_tokens)
    over [since, until). Each replica's counters only grow while its engine lives, so only
    its first and last samples and the two around each restart (a counter that went down:
    a failed replica restarts under its id) are read whole; the rest only for their
    counters, so the read stays small however long the window."""
    window = EngineSample.objects.filter(endpoint_id=endpoint_id, at__gte=since, at__lt=until)
    kept: set[int] = set()
    before: tuple | None = None
    for row in window.order_by("replica_id", "at").values_list("id", "replica_id", *RESETS):
        if before is None or before[1] != row[1]:  # a replica's first sample
            if before is not None:
                kept.add(before[0])
            kept.add(row[0])
        elif any(now < then for now, then in zip(row[2:], before[2:], strict=True)):
            kept.update((before[0], row[0]))
        before = row
    if before is not None:
        kept.add(before[0])
    bucket = _Step()
    previous: EngineSample | None = None
    for sample in EngineSample.objects.filter(id__in=kept).order_by("replica_id", "at"):
        if previous is not None and previous.replica_id == sample.replica_id:
            _add_increase(bucket, previous, sample)
        previous = sample
    return (int(bucket.deltas["requests"]), quantile(0.99, bucket.prompts),
            quantile(0.99, bucket.max_tokens))

