"""An organisation's quotas, held while a change that would use them is written."""

from uuid import UUID

from django.core.exceptions import ValidationError

from accounts.models import Organization
from accounts.selectors import quota_of
from endpoints.models import GPUType
from endpoints.selectors import quota_used_by
from engine.sizing import CPU


def hold_quota(*, organization_id: UUID, gpu_type: GPUType, gpu_count: int, replicas: int,
                new_endpoint: bool = False, excluding: UUID | None = None) -> None:
    """Lock the organisation's row until the transaction ends, then refuse, with its reason,
    when billing holds the organisation (billing_hold), and, saying which quota and how to
    raise it, when the organisation's endpoints (but `excluding`) together with one
    of `replicas` replicas on `gpu_count` GPUs each would pass a quota (a CPU engine holds no
    GPU). Call it inside the transaction that writes the change: a second caller waits for
    the row and then counts what the first one wrote."""
    gpus = 0 if gpu_type.slug == CPU else gpu_count
    organization = Organization.objects.select_for_update().get(id=organization_id)
    if organization.billing_hold:
        raise ValidationError(organization.billing_hold)
    quota = quota_of(organization=organization)
    used = quota_used_by(organization_id=organization_id, excluding=excluding)
    raise_it = "ask an operator to raise the organisation's quota"
    if new_endpoint and used.endpoints + 1 > quota.endpoints:
        raise ValidationError(
            f"This organisation may have {quota.endpoints} endpoint(s) and has "
            f"{used.endpoints}; delete one, or {raise_it}.")
    if used.replicas + replicas > quota.replicas:
        raise ValidationError(
            f"This organisation's running endpoints may have {quota.replicas} replica(s) at "
            f"most, all together; they have {used.replicas} and this needs {replicas}. Lower "
            f"max_replicas, stop or delete an endpoint, or {raise_it}.")
    if used.gpus + gpus * replicas > quota.gpus:
        raise ValidationError(
            f"This organisation's running endpoints may hold {quota.gpus} GPU(s) at their most "
            f"replicas; they hold {used.gpus} and this needs {gpus * replicas} ({replicas} × "
            f"{gpus}). Lower max_replicas, stop or delete an endpoint, or {raise_it}.")
