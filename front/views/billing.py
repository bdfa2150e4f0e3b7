"""Usage and billing: the month so far and where it is heading, the budget and its events,
daily GPU-hours and tokens, invoices with their lines, the ledger rows behind each line, and
CSV. Owners and admins."""

import csv
from datetime import date
from decimal import Decimal

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from billing import payments, selectors
from billing.budgets import do_remove_budget, do_set_budget, spend_of
from billing.invoicing import month_bounds, month_label
from billing.models import BillingAccount, Budget, BudgetEvent, LineKind
from billing.money import cents
from front.forms import BudgetForm
from front.scoping import Member, membership
from kvrun.common.forms import add_service_errors

ROWS_SHOWN = 200
BUDGET_EVENTS_PER_PAGE = 20  # newest first


def _manager(request: HttpRequest, org_slug: str) -> Member:
    member = membership(request, org_slug)
    if not member.manages:
        raise PermissionDenied("Only owners and admins see billing; ask one of them.")
    return member


def _invoice(member: Member, month: date) -> selectors.InvoiceView:
    invoice = selectors.invoice_of(organization=member.organization, month=month)
    if invoice is None:
        raise Http404("That month has not begun.")
    return invoice


@login_required
def billing(request: HttpRequest, org_slug: str, budget_form: BudgetForm | None = None,
            status: int = 200) -> HttpResponse:
    member = _manager(request, org_slug)
    organization = member.organization
    now = timezone.now()
    spend = spend_of(organization=organization, now=now)
    hours_left = Decimal((month_bounds(spend.month)[1] - now).total_seconds()) / 3600
    daily = selectors.daily_usage(organization=organization, now=now)
    budget = Budget.objects.filter(organization=organization).first()
    form = budget_form or BudgetForm(initial={
        "monthly_limit_usd": Decimal(budget.monthly_limit_cents).scaleb(-2),
        "thresholds": ", ".join(str(threshold) for threshold in budget.thresholds),
        "action": budget.action} if budget else None)
    return render(request, "front/billing.html", {
        "account": BillingAccount.objects.filter(organization=organization).first(),
        "stripe_on": payments.configured(),
        "budget": budget, "budget_form": form,
        "budget_events": Paginator(
            BudgetEvent.objects.filter(organization=organization, month=spend.month)
            .order_by("-at", "-id"), BUDGET_EVENTS_PER_PAGE).get_page(request.GET.get("events")),
        "member": member, "organization": organization, "section": "billing",
        "so_far_cents": spend.so_far_cents, "run_rate_usd": spend.run_rate_usd,
        "projected_cents": spend.so_far_cents + cents(spend.run_rate_usd * hours_left),
        "month": spend.month,
        "invoices": selectors.invoices_of(organization=organization, now=now),
        "tokens_by_model": selectors.tokens_by_model(organization=organization,
                                                     month=spend.month),
        "daily": {"days": [f"{row['day']:%Y-%m-%d}" for row in daily],
                  "gpu_hours": [float(round(row["gpu_hours"], 3)) for row in daily],
                  "prompt_tokens": [row["prompt_tokens"] for row in daily],
                  "completion_tokens": [row["completion_tokens"] for row in daily]},
        "billed_phases": settings.KVRUN_BILLED_PHASES,
        "budget_check_seconds": settings.KVRUN_BUDGET_CHECK_SECONDS,
    }, status=status)


@login_required
@require_POST
def set_budget(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = _manager(request, org_slug)
    form = BudgetForm(request.POST)
    if not form.is_valid():
        return billing(request, org_slug, budget_form=form, status=400)
    try:
        do_set_budget(organization=member.organization, actor_role=member.role,
                      monthly_limit_cents=form.monthly_limit_cents,
                      thresholds=form.cleaned_data["thresholds"],
                      action=form.cleaned_data["action"])
    except ValidationError as exc:
        add_service_errors(form, exc)
        return billing(request, org_slug, budget_form=form, status=400)
    messages.success(request, "Budget saved; it is checked every "
                              f"{settings.KVRUN_BUDGET_CHECK_SECONDS} s.")
    return redirect("billing", org_slug=member.organization.slug)


@login_required
@require_POST
def remove_budget(request: HttpRequest, org_slug: str) -> HttpResponse:
    member = _manager(request, org_slug)
    do_remove_budget(organization=member.organization, actor_role=member.role)
    messages.success(request, "Budget removed.")
    return redirect("billing", org_slug=member.organization.slug)


@login_required
@require_POST
def add_payment_method(request: HttpRequest, org_slug: str) -> HttpResponse:
    """To Stripe Checkout, which takes the card and comes back to the billing page."""
    member = _manager(request, org_slug)
    back = request.build_absolute_uri(reverse("billing", args=[member.organization.slug]))
    try:
        return redirect(payments.checkout_url(organization=member.organization, return_url=back))
    except payments.StripeUnavailable as exc:
        messages.error(request, f"Stripe could not open its payment page ({exc}); try again "
                                "in a minute.")
        return redirect("billing", org_slug=member.organization.slug)


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
    line = shown.line(number)
    if line is None:
        raise Http404("No such line on this invoice.")
    rows = selectors.usage_behind(organization=member.organization, line=line,
                                  billed_at=shown.finalized_at)
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
    name = shown.number or f"draft-{month_label(month)}"
    response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
    writer = csv.writer(response)
    writer.writerow(["invoice", "status", "month", "line", "description", "kind", "endpoint",
                     "adapter", "phase", "own_nodes", "usage_month", "adjustment",
                     "period_start", "period_end", "quantity", "unit", "unit_price_usd",
                     "amount_usd"])
    for number, line in enumerate(shown.lines, 1):
        writer.writerow([
            shown.number, shown.status, month_label(month), number, line.description, line.kind,
            line.endpoint_name, line.adapter, line.phase, line.own_node,
            month_label(line.usage_month), line.adjustment,
            line.period_start.isoformat(), line.period_end.isoformat(), line.quantity,
            line.unit, line.unit_price_usd, Decimal(line.amount_cents).scaleb(-2)])  # 1.50
    return response
