"""Writes for catalogs, node liveness and endpoints. Nodes register and heartbeat through
their agent (nodes.services)."""

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import Organization, User
from accounts.selectors import quota_of
from accounts.services import require_manager
from endpoints.lifecycle import do_stop_replica
from endpoints.models import (
    DEFAULT_IDLE_SECONDS,
    LONGEST_WINDOW_SECONDS,
    MAX_IDLE_SECONDS,
    MAX_REPLICAS_PER_ENDPOINT,
    MIN_CONTEXT_LENGTH,
    SHORTEST_WINDOW_SECONDS,
    CacheIsolation,
    DesiredState,
    Endpoint,
    EndpointEvent,
    GPUType,
    ModelSpec,
    Node,
    NodeState,
    Replica,
    ScalingMetric,
    State,
    validate_endpoint_name,
)
from endpoints.planning import plan
from endpoints.selectors import quota_used_by
from endpoints.states import ASKED_FOR, ON_NODE
from engine import hf_checkpoint
from engine.sizing import CPU

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"
# Names the dashboard's URLs use beside endpoint names (/orgs/<slug>/endpoints/new/).
RESERVED_NAMES = frozenset({"new"})


def do_load_catalogs(*, directory: Path = CATALOG_DIR) -> tuple[int, int]:
    """Insert or update every model and GPU type from the catalog files, keyed by slug.

    Returns (models, gpu types) loaded. Rows not in the files are left alone, so an
    operator's additions survive a reload. A GPU type's price is the catalog's only when it
    is first loaded: from then on prices change by version (billing.models.GPUPrice), which
    bill and, once in effect, quote (billing.rollup.do_quote_prices_in_effect).
    """
    models = json.loads((directory / "models.json").read_text())
    gpus = json.loads((directory / "gpus.json").read_text())
    with transaction.atomic():
        _upsert(ModelSpec, models)
        _upsert(GPUType, gpus, kept=("hourly_price_usd",))
    return len(models), len(gpus)


Catalog = TypeVar("Catalog", ModelSpec, GPUType)


def _upsert(model: type[Catalog], rows: list[dict], kept: tuple[str, ...] = ()) -> None:
    fields = [name for name in rows[0] if name not in ("slug", *kept)]
    model.objects.bulk_create(
        [model(**row) for row in rows], update_conflicts=True, unique_fields=["slug"],
        update_fields=fields,
    )


def do_mark_lost_nodes() -> int:
    """Mark online or recovering nodes whose heartbeats stopped as lost. Returns how many."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVRUN_NODE_LOST_AFTER_SECONDS)
    return Node.objects.filter(state__in=[NodeState.ONLINE, NodeState.RECOVERING],
                               last_heartbeat_at__lt=cutoff).update(
        state=NodeState.LOST
    )


def do_drain_node(*, node_id: int) -> int:
    """Take no new replicas on the node and move its replicas to other nodes.

    Marks the node draining (scheduling skips it from then on), then stops each replica on it
    the way the reconciler stops one: an event saying the node drains, and the stop sent to
    its agent once that commits; each endpoint's next reconcile places a replacement
    elsewhere. Draining a node that already drains stops whatever is still on it.
    Call it outside a transaction: the mark commits before the replicas are read, so a
    placement that held the node row when it was marked has finished and its replica is moved
    too; and no endpoint row is locked while the node row is held (a reconciler pass locks
    them the other way round). Returns how many replicas it stopped.
    """
    Node.objects.filter(id=node_id, draining=False).update(draining=True)
    name = Node.objects.values_list("name", flat=True).get(id=node_id)
    on_node = Replica.objects.filter(node_id=node_id, state__in=ON_NODE)
    stopped = 0
    for endpoint_id in set(on_node.values_list("endpoint_id", flat=True)):
        with transaction.atomic():
            # The endpoint first, then its replicas, the order a reconciler pass locks them in.
            endpoint = Endpoint.objects.select_for_update().get(id=endpoint_id)
            for replica in on_node.filter(endpoint=endpoint).select_related("node"):
                stopped += do_stop_replica(
                    replica=replica, reason=f"node {name} is draining; moving to another node")
        _reconcile_after_commit(endpoint)
    return stopped


def do_undrain_node(*, node_id: int) -> bool:
    """Let scheduling place replicas on the node again; replicas that moved off stay where they
    are. Returns False when the node was not draining."""
    return Node.objects.filter(id=node_id, draining=True).update(draining=False) == 1


def _reconcile_after_commit(endpoint: Endpoint) -> None:
    from endpoints.tasks import reconcile

    reconcile.delay_on_commit(str(endpoint.id))


def context_length_refusal(*, model: ModelSpec, context_length: int) -> str | None:
    """Why `context_length` cannot be asked of `model`, in words a person can act on; None
    when it can."""
    if context_length < MIN_CONTEXT_LENGTH:
        return f"Ask for at least {MIN_CONTEXT_LENGTH} tokens of context."
    if context_length > model.max_context:
        return (f"{model.name} supports at most {model.max_context:,} tokens of context; "
                f"ask for {model.max_context:,} or fewer.")
    return None


def do_create_endpoint(
    *, organization: Organization, actor_role: str | None, created_by: User | None, name: str,
    model: ModelSpec, context_length: int, concurrency: int, gpu_type: GPUType | None = None,
    gpu_count: int | None = None, min_replicas: int = 1, max_replicas: int | None = None,
    kv_cache_dtype: str = "auto", prefix_caching: bool = True, host_tier_gib: int = 0,
    disk_tier_gib: int = 0, cache_isolation: str = CacheIsolation.ORGANIZATION,
    prefix_affinity: bool = True, scale_to_zero_after_seconds: int = DEFAULT_IDLE_SECONDS,
    scaling_metric: str = ScalingMetric.IN_FLIGHT, scaling_target: float | None = None,
    scale_up_window_seconds: int = 60, scale_down_window_seconds: int = 300,
) -> Endpoint:
    """Size and create an endpoint that should run; the reconciler starts its replicas, one
    at least (min_replicas 0 lets it scale to zero once idle).

    Raises ValidationError naming the field to change: a name that does not start with a
    letter, a context above the model's maximum, scaling settings out of range (as
    do_change_endpoint_scaling), a duplicate name, or a request that fits no GPU (saying
    what does, or a KV tier the hardware's vLLM cannot use, saying why); and one naming the
    quota when the organisation's endpoints, GPUs or replicas would pass it. The
    organisation row is held while its quota is checked, so that two creates at once cannot
    both take its last room.
    """
    require_manager(actor_role, "create endpoints")
    max_replicas = max(1, min_replicas) if max_replicas is None else max_replicas
    errors: dict[str, list[str]] = {}
    try:
        validate_endpoint_name(name)
    except ValidationError as exc:
        errors["name"] = exc.messages
    if name in RESERVED_NAMES:
        errors["name"] = [f"{name!r} is reserved; choose another name."]
    if refusal := context_length_refusal(model=model, context_length=context_length):
        errors["context_length"] = [refusal]
    scaling = dict(min_replicas=min_replicas, max_replicas=max_replicas,
                   scale_to_zero_after_seconds=scale_to_zero_after_seconds,
                   scaling_metric=scaling_metric, scaling_target=scaling_target,
                   scale_up_window_seconds=scale_up_window_seconds,
                   scale_down_window_seconds=scale_down_window_seconds)
    errors.update(_scaling_errors(scaling))
    if errors:
        raise ValidationError(errors)
    decided = plan(model=model, context_length=context_length, concurrency=concurrency,
                   kv_cache_dtype=kv_cache_dtype, gpu_type=gpu_type, gpu_count=gpu_count,
                   host_tier_gib=host_tier_gib, disk_tier_gib=disk_tier_gib)
    try:
        with transaction.atomic():
            _hold_quota(organization_id=organization.id, new_endpoint=True,
                        gpu_type=decided.gpu_type, gpu_count=decided.gpu_count,
                        replicas=max_replicas)
            endpoint = Endpoint.objects.create(
                organization=organization, name=name, model=model,
                context_length=context_length, concurrency=concurrency,
                gpu_type=decided.gpu_type, gpu_count=decided.gpu_count,
                kv_cache_dtype=kv_cache_dtype, prefix_caching=prefix_caching,
                host_tier_gib=host_tier_gib, disk_tier_gib=disk_tier_gib,
                cache_isolation=cache_isolation, prefix_affinity=prefix_affinity,
                **scaling,
                # One replica to begin with, even where the endpoint may scale to zero: it
                # was created to be used.
                desired_replicas=max(1, min_replicas), sizing=decided.summary,
                hourly_price_usd=decided.gpu_type.hourly_price_usd * decided.gpu_count,
                created_by=created_by,
            )
            EndpointEvent.objects.create(endpoint=endpoint, state=State.PENDING,
                                         message=f"created: {decided.summary['explanation']}")
    except IntegrityError:
        raise ValidationError(
            {"name": [f"An endpoint named {name!r} already exists in this organisation; "
                      "choose another name."]}) from None
    _reconcile_after_commit(endpoint)
    return endpoint


def _hold_quota(*, organization_id: UUID, gpu_type: GPUType, gpu_count: int, replicas: int,
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
    _reconcile_after_commit(endpoint)
    endpoint.desired_replicas = replicas
    return endpoint


SCALING_FIELDS = ("min_replicas", "max_replicas", "scale_to_zero_after_seconds", "scaling_metric",
                  "scaling_target", "scale_up_window_seconds", "scale_down_window_seconds")


def do_change_endpoint_scaling(*, endpoint: Endpoint, actor_role: str | None,
                               changes: dict[str, Any]) -> Endpoint:
    """Change how an endpoint scales (SCALING_FIELDS; only those in `changes`).

    Raises ValidationError naming the field: replicas out of range, an idle time under
    KVRUN_SCALE_TO_ZERO_MIN_SECONDS, a target not above zero, a window out of range; and
    naming the quota where a higher max_replicas would pass it. The replicas asked for move
    into the new range at once; the autoscaler takes it from there."""
    require_manager(actor_role, "change endpoints")
    with transaction.atomic():
        locked = Endpoint.objects.select_for_update().get(id=endpoint.id)
        new = {name: changes.get(name, getattr(locked, name)) for name in SCALING_FIELDS}
        errors = _scaling_errors(new)
        if errors:
            raise ValidationError(errors)
        if new["max_replicas"] > locked.max_replicas and (
                locked.desired_state == DesiredState.RUNNING):
            _hold_quota(organization_id=locked.organization_id, excluding=locked.id,
                        gpu_type=locked.gpu_type, gpu_count=locked.gpu_count,
                        replicas=new["max_replicas"])
        # At zero it stays there while zero is allowed; a minimum of one or more starts them.
        desired = min(new["max_replicas"], max(new["min_replicas"], locked.desired_replicas))
        Endpoint.objects.filter(id=locked.id).update(desired_replicas=desired, **new)
        said = ", ".join(f"{name.replace('_', ' ')} {_shown(value)}"
                         for name, value in new.items() if value != getattr(locked, name))
        EndpointEvent.objects.create(endpoint=locked, state=locked.state,
                                     message=f"scaling changed: {said or 'nothing'}"
                                             + (f"; {desired} replica(s) now"
                                                if desired != locked.desired_replicas else ""))
    _reconcile_after_commit(locked)
    return Endpoint.objects.get(id=locked.id)


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def idle_time_refusal(seconds: int) -> str | None:
    """Why an idle time before scaling to zero is refused, or None (forms check it too)."""
    shortest = settings.KVRUN_SCALE_TO_ZERO_MIN_SECONDS
    if seconds < shortest:
        return (f"Wait at least {shortest} s without a request before scaling to zero: each "
                "wake is a cold start.")
    if seconds > MAX_IDLE_SECONDS:
        return (f"Wait at most {MAX_IDLE_SECONDS} s (30 days); to never scale to zero, set the "
                "fewest replicas to 1 or more.")
    return None


def _scaling_errors(new: dict[str, Any]) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    if new["min_replicas"] < 0:
        errors["min_replicas"] = ["Run at least 0 replicas (0 scales to zero while idle)."]
    if not max(1, new["min_replicas"]) <= new["max_replicas"] <= MAX_REPLICAS_PER_ENDPOINT:
        errors["max_replicas"] = [
            f"Choose between {max(1, new['min_replicas'])} (at least 1, and no fewer than the "
            f"fewest replicas, min_replicas) and {MAX_REPLICAS_PER_ENDPOINT}; for more, create "
            "another endpoint."]
    idle = idle_time_refusal(new["scale_to_zero_after_seconds"])
    if idle:
        errors["scale_to_zero_after_seconds"] = [idle]
    if new["scaling_target"] is not None and new["scaling_target"] <= 0:
        errors["scaling_target"] = ["Set a target above 0, or none for the metric's default."]
    for name in ("scale_up_window_seconds", "scale_down_window_seconds"):
        if not SHORTEST_WINDOW_SECONDS <= new[name] <= LONGEST_WINDOW_SECONDS:
            errors[name] = [f"Choose between {SHORTEST_WINDOW_SECONDS} s and "
                            f"{LONGEST_WINDOW_SECONDS} s."]
    return errors


def do_wake_endpoint(*, endpoint_id: UUID) -> bool:
    """Ask for one replica of an endpoint scaled to zero, for a request waiting on it.

    A conditional update: of any number of calls at once (gateways holding a burst of
    requests), one wakes the endpoint and the rest change nothing. Returns whether this call
    woke it; False also for an endpoint stopped, deleted, failed or not at zero.
    """
    return _move_desired_replicas(
        endpoint_id=endpoint_id, where=Q(min_replicas=0, desired_replicas=0) & ~Q(
            state=State.FAILED),
        to_replicas=1, message="woken by a request: starting one replica")


def do_scale_endpoint_to_zero(*, endpoint_id: UUID, replicas: int, reason: str) -> bool:
    """Stop every replica of an idle endpoint that may scale to zero, with `reason` (the
    numbers behind the decision) as its event; `replicas` is the count the decision was
    made at. A conditional update: a request that woke the endpoint or a scaling change
    made since, or a second autoscaler deciding the same, changes nothing. Returns whether
    this call scaled it."""
    return _move_desired_replicas(
        endpoint_id=endpoint_id, where=Q(min_replicas=0, desired_replicas=replicas),
        to_replicas=0, message=f"scaling to zero: {reason}")


def do_autoscale_endpoint(*, endpoint_id: UUID, replicas: int, to_replicas: int, reason: str,
                          stop_replica_id: UUID | None = None) -> bool:
    """Move a running endpoint from `replicas` (the count the decision was made at) to
    `to_replicas`, with `reason` (the numbers behind it) as its event. A conditional update:
    a change made since, or a second autoscaler deciding the same, changes nothing. Returns
    whether this call scaled it; the reconciler then adds replicas.

    Scaling down, `stop_replica_id` is the replica to remove (the one the event names),
    stopped in the same transaction; its node agent drains it first. If it has moved on
    since, nothing changes and False is returned: the next pass decides again."""
    with transaction.atomic():
        moved = _move_desired_replicas(
            endpoint_id=endpoint_id, where=Q(desired_replicas=replicas), to_replicas=to_replicas,
            message=reason, last_scaled_at=timezone.now())
        if moved and stop_replica_id is not None:
            replica = (Replica.objects.select_related("node")
                       .filter(id=stop_replica_id, endpoint_id=endpoint_id).first())
            if replica is None or not do_stop_replica(replica=replica, reason="scaled down"):
                transaction.set_rollback(True)
                return False
    return moved


def _move_desired_replicas(*, endpoint_id: UUID, where: Q, to_replicas: int, message: str,
                           **also: object) -> bool:
    """Set `to_replicas` (and `also`) on the endpoint if it still matches `where`, runs and
    is not deleted, with `message` as its event, and reconcile it once that commits; returns
    whether it did."""
    with transaction.atomic():
        moved = Endpoint.objects.filter(
            where, id=endpoint_id, deleted_at=None, desired_state=DesiredState.RUNNING).update(
                desired_replicas=to_replicas, **also)
        if moved:
            endpoint = Endpoint.objects.get(id=endpoint_id)
            EndpointEvent.objects.create(endpoint=endpoint, state=endpoint.state,
                                         message=message)
            _reconcile_after_commit(endpoint)
    return bool(moved)


# What an engine starts with: a change replaces the replicas. The rest is the gateway's.
ENGINE_POLICY_FIELDS = ("context_length", "concurrency", "kv_cache_dtype", "prefix_caching",
                        "host_tier_gib", "disk_tier_gib")
ROUTING_POLICY_FIELDS = ("cache_isolation", "prefix_affinity")


def do_change_endpoint_policy(*, endpoint: Endpoint, actor_role: str | None,
                              changes: dict[str, Any]) -> str:
    """Change an endpoint's KV policy on its hardware, and say what happens next.

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
        policy = {name: changes.get(name, getattr(locked, name))
                  for name in ENGINE_POLICY_FIELDS + ROUTING_POLICY_FIELDS}
        if refusal := context_length_refusal(model=locked.model,
                                             context_length=policy["context_length"]):
            raise ValidationError({"context_length": [refusal]})
        decided = plan(model=locked.model, context_length=policy["context_length"],
                       concurrency=policy["concurrency"],
                       kv_cache_dtype=policy["kv_cache_dtype"], gpu_type=locked.gpu_type,
                       gpu_count=locked.gpu_count, host_tier_gib=policy["host_tier_gib"],
                       disk_tier_gib=policy["disk_tier_gib"])
        changed = [name for name, value in policy.items() if value != getattr(locked, name)]
        if not changed:
            return "Nothing changed."
        restarts = [name for name in changed if name in ENGINE_POLICY_FIELDS]
        for name in changed:
            setattr(locked, name, policy[name])
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
            message=f"policy changed ({', '.join(f'{name} {policy[name]}' for name in changed)})"
                    f": {outcome}")
    if restarts:
        _reconcile_after_commit(endpoint)
    endpoint.refresh_from_db()
    return outcome


def do_stop_endpoint(*, endpoint: Endpoint, actor_role: str | None) -> Endpoint:
    require_manager(actor_role, "stop endpoints")
    Endpoint.objects.filter(id=endpoint.id).update(desired_state=DesiredState.STOPPED)
    _reconcile_after_commit(endpoint)
    endpoint.desired_state = DesiredState.STOPPED
    return endpoint


def do_start_endpoint(*, endpoint: Endpoint, actor_role: str | None) -> Endpoint:
    """Run a stopped or failed endpoint again, with a fresh failure count.

    Raises ValidationError naming the quota when the organisation's other running endpoints
    and this one would pass its GPU or replica quota (a stopped endpoint holds neither).
    """
    require_manager(actor_role, "start endpoints")
    with transaction.atomic():
        _hold_quota(organization_id=endpoint.organization_id, excluding=endpoint.id,
                    gpu_type=endpoint.gpu_type, gpu_count=endpoint.gpu_count,
                    replicas=endpoint.max_replicas)
        Endpoint.objects.filter(id=endpoint.id).update(desired_state=DesiredState.RUNNING,
                                                       state=State.PENDING, failure_reason="")
        Replica.objects.filter(endpoint=endpoint, state=State.FAILED).update(
            state=State.STOPPED, stopped_at=timezone.now())
        EndpointEvent.objects.create(endpoint=endpoint, state=State.PENDING, message="started")
    _reconcile_after_commit(endpoint)
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
    _reconcile_after_commit(endpoint)


def do_import_model(*, directory: Path, slug: str | None = None,
                    licence: str = "unknown") -> tuple[ModelSpec, bool]:
    """Add or update a catalog model from a local checkpoint folder. Returns (model, created)."""
    fields = hf_checkpoint.describe(directory)
    fields["slug"] = slug or fields["slug"]
    fields.update(hf_repo=str(Path(directory).resolve()), licence=licence)
    return ModelSpec.objects.update_or_create(slug=fields.pop("slug"), defaults=fields)
