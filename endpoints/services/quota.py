"""An organisation's quotas, held while a change that would use them is written."""

from uuid import UUID

from django.conf import settings
from django.core.exceptions import ValidationError

from accounts.models import Organization, Role, User
from accounts.selectors import QUOTAS, Quota, QuotaScope, quota_scope
from endpoints.models import GPUType
from endpoints.selectors import quota_used_by
from engine.sizing import CPU


def lock_organization(organization_id: UUID) -> Organization:
    """The organisation's row, held until the transaction ends: taken first by every change
    that holds quota, before any endpoint's row, so that two of them never wait on each other
    in turn."""
    return Organization.objects.select_for_update(no_key=True).get(id=organization_id)


def hold_quota(*, organization_id: UUID, gpu_type: GPUType, gpu_count: int, replicas: int,
               own_nodes_only: bool, new_endpoint: bool = False,
               excluding: UUID | None = None) -> None:
    """Lock the organisation's row and its owners' rows until the transaction ends, then
    refuse, with a sentence saying what to do:
    - when billing holds the organisation (billing_hold);
    - when an owner has not confirmed their email address (sign-up costs nothing, so an
      unconfirmed address may hold no hardware, a CPU engine's included);
    - for GPUs, where kvrun takes payment, when the organisation has no payment method on
      file and no operator's approval (gpus_approved), unless the endpoint runs on its own
      nodes alone (`own_nodes_only`) while they cost nothing;
    - when its endpoints (but `excluding`) together with one of `replicas` replicas on
      `gpu_count` GPUs each (a CPU engine holds no GPU) would pass a quota, counted as
      accounts.selectors.quota_scope says: on the deployment's defaults, over every
      organisation its owners own.
    Call it inside the transaction that writes the change: a second caller, in this
    organisation or another of its owners', waits for the rows and counts what the first one
    wrote."""
    gpus = 0 if gpu_type.slug == CPU else gpu_count
    organization = lock_organization(organization_id)
    if organization.billing_hold:
        raise ValidationError(organization.billing_hold)
    # FOR NO KEY UPDATE, of the users alone: rows that reference them (an endpoint's
    # created_by) are still written beside it.
    owners = list(User.objects.select_for_update(no_key=True, of=("self",)).order_by("id")
                  .filter(memberships__organization=organization,
                          memberships__role=Role.OWNER))
    unconfirmed = [owner.email for owner in owners if owner.email_verified_at is None]
    if unconfirmed:
        raise ValidationError(
            f"Endpoints run only once the organisation's owners have confirmed their email "
            f"address, and {', '.join(unconfirmed)} has not yet: open the link kvrun sent, "
            f"or have a new one sent from the dashboard.")
    if gpus and _payment_needed(organization, gpu_type=gpu_type, own_nodes_only=own_nodes_only):
        raise ValidationError(
            "GPU endpoints need a payment method on file: add a card on the organisation's "
            "billing page, or ask an operator to approve the organisation. CPU endpoints "
            "need none.")
    needs = Quota(endpoints=int(new_endpoint), gpus=gpus * replicas, replicas=replicas)
    for quota in QUOTAS:
        if not getattr(needs, quota):
            continue
        scope = quota_scope(organization=organization, owner_ids=[o.id for o in owners],
                            quota=quota)
        used = quota_used_by(organization_ids=scope.organization_ids, excluding=excluding)
        if getattr(used, quota) + getattr(needs, quota) > scope.most:
            raise ValidationError(_past(quota, scope=scope, used=used, needs=needs, gpus=gpus))


def _payment_needed(organization: Organization, *, gpu_type: GPUType,
                    own_nodes_only: bool) -> bool:
    # kvrun takes payment where Stripe's key is set (billing.payments.configured, which this
    # layer may not import).
    if not settings.STRIPE_SECRET_KEY or organization.gpus_approved or (
            own_nodes_only and not gpu_type.own_node_price_usd):
        return False
    return not Organization.objects.filter(
        id=organization.id, billing_account__payment_method__gt="").exists()


def _past(quota: str, *, scope: QuotaScope, used: Quota, needs: Quota, gpus: int) -> str:
    others = len(scope.organization_ids) - 1
    whose, has = "this organisation", "has"
    if others:
        whose, has = ("its owners' organisations on the deployment's default quotas (this one "
                      f"and {others} more)"), "have"
    raise_it = "ask an operator to raise the organisation's quota"
    change = f"stop or delete an endpoint, or {raise_it}"
    if quota == "endpoints":
        return (f"{whose[0].upper()}{whose[1:]} may have {scope.most} endpoint(s) and {has} "
                f"{used.endpoints}; delete one, or {raise_it}.")
    if quota == "replicas":
        return (f"The running endpoints of {whose} may have {scope.most} replica(s) at most, "
                f"all together; they have {used.replicas} and this needs {needs.replicas}. "
                f"Lower max_replicas, {change}.")
    return (f"The running endpoints of {whose} may hold {scope.most} GPU(s) at their most "
            f"replicas; they hold {used.gpus} and this needs {needs.gpus} ({needs.replicas} "
            f"× {gpus}). Lower max_replicas, {change}.")
