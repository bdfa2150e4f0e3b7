"""Spend caps, enforced in flight rather than after the fact, and the hold that stops an
organisation's endpoints (for its budget, or for a payment that failed past its grace).

Every KVRUN_BUDGET_CHECK_SECONDS the month's spend so far (its draft lines, rolled up just
before) plus what the replicas holding GPUs now would cost until the next check is set
against each budget. Each threshold that projection reaches records one event; at 100 % a
"stop" budget holds the organisation (the gateway refuses its requests, no endpoint of it may
start) and stops its endpoints. Because the check looks one interval ahead, spend passes the
limit only by what starts between two checks and what the engines cost while they stop: at
most the run rate × (KVRUN_BUDGET_CHECK_SECONDS + KVRUN_ENGINE_STOP_GRACE_SECONDS), plus the
token charges of one interval where tokens are priced. The hold lifts when the budget's limit is
changed to one the projection has not reached, when it alerts only or is removed, or when the
month ends; the endpoints stay stopped until someone starts them.
"""

import logging
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import Organization, Role
from accounts.services import do_set_billing_hold, require_manager
from billing.invoicing import lines_for_month, month_of
from billing.models import BillingAccount, Budget, BudgetAction, BudgetEvent
from billing.money import cents, usd
from billing.selectors import hourly_run_rate
from endpoints.models import DesiredState
from endpoints.selectors import endpoints_of
from endpoints.services import do_stop_endpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Spend:
    month: date
    so_far_cents: int
    run_rate_usd: Decimal  # what the replicas holding GPUs now cost an hour
    projected_cents: int  # so far, plus what runs now costs until the next check


def spend_of(*, organization: Organization, now: datetime | None = None) -> Spend:
    now = now or timezone.now()
    month = month_of(now)
    so_far = sum(line.amount_cents for line in lines_for_month(organization_id=organization.id,
                                                               month=month))
    rate = hourly_run_rate(organization=organization)
    ahead = rate * Decimal(settings.KVRUN_BUDGET_CHECK_SECONDS) / 3600
    return Spend(month=month, so_far_cents=so_far, run_rate_usd=rate,
                 projected_cents=so_far + cents(ahead))


def do_set_budget(*, organization: Organization, actor_role: str | None,
                  monthly_limit_cents: int, thresholds: list[int], action: str) -> Budget:
    """Set the organisation's budget and check it at once, so that a raised budget lifts its
    hold now. Raises ValidationError for a limit below a cent, or thresholds outside
    1–1000 % or more than MAX_BUDGET_THRESHOLDS of them."""
    require_manager(actor_role, "set the budget")
    values = {"monthly_limit_cents": monthly_limit_cents, "thresholds": sorted(set(thresholds)),
              "action": action}
    Budget(organization=organization, **values).full_clean(validate_unique=False)
    budget, _ = Budget.objects.update_or_create(organization=organization, defaults=values)
    do_check_budget(budget=budget)
    return budget


def do_remove_budget(*, organization: Organization, actor_role: str | None) -> None:
    require_manager(actor_role, "remove the budget")
    with transaction.atomic():
        Budget.objects.filter(organization=organization).delete()
        do_refresh_hold(organization=organization)


def do_enforce_budgets(*, now: datetime | None = None) -> int:
    """Check every budget, and hold the organisations whose payment has failed for longer
    than KVRUN_PAYMENT_GRACE_SECONDS; returns how many budget events were recorded."""
    events = sum(len(do_check_budget(budget=budget, now=now))
                 for budget in Budget.objects.select_related("organization"))
    for account in (BillingAccount.objects.filter(delinquent_since__isnull=False)
                    .exclude(organization__budget__isnull=False).select_related("organization")):
        _apply_hold(account.organization, budget_reason="", now=now or timezone.now())
    return events


def do_check_budget(*, budget: Budget, now: datetime | None = None) -> list[BudgetEvent]:
    """Record the thresholds the projection has reached this month (each once), and hold and
    stop the organisation, or lift its hold, as the budget says. Returns the new events."""
    now = now or timezone.now()
    organization = budget.organization
    spend = spend_of(organization=organization, now=now)
    limit = budget.monthly_limit_cents
    # Once this limit has stopped the month, it stays stopped: with the endpoints stopped the
    # projection falls back under the limit, and must not start them again.
    stopped_before = (budget.stopped_month, budget.stopped_limit_cents) == (spend.month, limit)
    stop = budget.action == BudgetAction.STOP and (spend.projected_cents >= limit
                                                   or stopped_before)
    if stop and not stopped_before:
        Budget.objects.filter(id=budget.id).update(stopped_month=spend.month,
                                                   stopped_limit_cents=limit)
    reached = [threshold for threshold in budget.thresholds
               if spend.projected_cents * 100 >= threshold * limit]
    new = [event for event in (_record(budget, spend, threshold, stop and threshold >= 100, now)
                               for threshold in reached) if event is not None]
    for event in new:
        logger.warning("organisation %s: %d %% of its monthly budget reached (%d of %d cents "
                       "projected)", organization.slug, event.threshold, spend.projected_cents,
                       limit)
    _apply_hold(organization, budget_reason=_hold_reason(organization, limit, spend)
                if stop else "", now=now)
    return new


def do_refresh_hold(*, organization: Organization, now: datetime | None = None) -> None:
    """Hold the organisation, or lift its hold, as its budget and its payments say now."""
    budget = Budget.objects.filter(organization=organization).first()
    if budget is not None:
        do_check_budget(budget=budget, now=now)
    else:
        _apply_hold(organization, budget_reason="", now=now or timezone.now())


def _apply_hold(organization: Organization, *, budget_reason: str, now: datetime) -> None:
    """One reason at a time, a payment's first: holding stops every running endpoint."""
    account = BillingAccount.objects.filter(organization=organization).first()
    grace = timedelta(seconds=settings.KVRUN_PAYMENT_GRACE_SECONDS)
    unpaid = (account.delinquent_reason if account is not None and account.delinquent_since
              and account.delinquent_since <= now - grace else "")
    reason = unpaid or budget_reason
    do_set_billing_hold(organization_id=organization.id, reason=reason)
    if reason:
        for endpoint in endpoints_of(organization=organization).filter(
                desired_state=DesiredState.RUNNING):
            do_stop_endpoint(endpoint=endpoint, actor_role=Role.OWNER)


def _record(budget: Budget, spend: Spend, threshold: int, stopped: bool,
            now: datetime) -> BudgetEvent | None:
    """The event, once: None when this month's crossing of `threshold` is already recorded."""
    try:
        with transaction.atomic():
            return BudgetEvent.objects.create(
                organization=budget.organization, month=spend.month, threshold=threshold,
                limit_cents=budget.monthly_limit_cents, spend_cents=spend.so_far_cents,
                projected_cents=spend.projected_cents, stopped=stopped, at=now)
    except IntegrityError:
        return None


def _hold_reason(organization: Organization, limit: int, spend: Spend) -> str:
    return (f"This organisation's monthly budget of {usd(limit)} is reached "
            f"({usd(spend.projected_cents)} for {spend.month:%B %Y}, projected to the next "
            f"check), so its endpoints are stopped. An owner or admin can raise the budget "
            f"under Usage & billing ({settings.KVRUN_BASE_URL}/orgs/{organization.slug}/"
            f"billing/) and then start them again.")
