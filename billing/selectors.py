"""Reads over the billing ledger for the dashboard, the API and the console: usage totals and
series, invoices and what is behind their lines, and how far the rollup lags."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.db import connection
from django.db.models import Aggregate, Count, F, FloatField, Min, Prefetch, Q, QuerySet, Sum
from django.db.models.functions import Coalesce, TruncDate, TruncMinute
from django.utils import timezone

from accounts.models import Organization
from billing.invoicing import (
    Line,
    billed_phases,
    draft_lines,
    gpu_price_at,
    lines_for_month,
    month_bounds,
    month_of,
)
from billing.models import (
    GPUHour,
    Invoice,
    InvoiceLine,
    LineKind,
    RollupState,
    StaleUsageHour,
    TokenHour,
    UsageRecord,
)
from billing.rollup import hour_of
from endpoints.models import ReplicaInterval


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
                    ) -> list[Mapping[str, Any]]:
    """One row per minute that saw requests, over the current minute and the `minutes` - 1
    before it: requests, those that failed (status 500 and up) and those refused (400 to 499:
    the client's errors, and clients that left), tokens, and TTFT p50/p95 in ms."""
    now = now or timezone.now()
    since = now.replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)
    return list(
        UsageRecord.objects.filter(endpoint_id=endpoint_id, started_at__gte=since)
        .annotate(minute=TruncMinute("started_at"))
        .values("minute")
        .annotate(requests=Count("id"), failed=Count("id", filter=Q(status_code__gte=500)),
                  refused=Count("id", filter=Q(status_code__gte=400, status_code__lt=500)),
                  prompt_tokens=Coalesce(Sum("prompt_tokens"), 0),
                  completion_tokens=Coalesce(Sum("completion_tokens"), 0),
                  ttft_p50_ms=Percentile("time_to_first_token_ms", 0.5),
                  ttft_p95_ms=Percentile("time_to_first_token_ms", 0.95))
        .order_by("minute")
    )


def tokens_by_minute_and_adapter(*, endpoint_id: UUID, minutes: int = 60,
                                 now: datetime | None = None) -> list[Mapping[str, Any]]:
    """Generated tokens per minute and LoRA adapter ("" for the endpoint's model) over the
    same minutes as usage_by_minute, for minutes that saw any."""
    now = now or timezone.now()
    since = now.replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)
    return list(
        UsageRecord.objects.filter(endpoint_id=endpoint_id, started_at__gte=since)
        .annotate(minute=TruncMinute("started_at"))
        .values("minute", "adapter")
        .annotate(completion_tokens=Coalesce(Sum("completion_tokens"), 0))
        .order_by("minute", "adapter")
    )


@dataclass(frozen=True)
class InvoiceView:
    """A month's invoice as the customer reads it: finalised (stored) or the draft."""

    month: date
    status: str  # "final" or "draft"
    number: str
    currency: str
    total_cents: int
    finalized_at: datetime | None
    lines: list[Line]

    def line(self, number: int) -> Line | None:
        """The line numbered `number` on the invoice, from 1; None when there is none."""
        return self.lines[number - 1] if 1 <= number <= len(self.lines) else None


def invoices_of(*, organization: Organization, now: datetime | None = None
                ) -> list[InvoiceView]:
    """Newest first: the open month's draft and that of an ended month not yet finalised
    (where they bill anything), then the finalised invoices."""
    current = month_of(now or timezone.now())
    final = list(Invoice.objects.filter(organization=organization).prefetch_related(
        Prefetch("lines", InvoiceLine.objects.select_related("endpoint"))))
    finalised_months = {invoice.month for invoice in final}
    previous = month_of(month_bounds(current)[0] - timedelta(days=1))
    drafts = [draft for month in (current, previous) if month not in finalised_months
              and (draft := _draft(organization, month)).lines]
    return drafts + [_final(invoice) for invoice in final]


def invoice_of(*, organization: Organization, month: date) -> InvoiceView | None:
    """The month's invoice: the stored one once finalised, otherwise its draft (which may
    have no lines); None for a month that has not begun."""
    if month > month_of(timezone.now()):
        return None
    invoice = (Invoice.objects.filter(organization=organization, month=month)
               .prefetch_related(Prefetch("lines",
                                          InvoiceLine.objects.select_related("endpoint")))
               .first())
    return _final(invoice) if invoice is not None else _draft(organization, month)


def usage_behind(*, organization: Organization, line: Line,
                 billed_at: datetime | None = None) -> QuerySet:
    """The ledger rows a line bills: replica intervals for GPU time, usage records for
    tokens; for an adjustment, the records of its month stored after that month's invoice
    and, on a finalised invoice (`billed_at`, when it was finalised), before this one."""
    if line.kind == LineKind.GPU_TIME:
        return (ReplicaInterval.objects.filter(
            organization=organization, endpoint_id=line.endpoint_id, gpu_type_id=line.gpu_type_id,
            phase=line.phase, own_node=line.own_node, started_at__lt=line.period_end)
            .filter(Q(ended_at=None) | Q(ended_at__gt=line.period_start))
            .order_by("started_at", "id"))
    records = UsageRecord.objects.filter(organization=organization,
                                         endpoint_id=line.endpoint_id, adapter=line.adapter,
                                         started_at__gte=line.period_start,
                                         started_at__lt=line.period_end)
    if line.adjustment:
        billed = (Invoice.objects.filter(organization=organization, month=line.usage_month)
                  .values_list("finalized_at", flat=True).first())
        records = records.filter(ingested_at__gt=billed)
        if billed_at is not None:
            records = records.filter(ingested_at__lte=billed_at)
    return records.order_by("started_at", "id")


def _draft(organization: Organization, month: date) -> InvoiceView:
    """The month's lines, and the adjustments for finalised months unless the month before
    is still in its grace period: its invoice will carry them."""
    previous = month_of(month_bounds(month)[0] - timedelta(days=1))
    waiting = (not Invoice.objects.filter(organization=organization, month=previous).exists()
               and lines_for_month(organization_id=organization.id, month=previous))
    lines = (lines_for_month(organization_id=organization.id, month=month) if waiting
             else draft_lines(organization_id=organization.id, month=month))
    return InvoiceView(month=month, status="draft", number="", currency="usd",
                       total_cents=sum(line.amount_cents for line in lines), finalized_at=None,
                       lines=lines)


def _final(invoice: Invoice) -> InvoiceView:
    return InvoiceView(
        month=invoice.month, status="final", number=invoice.number, currency=invoice.currency,
        total_cents=invoice.total_cents, finalized_at=invoice.finalized_at,
        lines=[Line(kind=line.kind, endpoint_id=line.endpoint_id,
                    endpoint_name=line.endpoint.name, gpu_type_id=line.gpu_type_id,
                    phase=line.phase, own_node=line.own_node, usage_month=line.usage_month,
                    period_start=line.period_start, period_end=line.period_end,
                    quantity=line.quantity, unit=line.unit, unit_price_usd=line.unit_price_usd,
                    amount_cents=line.amount_cents, description=line.description,
                    adjustment=line.adjustment, adapter=line.adapter)
               for line in invoice.lines.all()])


CURRENT_PRICE = gpu_price_at("now()", line="span")


@dataclass(frozen=True)
class WindowCost:
    """GPU cost and tokens served over a window, and what a million tokens cost in GPU time."""

    gpu_cost_usd: Decimal
    tokens: int

    @property
    def usd_per_million_tokens(self) -> Decimal | None:
        if not self.tokens:
            return None
        return (self.gpu_cost_usd * 1_000_000 / self.tokens).quantize(Decimal("0.0001"))


def hourly_run_rate(*, organization: Organization) -> Decimal:
    """What the replicas holding devices now cost per hour, in USD, at today's prices."""
    with connection.cursor() as cursor:
        cursor.execute(f"""
            SELECT coalesce(sum(span.gpu_count * {CURRENT_PRICE}), 0)
            FROM endpoints_replicainterval span
            JOIN endpoints_gputype gpu ON gpu.id = span.gpu_type_id
            WHERE span.organization_id = %s AND span.ended_at IS NULL
              AND span.phase = ANY(%s)""", [organization.id, billed_phases()])
        return cursor.fetchone()[0]


def tokens_by_adapter(*, endpoint_id: UUID, hours: int = 24, now: datetime | None = None
                      ) -> dict[str, dict[str, int]]:
    """Requests and tokens of each of the endpoint's adapters ("" for its model) over the last
    `hours` whole hours and this one, as rolled up."""
    since = hour_of((now or timezone.now()) - timedelta(hours=hours))
    rows = (TokenHour.objects.filter(endpoint_id=endpoint_id, hour__gte=since)
            .values("adapter").annotate(requests=Sum("requests"), prompt=Sum("prompt_tokens"),
                                        completion=Sum("completion_tokens")))
    return {row["adapter"]: {"requests": row["requests"], "prompt_tokens": row["prompt"],
                             "completion_tokens": row["completion"]} for row in rows}


def tokens_by_model(*, organization: Organization, month: date) -> list[dict[str, Any]]:
    """Requests and tokens of `month` per endpoint and LoRA adapter (an empty adapter: the
    endpoint's model), as rolled up, by endpoint name then adapter."""
    start, end = month_bounds(month)
    rows = (TokenHour.objects.filter(organization=organization, hour__gte=start, hour__lt=end)
            .values("endpoint__name", "adapter")
            .annotate(requests=Sum("requests"), prompt_tokens=Sum("prompt_tokens"),
                      completion_tokens=Sum("completion_tokens"))
            .order_by("endpoint__name", "adapter"))
    return [dict(row) for row in rows]


def month_to_date_by_endpoint(*, organization: Organization, now: datetime | None = None
                              ) -> dict[UUID, int]:
    """Cents each endpoint has cost this month so far, as its draft lines price it."""
    costs: dict[UUID, int] = {}
    for line in lines_for_month(organization_id=organization.id,
                                month=month_of(now or timezone.now())):
        costs[line.endpoint_id] = costs.get(line.endpoint_id, 0) + line.amount_cents
    return costs


def window_costs(*, endpoint_ids: Iterable[UUID], hours: int, now: datetime | None = None
                 ) -> dict[UUID, WindowCost]:
    """Per endpoint, over the last `hours` hours: the GPU time its replicas held in billed
    phases at today's prices, and the prompt and completion tokens it served."""
    now = now or timezone.now()
    since = now - timedelta(hours=hours)
    ids = list(endpoint_ids)
    with connection.cursor() as cursor:
        cursor.execute(f"""
            SELECT span.endpoint_id,
                   sum(extract(epoch FROM least(coalesce(span.ended_at, %(now)s), %(now)s)
                                      - greatest(span.started_at, %(since)s))
                       * span.gpu_count * {CURRENT_PRICE} / 3600)
            FROM endpoints_replicainterval span
            JOIN endpoints_gputype gpu ON gpu.id = span.gpu_type_id
            WHERE span.endpoint_id = ANY(%(ids)s) AND span.phase = ANY(%(phases)s)
              AND span.started_at < %(now)s
              AND (span.ended_at IS NULL OR span.ended_at > %(since)s)
            GROUP BY span.endpoint_id""",
                       {"now": now, "since": since, "ids": ids, "phases": billed_phases()})
        gpu_costs = dict(cursor.fetchall())
    tokens = _tokens_between(ids, since, now)
    return {endpoint_id: WindowCost(gpu_cost_usd=gpu_costs.get(endpoint_id, Decimal(0)),
                                    tokens=tokens.get(endpoint_id, 0)) for endpoint_id in ids}


def _tokens_between(endpoint_ids: list[UUID], start: datetime, end: datetime
                    ) -> dict[UUID, int]:
    """Prompt and completion tokens per endpoint, in one query: whole hours from the rollup,
    the partial hours at either edge from the records themselves."""
    first_whole = hour_of(start) + (timedelta(hours=1) if hour_of(start) < start else timedelta())
    last_whole = max(hour_of(end), first_whole)
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT endpoint_id, sum(tokens) FROM (
                SELECT endpoint_id, prompt_tokens + completion_tokens AS tokens
                FROM billing_tokenhour
                WHERE endpoint_id = ANY(%(ids)s) AND hour >= %(first)s AND hour < %(last)s
                UNION ALL
                SELECT endpoint_id, prompt_tokens + completion_tokens
                FROM billing_usagerecord
                WHERE endpoint_id = ANY(%(ids)s)
                  AND ((started_at >= %(start)s AND started_at < least(%(first)s, %(end)s))
                       OR (started_at >= greatest(%(last)s, %(start)s)
                           AND started_at < %(end)s))
            ) served
            GROUP BY endpoint_id""", {"ids": endpoint_ids, "first": first_whole,
                                      "last": last_whole, "start": start, "end": end})
        return {endpoint_id: int(tokens) for endpoint_id, tokens in cursor.fetchall()}


def daily_usage(*, organization: Organization, days: int = 30, now: datetime | None = None
                ) -> list[dict[str, object]]:
    """GPU-hours (billed phases) and tokens per UTC day over the last `days` days, oldest
    first, days without usage included."""
    today = (now or timezone.now()).astimezone(UTC).date()
    first = today - timedelta(days=days - 1)
    start = datetime(first.year, first.month, first.day, tzinfo=UTC)
    gpu = dict(GPUHour.objects.filter(organization=organization, hour__gte=start,
                                      phase__in=billed_phases())
               .annotate(day=TruncDate("hour", tzinfo=UTC)).values("day")
               .annotate(seconds=Sum("gpu_seconds")).values_list("day", "seconds"))
    tokens = {row["day"]: row for row in
              TokenHour.objects.filter(organization=organization, hour__gte=start)
              .annotate(day=TruncDate("hour", tzinfo=UTC)).values("day")
              .annotate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))}
    series = []
    for offset in range(days):
        day = first + timedelta(days=offset)
        row: Mapping[str, Any] = tokens.get(day, {})
        series.append({"day": day, "gpu_hours": (gpu.get(day, Decimal(0)) / 3600),
                       "prompt_tokens": row.get("prompt", 0) or 0,
                       "completion_tokens": row.get("completion", 0) or 0})
    return series


@dataclass(frozen=True)
class RollupLag:
    """How far the token rollup is behind the ledger, and how it takes its batches."""

    stale_hours: int  # endpoint-hours with records not yet rolled up
    oldest_hour: datetime | None  # the earliest of those hours
    waiting_since: datetime | None  # when the longest-waiting of them went stale
    batch_hours: int
    timed_out_at: datetime | None
    timeout_reason: str

    def lag_seconds(self, *, now: datetime | None = None) -> float:
        """How long the longest-waiting stale hour has waited; 0 when none waits."""
        if self.waiting_since is None:
            return 0.0
        return max(0.0, ((now or timezone.now()) - self.waiting_since).total_seconds())


def rollup_lag() -> RollupLag:
    """One pass over the stale marks (a few hundred in steady state; a backlog's hundreds of
    thousands take some tens of milliseconds)."""
    marks = StaleUsageHour.objects.aggregate(count=Count("id"), oldest=Min("hour"),
                                             since=Min("marked_at"))
    state = RollupState.objects.filter(id=1).first() or RollupState()
    return RollupLag(stale_hours=marks["count"], oldest_hour=marks["oldest"],
                     waiting_since=marks["since"], batch_hours=state.batch_hours,
                     timed_out_at=state.timed_out_at, timeout_reason=state.timeout_reason)
