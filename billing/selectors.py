"""Reads over the usage ledger for the dashboard: last-hour totals and per-minute series."""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from django.db.models import Aggregate, Count, F, FloatField, Q, Sum
from django.db.models.functions import Coalesce, TruncMinute
from django.utils import timezone

from billing.models import UsageRecord


class Percentile(Aggregate):
    """PostgreSQL's continuous percentile of a column within each group."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression: str, fraction: float) -> None:
        super().__init__(expression, fraction=float(fraction))


@dataclass(frozen=True)
class Totals:
    requests: int = 0
    tokens: int = 0


def last_hour_totals(*, endpoint_ids: Iterable[UUID], now: datetime | None = None
                     ) -> dict[UUID, Totals]:
    """Requests and tokens (prompt and completion) per endpoint over the last hour, in one
    query; endpoints without usage are absent."""
    since = (now or timezone.now()) - timedelta(hours=1)
    rows = (UsageRecord.objects.filter(endpoint_id__in=list(endpoint_ids), started_at__gte=since)
            .values("endpoint_id")
            .annotate(requests=Count("id"),
                      tokens=Coalesce(Sum(F("prompt_tokens") + F("completion_tokens")), 0)))
    return {row["endpoint_id"]: Totals(requests=row["requests"], tokens=row["tokens"])
            for row in rows}


def usage_by_minute(*, endpoint_id: UUID, minutes: int = 60, now: datetime | None = None
                    ) -> list[dict[str, object]]:
    """One row per minute that saw requests, over the current minute and the `minutes` - 1
    before it: requests, errors (status 400 and up, clients that left included), tokens,
    and TTFT p50/p95 in ms."""
    now = now or timezone.now()
    since = now.replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)
    return list(
        UsageRecord.objects.filter(endpoint_id=endpoint_id, started_at__gte=since)
        .annotate(minute=TruncMinute("started_at"))
        .values("minute")
        .annotate(requests=Count("id"), errors=Count("id", filter=Q(status_code__gte=400)),
                  prompt_tokens=Coalesce(Sum("prompt_tokens"), 0),
                  completion_tokens=Coalesce(Sum("completion_tokens"), 0),
                  ttft_p50_ms=Percentile("time_to_first_token_ms", 0.5),
                  ttft_p95_ms=Percentile("time_to_first_token_ms", 0.95))
        .order_by("minute")
    )
