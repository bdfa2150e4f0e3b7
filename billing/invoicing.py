"""Monthly invoices: what an organisation owes for a calendar month (UTC), line by line, from
the hourly rollups and the prices in effect at each hour.

A month's lines are computed, not stored, while it is open and through its grace period
(KVRUN_INVOICE_GRACE_SECONDS): that is its draft. Then do_finalize_invoice stores them once.
Usage of a finalised month that is rolled up later is billed on the next invoice as
adjustment lines: the difference between what that month's usage now comes to and what its
invoices have billed, so the total billed for a month always converges on what it used.

Unlike the rollup's stale marks, the tables read here only grow (lines are rewritten a few
hours at a time, invoices added): their statistics may lag behind them, never claim that a
large table is nearly empty. Every statement reads one organisation's month through the
(organisation, hour) index of the lines, or one range of the hour index, and joins only small
tables (endpoints, GPU types, prices) by their keys; none has a plan that statistics could
make quadratic (billing.rollup says how that happened to the rollup).
"""

import calendar
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from uuid import UUID

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Sum
from django.utils import timezone

from accounts.models import Organization
from billing.models import Invoice, InvoiceLine, LineKind
from billing.money import cents
from billing.rollup import do_write_down_list_prices, lock_rollups
from endpoints.models import BilledPhase, Task

logger = logging.getLogger(__name__)

GPU_HOUR, MILLION_TOKENS = "GPU-hour", "1M tokens"


@dataclass(frozen=True)
class Line:
    kind: str
    endpoint_id: UUID
    endpoint_name: str
    gpu_type_id: int | None
    phase: str
    usage_month: date
    period_start: datetime
    period_end: datetime
    quantity: Decimal
    unit: str
    unit_price_usd: Decimal
    amount_cents: int
    description: str
    adjustment: bool = False
    adapter: str = ""  # a token line's LoRA adapter; empty for the endpoint's model

    own_node: bool = False  # GPU time on the organisation's own nodes

    @property
    def key(self) -> tuple:
        """What makes two lines of one month bill the same thing."""
        return (self.kind, self.endpoint_id, self.gpu_type_id, self.phase, self.own_node,
                self.unit_price_usd, self.adapter)


def month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime(month.year, month.month, 1, tzinfo=UTC)
    days = calendar.monthrange(month.year, month.month)[1]
    return start, start + timedelta(days=days)


def month_label(month: date) -> str:
    """2026-01: a month as URLs, CSV and the API name it (strftime would not pad year 454)."""
    return f"{month.year:04d}-{month.month:02d}"


def month_of(moment: datetime) -> date:
    return moment.astimezone(UTC).date().replace(day=1)


def gpu_price_at(moment: str, *, line: str) -> str:
    """SQL for the hourly price of a device of GPU type `gpu` at the SQL time `moment`, for
    the interval or GPU hour `line` (its price_region_id and own_node): on an organisation's
    own node, the own-node price version in effect then, else nothing; elsewhere, the
    version of the line's region in effect then, else the general one, else the catalog's
    list price."""
    version = """(SELECT hourly_price_usd FROM billing_gpuprice
                  WHERE gpu_type_id = gpu.id AND effective_from <= {moment} AND {scope}
                  ORDER BY effective_from DESC LIMIT 1)"""
    own = version.format(moment=moment, scope="own_nodes")
    regional = version.format(moment=moment,
                              scope=f"NOT own_nodes AND region_id = {line}.price_region_id")
    general = version.format(moment=moment, scope="NOT own_nodes AND region_id IS NULL")
    return f"""(CASE WHEN {line}.own_node THEN coalesce({own}, 0)
                ELSE coalesce({regional}, {general}, gpu.hourly_price_usd) END)"""


def lines_for_month(*, organization_id: UUID, month: date) -> list[Line]:
    """Every line that `month`'s usage of the organisation comes to now, priced at each hour's
    price: GPU time per endpoint, GPU type, billed phase and price; tokens per endpoint, kind
    and price, where its model has token prices."""
    return [*_gpu_lines(organization_id, month), *_token_lines(organization_id, month)]


def adjustment_lines(*, organization_id: UUID, before: date) -> list[Line]:
    """For each finalised month before `before` whose rollups changed after it was finalised,
    the difference between what its usage now comes to and what has been billed for it."""
    adjustments = []
    for month in _months_changed_since_finalised(organization_id, before):
        due = {line.key: line for line in lines_for_month(organization_id=organization_id,
                                                          month=month)}
        billed = {
            (row["kind"], row["endpoint_id"], row["gpu_type_id"], row["phase"], row["own_node"],
             row["unit_price_usd"], row["adapter"]): row
            for row in InvoiceLine.objects.filter(invoice__organization_id=organization_id,
                                                  usage_month=month)
            .values("kind", "endpoint_id", "gpu_type_id", "phase", "own_node", "unit_price_usd",
                    "adapter")
            .annotate(quantity=Sum("quantity"), amount_cents=Sum("amount_cents"))
        }
        for key in sorted(due.keys() | billed.keys(), key=str):
            line, before_now = due.get(key), billed.get(key)
            quantity = ((line.quantity if line else Decimal(0))
                        - (before_now["quantity"] if before_now else Decimal(0)))
            amount = (line.amount_cents if line else 0) - (before_now["amount_cents"]
                                                           if before_now else 0)
            if not quantity and not amount:
                continue
            template = line or _line_from_billed(key, month)
            adjustments.append(replace(
                template, quantity=quantity, amount_cents=amount, adjustment=True,
                description=f"Adjustment for {month:%B %Y}: {template.description}, "
                            f"recorded after its invoice"))
    return adjustments


def draft_lines(*, organization_id: UUID, month: date) -> list[Line]:
    """What the invoice for `month` would hold if it were finalised now."""
    return [*lines_for_month(organization_id=organization_id, month=month),
            *adjustment_lines(organization_id=organization_id, before=month)]


def do_finalize_invoice(*, organization: Organization, month: date) -> Invoice | None:
    """Store the invoice for `month` with its lines, once. Returns None, changing nothing,
    when it was already finalised (by this run or another at the same time), or when there
    is nothing to bill. The caller makes sure the month's grace period is over."""
    with transaction.atomic():
        # With rollups kept out, every line this reads was stamped before finalized_at, and
        # every later one after it: it is an adjustment for the next invoice.
        finalized_at = lock_rollups()
        do_write_down_list_prices()
        lines = draft_lines(organization_id=organization.id, month=month)
        if not lines:
            return None
        try:
            with transaction.atomic():
                invoice = Invoice.objects.create(
                    organization=organization, month=month,
                    number=f"KVR-{month:%Y%m}-{organization.slug}",
                    total_cents=sum(line.amount_cents for line in lines),
                    finalized_at=finalized_at)
        except IntegrityError:
            return None
        InvoiceLine.objects.bulk_create([
            InvoiceLine(invoice=invoice, kind=line.kind, endpoint_id=line.endpoint_id,
                        adapter=line.adapter, gpu_type_id=line.gpu_type_id, phase=line.phase,
                        own_node=line.own_node,
                        usage_month=line.usage_month, adjustment=line.adjustment,
                        period_start=line.period_start, period_end=line.period_end,
                        description=line.description[:200], quantity=line.quantity,
                        unit=line.unit, unit_price_usd=line.unit_price_usd,
                        amount_cents=line.amount_cents) for line in lines])
    return invoice


def do_finalize_due_invoices(*, now: datetime | None = None) -> int:
    """Finalise every invoice whose month's grace period is over: each month of the last year
    with usage and no invoice yet, and the last month past its grace for an organisation whose
    finalised months have usage rolled up since (its adjustments). Returns how many."""
    now = now or timezone.now()
    due_before = month_of(now - timedelta(seconds=settings.KVRUN_INVOICE_GRACE_SECONDS))
    last_due = month_of(month_bounds(due_before)[0] - timedelta(days=1))
    due = [*_unbilled_months(before=due_before, since=due_before.replace(
        year=due_before.year - 1)), *((organization_id, last_due) for organization_id in
                                      _organizations_with_adjustments(before=last_due))]
    finalized = 0
    for organization_id, month in due:
        organization = Organization.objects.get(id=organization_id)
        try:
            finalized += do_finalize_invoice(organization=organization, month=month) is not None
        except Exception:  # one organisation's invoice must not hold back the others'
            logger.exception("the %s invoice of %s could not be finalised", month_label(month),
                             organization.slug)
    return finalized


def _gpu_lines(organization_id: UUID, month: date) -> list[Line]:
    start, end = month_bounds(month)
    with connection.cursor() as cursor:
        cursor.execute(f"""
            SELECT line.endpoint_id, endpoint.name, line.gpu_type_id, gpu.name, line.phase,
                   line.own_node, {gpu_price_at("line.hour", line="line")},
                   min(line.hour), max(line.hour) + interval '1 hour', sum(line.gpu_seconds)
            FROM billing_gpuhour line
            JOIN endpoints_endpoint endpoint ON endpoint.id = line.endpoint_id
            JOIN endpoints_gputype gpu ON gpu.id = line.gpu_type_id
            WHERE line.organization_id = %s AND line.hour >= %s AND line.hour < %s
              AND line.phase = ANY(%s)
            GROUP BY 1, 2, 3, 4, 5, 6, 7
            ORDER BY 2, 4, array_position(%s::text[], line.phase::text), 6, 7""",
                       [organization_id, start, end, billed_phases(), list(BilledPhase)])
        rows = cursor.fetchall()
    return [
        Line(kind=LineKind.GPU_TIME, endpoint_id=endpoint_id, endpoint_name=endpoint_name,
             gpu_type_id=gpu_type_id, phase=phase, own_node=own_node, usage_month=month,
             period_start=first, period_end=last,
             quantity=(seconds / 3600).quantize(Decimal("0.000001")), unit=GPU_HOUR,
             unit_price_usd=price, amount_cents=cents(seconds * price / 3600),
             description=f"{endpoint_name}: {gpu_name}, {phase}"
                         + (", own nodes" if own_node else ""))
        for (endpoint_id, endpoint_name, gpu_type_id, gpu_name, phase, own_node, price, first,
             last, seconds) in rows]


# A pooling model's prompt tokens are what it embeds or scores: a kind of their own.
PROMPT_KINDS = {Task.EMBED: LineKind.EMBEDDED_TOKENS, Task.SCORE: LineKind.SCORED_TOKENS}


def _token_lines(organization_id: UUID, month: date) -> list[Line]:
    start, end = month_bounds(month)
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT line.endpoint_id, endpoint.name, line.adapter, model.task,
                   price.prompt_per_million_usd,
                   price.cached_per_million_usd, price.completion_per_million_usd,
                   min(line.hour), max(line.hour) + interval '1 hour',
                   sum(line.prompt_tokens - line.cached_tokens), sum(line.cached_tokens),
                   sum(line.completion_tokens)
            FROM billing_tokenhour line
            JOIN endpoints_endpoint endpoint ON endpoint.id = line.endpoint_id
            JOIN endpoints_modelspec model ON model.id = endpoint.model_id
            JOIN LATERAL (
                SELECT * FROM billing_tokenprice
                WHERE model_id = endpoint.model_id AND effective_from <= line.hour
                ORDER BY effective_from DESC LIMIT 1) price ON true
            WHERE line.organization_id = %s AND line.hour >= %s AND line.hour < %s
            GROUP BY 1, 2, 3, 4, 5, 6, 7
            ORDER BY 2, 3, 5, 6, 7""", [organization_id, start, end])
        rows = cursor.fetchall()
    # A row per price version; a version that changed another kind's price leaves this
    # kind's the same, and one kind at one price is one line (Line.key).
    counted: dict[tuple, tuple[datetime, datetime, int]] = {}
    for endpoint_id, endpoint_name, adapter, task, *row in rows:
        prices, (first, last), tokens = row[0:3], row[3:5], row[5:8]
        for kind, price, count in zip(
                (PROMPT_KINDS.get(task, LineKind.PROMPT_TOKENS), LineKind.CACHED_TOKENS,
                 LineKind.COMPLETION_TOKENS), prices, tokens, strict=True):
            if not price or not count:
                continue
            key = (endpoint_id, endpoint_name, adapter, kind, price)
            if key in counted:
                was_first, was_last, was_count = counted[key]
                first, last, count = min(was_first, first), max(was_last, last), was_count + count
            counted[key] = (first, last, count)
    return [Line(kind=kind, endpoint_id=endpoint_id, endpoint_name=endpoint_name,
                 gpu_type_id=None, phase="", usage_month=month, period_start=first,
                 period_end=last, quantity=Decimal(count) / 1_000_000, unit=MILLION_TOKENS,
                 unit_price_usd=price, amount_cents=cents(count * price / 1_000_000),
                 adapter=adapter, description=(f"{endpoint_name}"
                                               + (f":{adapter}" if adapter else "")
                                               + f": {LineKind(kind).label}"))
            for (endpoint_id, endpoint_name, adapter, kind, price), (first, last, count)
            in counted.items()]


def _line_from_billed(key: tuple, month: date) -> Line:
    """A line for something billed that the month's usage no longer comes to (an interval
    closed back at a lost node's last heartbeat, say), from its earlier lines."""
    kind, endpoint_id, gpu_type_id, phase, own_node, unit_price, adapter = key
    earlier = (InvoiceLine.objects.filter(kind=kind, endpoint_id=endpoint_id,
                                          gpu_type_id=gpu_type_id, phase=phase,
                                          own_node=own_node, unit_price_usd=unit_price,
                                          adapter=adapter, usage_month=month)
               .select_related("endpoint").first())
    assert earlier is not None, key  # the key is one of the month's billed lines
    return Line(kind=kind, endpoint_id=endpoint_id, endpoint_name=earlier.endpoint.name,
                gpu_type_id=gpu_type_id, phase=phase, own_node=own_node, usage_month=month,
                period_start=earlier.period_start, period_end=earlier.period_end,
                quantity=Decimal(0), unit=earlier.unit, unit_price_usd=unit_price,
                amount_cents=0, description=earlier.description, adapter=adapter)


# Finalised invoices whose month has hourly lines rolled up after they were finalised.
CHANGED_SINCE_FINALISED = """
    SELECT {columns} FROM billing_invoice invoice
    WHERE invoice.month < %(before)s {organization}
      AND (EXISTS (SELECT 1 FROM billing_tokenhour line
                           WHERE line.organization_id = invoice.organization_id
                             AND line.hour >= invoice.month::timestamp AT TIME ZONE 'UTC'
                             AND line.hour < (invoice.month + interval '1 month')
                                             AT TIME ZONE 'UTC'
                             AND line.rolled_up_at > invoice.finalized_at)
                   OR EXISTS (SELECT 1 FROM billing_gpuhour line
                              WHERE line.organization_id = invoice.organization_id
                                AND line.hour >= invoice.month::timestamp AT TIME ZONE 'UTC'
                                AND line.hour < (invoice.month + interval '1 month')
                                                AT TIME ZONE 'UTC'
                                AND line.rolled_up_at > invoice.finalized_at))
    """


def _months_changed_since_finalised(organization_id: UUID, before: date) -> list[date]:
    with connection.cursor() as cursor:
        cursor.execute(CHANGED_SINCE_FINALISED.format(
            columns="invoice.month",
            organization="AND invoice.organization_id = %(organization)s")
            + " ORDER BY invoice.month", {"organization": organization_id, "before": before})
        return [month for (month,) in cursor.fetchall()]


def _organizations_with_adjustments(*, before: date) -> list[UUID]:
    """Organisations with usage of a month finalised before `before` rolled up since, and no
    invoice for `before` yet."""
    with connection.cursor() as cursor:
        cursor.execute(CHANGED_SINCE_FINALISED.format(
            columns="DISTINCT invoice.organization_id", organization="")
            + """ AND NOT EXISTS (SELECT 1 FROM billing_invoice later
                                  WHERE later.organization_id = invoice.organization_id
                                    AND later.month = %(before)s)""", {"before": before})
        return [organization_id for (organization_id,) in cursor.fetchall()]


def _unbilled_months(*, before: date, since: date) -> Iterable[tuple[UUID, date]]:
    """(organisation, month) pairs from `since` up to `before` with usage and no invoice, in
    month order."""
    start, _ = month_bounds(since)
    end, _ = month_bounds(before)
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT DISTINCT used.organization_id, used.month FROM (
                SELECT organization_id, date_trunc('month', hour, 'UTC')::date AS month
                FROM billing_gpuhour WHERE hour >= %(start)s AND hour < %(end)s
                UNION
                SELECT organization_id, date_trunc('month', hour, 'UTC')::date
                FROM billing_tokenhour WHERE hour >= %(start)s AND hour < %(end)s
            ) used
            WHERE NOT EXISTS (SELECT 1 FROM billing_invoice invoice
                              WHERE invoice.organization_id = used.organization_id
                                AND invoice.month = used.month)
            ORDER BY used.month""", {"start": start, "end": end})
        return cursor.fetchall()


def billed_phases() -> list[str]:
    return list(settings.KVRUN_BILLED_PHASES)
