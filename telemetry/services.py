"""Writes of engine samples: recording scrapes, and thinning old ones.

Retention: telemetry.models.RAW_KEPT, MINUTE_KEPT and HOUR_KEPT.
"""

import logging
import zlib
from collections.abc import Iterable
from datetime import datetime, timedelta
from uuid import UUID

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from endpoints.models import Endpoint
from endpoints.services import do_change_endpoint_policy
from engine.metrics import EngineSnapshot
from telemetry.models import HOUR_KEPT, MINUTE_KEPT, RAW_KEPT, Advice, EngineSample

logger = logging.getLogger(__name__)
DOWNSAMPLE_LOCK = zlib.crc32(b"kvrun.telemetry.downsample")


def do_record_engine_samples(*, samples: Iterable[tuple[UUID, UUID, datetime, EngineSnapshot]]
                             ) -> int:
    """Store (replica, endpoint, scraped at, snapshot) samples; one already stored for that
    replica and moment (a scrape recorded twice) is kept as it was. Returns how many were
    offered."""
    rows = [EngineSample(replica_id=replica_id, endpoint_id=endpoint_id, at=at,
                         kv_cache_usage=shot.kv_cache_usage, running=shot.running,
                         waiting=shot.waiting, prefix_queries=shot.prefix_queries,
                         prefix_hits=shot.prefix_hits, external_queries=shot.external_queries,
                         external_hits=shot.external_hits, preemptions=shot.preemptions,
                         prompt_tokens=shot.prompt_tokens,
                         generation_tokens=shot.generation_tokens, requests=shot.requests,
                         ttft_buckets=shot.ttft_buckets, itl_buckets=shot.itl_buckets,
                         prompt_buckets=shot.prompt_buckets,
                         max_tokens_buckets=shot.max_tokens_buckets)
            for replica_id, endpoint_id, at, shot in samples]
    created = EngineSample.objects.bulk_create(rows, ignore_conflicts=True)
    return len(created)


# Within each (replica, span) of samples finer than the span, the last one stays and stands
# for the span with its gauges' peak; the others go. `before` is a span boundary, so that a
# span is never thinned in two runs.
THIN = """
    WITH ranked AS (
        SELECT id,
               row_number() OVER span_of AS newest_first,
               max(kv_cache_usage) OVER span_of AS peak_usage,
               max(running) OVER span_of AS peak_running,
               max(waiting) OVER span_of AS peak_waiting
        FROM telemetry_enginesample
        WHERE resolution_seconds < %(span)s AND at < %(before)s
        WINDOW span_of AS (
            PARTITION BY replica_id,
                         date_bin(%(step)s, at, timestamptz '2000-01-01 00:00+00')
            ORDER BY at DESC ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
    ), kept AS (
        UPDATE telemetry_enginesample sample
        SET resolution_seconds = %(span)s, kv_cache_usage = ranked.peak_usage,
            running = ranked.peak_running, waiting = ranked.peak_waiting
        FROM ranked WHERE sample.id = ranked.id AND ranked.newest_first = 1
    )
    DELETE FROM telemetry_enginesample sample USING ranked
    WHERE sample.id = ranked.id AND ranked.newest_first > 1"""


def do_downsample_samples(*, now: datetime) -> bool:
    """Thin and expire samples as of `now`, in one transaction. Idempotent; a run that finds
    another one at work returns False and leaves the work to it."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [DOWNSAMPLE_LOCK])
        if not cursor.fetchone()[0]:
            return False
        for span, kept in ((timedelta(minutes=1), RAW_KEPT), (timedelta(hours=1), MINUTE_KEPT)):
            seconds = int(span.total_seconds())
            before = _floor(now - kept, seconds)
            cursor.execute(THIN, {"span": seconds, "before": before, "step": span})
        cursor.execute("DELETE FROM telemetry_enginesample WHERE at < %s", [now - HOUR_KEPT])
    return True


def _floor(moment: datetime, seconds: int) -> datetime:
    epoch = int(moment.timestamp())
    return datetime.fromtimestamp(epoch - epoch % seconds, tz=moment.tzinfo)


def do_advise_endpoints(*, now: datetime) -> int:
    """Run telemetry.advice over every endpoint with samples in the last day or advice still
    open; returns how many have advice open."""
    from telemetry.advice import CONTEXT_WINDOW, do_advise_endpoint

    recent = EngineSample.objects.filter(at__gte=now - CONTEXT_WINDOW).values("endpoint_id")
    still_open = Advice.objects.filter(resolved_at=None).values("endpoint_id")
    advised = 0
    for endpoint in Endpoint.objects.filter(
            Q(id__in=recent) | Q(id__in=still_open), deleted_at=None).select_related(
            "model", "gpu_type"):
        try:
            advised += bool(do_advise_endpoint(endpoint=endpoint, now=now))
        except Exception:  # one endpoint's figures must not hold back the others' advice
            logger.exception("advice for endpoint %s failed", endpoint.id)
    return advised


def do_apply_advice(*, advice: Advice, actor_role: str | None) -> str:
    """Apply an open advice's policy change to its endpoint (endpoints.services), and resolve
    it; returns what happens next. Raises ValidationError for advice that is resolved, or
    that needs a person (no policy change)."""
    with transaction.atomic():
        # Held: the same advice applied twice at once changes the policy once.
        held = Advice.objects.select_for_update().get(id=advice.id)
        if held.resolved_at is not None or not held.change:
            raise ValidationError("This advice has no one-click change open; its message says "
                                  "what to do.")
        rollout = do_change_endpoint_policy(endpoint=advice.endpoint, actor_role=actor_role,
                                            changes=held.change)
        Advice.objects.filter(id=held.id).update(resolved_at=timezone.now())
    return rollout
