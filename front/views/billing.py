"""Usage and billing: the month so far and where it is heading, daily GPU-hours and tokens,
invoices with their lines, the ledger rows behind each line, and CSV. Owners and admins."""

import csv
from datetime import date
from decimal import Decimal

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from billing import selectors
from billing.invoicing import cents, lines_for_month, month_bounds, month_of
from billing.models import LineKind
from front.scoping import Member, membership

ROWS_SHOWN = 200


def _manager(request: HttpRequest, org_slug: str) -> Member:
    member = membership(request, org_slug)
    if not member.manages:
        raise PermissionDenied("Only owners and admins see billing; ask one of them.")
    return member


def _invoice(member: Member, month: date) -> selectors.InvoiceView:
    if month > month_of(timezone.now()):
        raise Http404("That month has not begun.")
    return selectors.invoice_of(organization=member.organization, month=month)


@login_required
def billing(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = _manager(request, org_slug)
    organization = member.organization
    now = timezone.now()
    so_far = sum(line.amount_cents for line in lines_for_month(
        organization_id=organization.id, month=month_of(now)))
    run_rate = selectors.hourly_run_rate(organization=organization)
    hours_left = Decimal((month_bounds(month_of(now))[1] - now).total_seconds()) / 3600
    daily = selectors.daily_usage(organization=organization, now=now)
    return render(request, "front/billing.html", {
        "member": member, "organization": organization, "section": "billing",
        "so_far_cents": so_far, "run_rate_usd": run_rate,
        "projected_cents": so_far + cents(run_rate * hours_left), "month": month_of(now),
        "invoices": selectors.invoices_of(organization=organization, now=now),
        "daily": {"days": [f"{row['day']:%Y-%m-%d}" for row in daily],
                  "gpu_hours": [float(round(row["gpu_hours"], 3)) for row in daily],
                  "prompt_tokens": [row["prompt_tokens"] for row in daily],
                  "completion_tokens": [row["completion_tokens"] for row in daily]},
        "billed_phases": settings.KVRUN_BILLED_PHASES,
    })


@login_required
def invoice(request: HttpRequest, org_slug: str, month: date) -> HttpResponse:
    member = _manager(request, org_slug)
    return render(request, "front/invoice.html", {
        "member": member, "organization": member.organization, "section": "billing",
        "invoice": _invoice(member, month), "billed_phases": settings.KVRUN_BILLED_PHASES})


@login_required
def invoice_line(request: HttpRequest, org_slug: str, month: date, number: int) -> HttpResponse:
    member = _manager(request, org_slug)
    shown = _invoice(member, month)
    if not 1 <= number <= len(shown.lines):
        raise Http404("No such line on this invoice.")
    line = shown.lines[number - 1]
    rows = selectors.usage_behind(organization=member.organization, line=line)
    return render(request, "front/invoice_line.html", {
        "member": member, "organization": member.organization, "section": "billing",
        "invoice": shown, "line": line, "number": number, "count": rows.count(),
        "rows": rows[:ROWS_SHOWN], "intervals": line.kind == LineKind.GPU_TIME,
        "rows_shown": ROWS_SHOWN})


@login_required
def invoice_csv(request: HttpRequest, org_slug: str, month: date) -> HttpResponse:
    member = _manager(request, org_slug)
    shown = _invoice(member, month)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    name = shown.number or f"draft-{month:%Y-%m}"
    response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
    writer = csv.writer(response)
    writer.writerow(["invoice", "status", "month", "line", "description", "kind", "endpoint",
                     "phase", "usage_month", "adjustment", "period_start", "period_end",
                     "quantity", "unit", "unit_price_usd", "amount_usd"])
    for number, line in enumerate(shown.lines, 1):
        writer.writerow([
            shown.number, shown.status, f"{month:%Y-%m}", number, line.description, line.kind,
            line.endpoint_name, line.phase, f"{line.usage_month:%Y-%m}", line.adjustment,
            line.period_start.isoformat(), line.period_end.isoformat(), line.quantity,
            line.unit, line.unit_price_usd, Decimal(line.amount_cents) / 100])
    return response
