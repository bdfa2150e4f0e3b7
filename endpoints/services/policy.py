"""An endpoint's KV policy, changed on its hardware."""

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from accounts.services import require_manager
from endpoints.dispatch import reconcile_after_commit
from endpoints.models import Adapter, Endpoint, EndpointEvent
from endpoints.planning import check_tiers, plan
from endpoints.policies import EndpointPolicy
from endpoints.scheduling import Placement
from endpoints.services.deployment import context_length_refusal, policy_refusals


def do_change_endpoint_policy(*, endpoint: Endpoint, actor_role: str | None,
                              changes: Mapping[str, Any]) -> str:
    """Change an endpoint's KV policy on its hardware, and say what happens next.

    `changes` names EndpointPolicy's fields, only those that change; the policy they make
    with the rest of the endpoint's is judged whole.

    The new policy is admitted as a new endpoint's is (planning.plan on the endpoint's GPU
    type and count): one that does not fit raises ValidationError naming the field and what
    would fit, and changes nothing. A change to what engines start with raises the policy
    version, and the reconciler replaces the replicas one at a time (_roll_to_new_policy);
    routing and isolation apply within the gateway's route cache, with no restart.
    """
    require_manager(actor_role, "change endpoints")
    with transaction.atomic():
        # Held while the change is admitted: two changes at once are judged one after the
        # other, each against the policy the other left.
        locked = Endpoint.objects.select_for_update().select_related("model", "gpu_type").get(
            id=endpoint.id)
        policy = EndpointPolicy.of(locked).changed(changes)
        if refusal := context_length_refusal(model=locked.model,
                                             context_length=policy.context_length):
            raise ValidationError({"context_length": [refusal]})
        if errors := policy_refusals(model=locked.model, policy=policy) or _adapters_left_out(
                locked, policy):
            raise ValidationError(errors)
        decided = plan(model=locked.model, context_length=policy.context_length,
                       concurrency=policy.concurrency, kv_cache_dtype=policy.kv_cache_dtype,
                       gpu_type=locked.gpu_type, gpu_count=locked.gpu_count,
                       host_tier_gib=policy.host_tier_gib, disk_tier_gib=policy.disk_tier_gib,
                       lora_adapters=policy.lora_adapters, lora_max_rank=policy.lora_max_rank,
                       placement=Placement.of(locked), judge_placement=False)
        if (policy.host_tier_gib > locked.host_tier_gib
                or policy.disk_tier_gib > locked.disk_tier_gib):  # judged only as they grow
            check_tiers(host_tier_gib=policy.host_tier_gib, disk_tier_gib=policy.disk_tier_gib,
                        gpu_type=locked.gpu_type, gpu_count=locked.gpu_count,
                        placement=Placement.of(locked))
        wanted = policy.as_fields()
        changed = [name for name, value in wanted.items() if value != getattr(locked, name)]
        if not changed:
            return "Nothing changed."
        restarts = [name for name in changed if name in EndpointPolicy.ENGINE_FIELDS]
        for name in changed:
            setattr(locked, name, wanted[name])
        if restarts:
            locked.policy_version += 1
            locked.sizing = decided.summary
        locked.save(update_fields=[*changed, "policy_version", "sizing"])
        if not restarts:
            outcome = "It applies to new requests within seconds; no replica restarts."
        elif locked.desired_replicas > 1:
            outcome = (f"Its {locked.desired_replicas} replicas restart one at a time, each "
                       "once the others are ready: the endpoint serves throughout.")
        else:
            outcome = ("Its one replica restarts: requests get 503 until the new engine is "
                       "ready. Scale to two replicas first to change it without a break.")
        EndpointEvent.objects.create(
            endpoint=locked, state=locked.state,
            message=f"policy changed ({', '.join(f'{name} {wanted[name]}' for name in changed)})"
                    f": {outcome}")
    if restarts:
        reconcile_after_commit(endpoint)
    endpoint.refresh_from_db()
    return outcome


def _adapters_left_out(endpoint: Endpoint, policy: EndpointPolicy) -> dict[str, list[str]]:
    """The endpoint's adapters that `policy` could no longer serve, by the field that would
    leave them out: none may be lost silently (their requests would wait without end)."""
    adapters = list(Adapter.objects.filter(endpoint=endpoint).order_by("-rank", "name"))
    if adapters and not policy.lora_adapters:
        names = ", ".join(adapter.name for adapter in adapters)
        return {"lora_adapters": [f"{endpoint.name} serves the adapters {names}: remove them "
                                  "first, or keep at least one LoRA slot."]}
    over = [adapter for adapter in adapters if adapter.rank > policy.lora_max_rank]
    if over:
        names = ", ".join(f"{adapter.name} (rank {adapter.rank})" for adapter in over)
        return {"lora_max_rank": [f"{endpoint.name} serves {names}: keep the largest rank at "
                                  f"{over[0].rank} or more, or remove them first."]}
    return {}
