"""An endpoint's deployment: create it, scale it by hand, stop, start, restart and delete it."""


from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import Organization, User
from accounts.services import require_manager
from endpoints.dispatch import reconcile_after_commit
from endpoints.lifecycle import do_stop_replica
from endpoints.models import (
    LORA_RANK_REFUSAL,
    LORA_RANKS,
    MAX_LORA_ADAPTERS,
    MAX_LORA_HOST_ADAPTERS,
    MIN_CONTEXT_LENGTH,
    DesiredState,
    Endpoint,
    EndpointEvent,
    GPUType,
    ModelSpec,
    Region,
    Replica,
    State,
    validate_endpoint_name,
)
from endpoints.planning import check_tiers, lora_refusal, plan
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.scheduling import Placement
from endpoints.services.quota import hold_quota, lock_organization
from endpoints.services.scaling import scaling_errors
from endpoints.states import ASKED_FOR
from engine import tasks

# Names the dashboard's URLs use beside endpoint names (/orgs/<slug>/endpoints/new/).
RESERVED_NAMES = frozenset({"new"})


def context_length_refusal(*, model: ModelSpec, context_length: int) -> str | None:
    """Why `context_length` cannot be asked of `model`, in words a person can act on; None
    when it can."""
    if context_length < MIN_CONTEXT_LENGTH:
        return f"Ask for at least {MIN_CONTEXT_LENGTH} tokens of context."
    if context_length > model.max_context:
        return (f"{model.name} supports at most {model.max_context:,} tokens of context; "
                f"ask for {model.max_context:,} or fewer.")
    return None


def policy_refusals(*, model: ModelSpec, policy: EndpointPolicy) -> dict[str, list[str]]:
    """What is wrong with `policy`'s LoRA settings, or its KV tiers, for `model`, by field;
    empty when nothing. An embedding model or a reranker keeps no prefixes to tier."""
    errors: dict[str, list[str]] = {}
    if model.task in tasks.POOLING:
        for field, size in (("host_tier_gib", policy.host_tier_gib),
                            ("disk_tier_gib", policy.disk_tier_gib)):
            if size:
                errors[field] = [f"{model.name} serves {model.get_task_display()}: it reads "
                                 "each input once and keeps no prefixes to tier. Set 0."]
    if policy.lora_max_rank not in LORA_RANKS:
        errors["lora_max_rank"] = [LORA_RANK_REFUSAL]
    if not 0 <= policy.lora_adapters <= MAX_LORA_ADAPTERS:
        errors["lora_adapters"] = [f"Hold between 0 (no adapters) and {MAX_LORA_ADAPTERS} "
                                   "adapters on the device at once."]
    elif policy.lora_adapters and (refusal := lora_refusal(model)):
        errors["lora_adapters"] = [refusal]
    host = policy.lora_host_adapters
    if host and not policy.lora_adapters <= host <= MAX_LORA_HOST_ADAPTERS:
        errors["lora_host_adapters"] = [
            f"Keep between {max(1, policy.lora_adapters)} (the adapters on the device) and "
            f"{MAX_LORA_HOST_ADAPTERS} adapters in host memory, or 0 for as many as on the "
            "device."]
    return errors


def do_create_endpoint(
    *, organization: Organization, actor_role: str | None, created_by: User | None, name: str,
    model: ModelSpec, policy: EndpointPolicy, scaling: EndpointScaling | None = None,
    gpu_type: GPUType | None = None, gpu_count: int | None = None, region: Region | None = None,
    own_nodes_only: bool = False,
) -> Endpoint:
    """Size and create an endpoint that should run; the reconciler starts its replicas, one
    at least (a fewest of 0 lets it scale to zero once idle). Without `scaling`, one replica
    always. With `region`, its replicas run there alone, and with `own_nodes_only` on its
    organisation's own nodes alone, sized and priced for what is online there.

    Raises ValidationError naming the field to change: a name that does not start with a
    letter, a context above the model's maximum, scaling settings out of range (as
    do_change_endpoint_scaling), a duplicate name, or a request that fits no GPU (saying
    what does, or a KV tier the hardware's vLLM cannot use, saying why); and one naming the
    quota when the organisation's endpoints, GPUs or replicas would pass it. The
    organisation row is held while its quota is checked, so that two creates at once cannot
    both take its last room.
    """
    require_manager(actor_role, "create endpoints")
    scaling = scaling or EndpointScaling()
    errors: dict[str, list[str]] = {}
    try:
        validate_endpoint_name(name)
    except ValidationError as exc:
        errors["name"] = exc.messages
    if name in RESERVED_NAMES:
        errors["name"] = [f"{name!r} is reserved; choose another name."]
    if refusal := context_length_refusal(model=model, context_length=policy.context_length):
        errors["context_length"] = [refusal]
    errors.update(scaling_errors(scaling))
    errors.update(policy_refusals(model=model, policy=policy))
    if errors:
        raise ValidationError(errors)
    placement = Placement(region=region, organization_id=organization.id,
                          own_nodes_only=own_nodes_only)
    decided = plan(model=model, context_length=policy.context_length,
                   concurrency=policy.concurrency, kv_cache_dtype=policy.kv_cache_dtype,
                   gpu_type=gpu_type, gpu_count=gpu_count, host_tier_gib=policy.host_tier_gib,
                   disk_tier_gib=policy.disk_tier_gib, lora_adapters=policy.lora_adapters,
                   lora_max_rank=policy.lora_max_rank, placement=placement)
    check_tiers(host_tier_gib=policy.host_tier_gib, disk_tier_gib=policy.disk_tier_gib,
                gpu_type=decided.gpu_type, gpu_count=decided.gpu_count, placement=placement)
    try:
        with transaction.atomic():
            hold_quota(organization_id=organization.id, new_endpoint=True,
                        gpu_type=decided.gpu_type, gpu_count=decided.gpu_count,
                        replicas=scaling.max_replicas, own_nodes_only=own_nodes_only)
            endpoint = Endpoint.objects.create(
                organization=organization, name=name, model=model,
                gpu_type=decided.gpu_type, gpu_count=decided.gpu_count, region=region,
                own_nodes_only=own_nodes_only,
                **policy.as_fields(), **scaling.as_fields(),
                # One replica to begin with, even where the endpoint may scale to zero: it
                # was created to be used.
                desired_replicas=max(1, scaling.min_replicas), sizing=decided.summary,
                hourly_price_usd=placement.hourly_price(decided.gpu_type) * decided.gpu_count,
                created_by=created_by,
            )
            EndpointEvent.objects.create(endpoint=endpoint, state=State.PENDING,
                                         message=f"created: {decided.summary['explanation']}")
    except IntegrityError:
        raise ValidationError(
            {"name": [f"An endpoint named {name!r} already exists in this organisation; "
                      "choose another name."]}) from None
    reconcile_after_commit(endpoint)
    return endpoint


def do_scale_endpoint(*, endpoint: Endpoint, actor_role: str | None, replicas: int) -> Endpoint:
    require_manager(actor_role, "scale endpoints")
    fewest = max(1, endpoint.min_replicas)
    if not fewest <= replicas <= endpoint.max_replicas:
        # Below min_replicas nothing would bring it back up but load: the range is the
        # autoscaler's, and it is changed with the scaling settings.
        raise ValidationError({"replicas": [
            f"Choose between {fewest} and {endpoint.max_replicas}, the most replicas "
            "(max_replicas); to run fewer, lower the fewest replicas (min_replicas), or stop "
            "the endpoint."]})
    # A change by hand is the last change: the autoscaler leaves it a window before judging.
    Endpoint.objects.filter(id=endpoint.id).update(desired_replicas=replicas,
                                                   last_scaled_at=timezone.now())
    EndpointEvent.objects.create(endpoint=endpoint, state=endpoint.state,
                                 message=f"scaled to {replicas} replica(s)")
    reconcile_after_commit(endpoint)
    endpoint.desired_replicas = replicas
    return endpoint


def do_stop_endpoint(*, endpoint: Endpoint, actor_role: str | None) -> Endpoint:
    require_manager(actor_role, "stop endpoints")
    Endpoint.objects.filter(id=endpoint.id).update(desired_state=DesiredState.STOPPED)
    reconcile_after_commit(endpoint)
    endpoint.desired_state = DesiredState.STOPPED
    return endpoint


def do_start_endpoint(*, endpoint: Endpoint, actor_role: str | None) -> Endpoint:
    """Run a stopped or failed endpoint again, with a fresh failure count.

    Raises ValidationError naming the quota when the organisation's other running endpoints
    and this one would pass its GPU or replica quota (a stopped endpoint holds neither).
    """
    require_manager(actor_role, "start endpoints")
    with transaction.atomic():
        hold_quota(organization_id=endpoint.organization_id, excluding=endpoint.id,
                    gpu_type=endpoint.gpu_type, gpu_count=endpoint.gpu_count,
                    replicas=endpoint.max_replicas, own_nodes_only=endpoint.own_nodes_only)
        Endpoint.objects.filter(id=endpoint.id).update(desired_state=DesiredState.RUNNING,
                                                       state=State.PENDING, failure_reason="")
        Replica.objects.filter(endpoint=endpoint, state=State.FAILED).update(
            state=State.STOPPED, stopped_at=timezone.now())
        EndpointEvent.objects.create(endpoint=endpoint, state=State.PENDING, message="started")
    reconcile_after_commit(endpoint)
    endpoint.refresh_from_db()
    return endpoint


def do_restart_endpoint(*, endpoint: Endpoint, actor_role: str | None) -> int:
    """Replace every replica of an endpoint with a fresh one, and start it if it was stopped or
    failed (with a fresh failure count, as do_start_endpoint does).

    Its live replicas are stopped as the reconciler stops them (engines get their stop once
    this commits); the reconciler then starts new ones. Returns how many replicas it stopped.
    Raises ValidationError for a deleted endpoint.
    """
    require_manager(actor_role, "restart endpoints")
    with transaction.atomic():
        lock_organization(endpoint.organization_id)  # before the endpoint, as starting does
        # Held like a reconciler pass holds it, so no pass adds a replica this would miss.
        locked = Endpoint.objects.select_for_update().filter(
            id=endpoint.id, deleted_at=None).first()
        if locked is None:
            raise ValidationError(f"The endpoint {endpoint.name!r} is deleted; it cannot restart.")
        replicas = list(locked.replicas.filter(state__in=ASKED_FOR).select_related("node"))
        EndpointEvent.objects.create(endpoint=locked, state=locked.state,
                                     message=f"restarting: replacing {len(replicas)} replica(s)")
        stopped = sum(
            do_stop_replica(replica=replica, reason="restarting: a fresh replica replaces it")
            for replica in replicas)
        do_start_endpoint(endpoint=endpoint, actor_role=actor_role)
    return stopped


def do_delete_endpoint(*, endpoint: Endpoint, actor_role: str | None) -> None:
    """Stop the endpoint and hide it; its rows stay for usage and billing. The name is free
    again."""
    require_manager(actor_role, "delete endpoints")
    Endpoint.objects.filter(id=endpoint.id, deleted_at=None).update(
        deleted_at=timezone.now(), desired_state=DesiredState.STOPPED)
    reconcile_after_commit(endpoint)
