import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from django.contrib.postgres.aggregates import StringAgg
from django.db.models import Count, F, FilteredRelation, Max, Prefetch, Q, QuerySet, Sum, TextField
from django.db.models.functions import Cast

from accounts.models import Organization
from accounts.selectors import Quota
from endpoints.models import (
    Adapter,
    DesiredState,
    Endpoint,
    GPUType,
    ModelSpec,
    Node,
    NodeState,
    Region,
    RegionalPrice,
    Replica,
    ReplicaInterval,
    State,
)
from endpoints.scheduling import UNPLACED_STAGE, free_devices, held_on
from engine.sizing import CPU
from kvrun.common.sealing import unseal


def model_catalog() -> QuerySet[ModelSpec]:
    """The public catalog: models every organisation sees."""
    return ModelSpec.objects.filter(organization__isnull=True)


def models_visible_to(*, organization: Organization | None) -> QuerySet[ModelSpec]:
    """The public catalog and the models the organisation added itself."""
    if organization is None:
        return model_catalog()
    return ModelSpec.objects.filter(Q(organization__isnull=True) | Q(organization=organization))


def adapters_of(*, endpoint: Endpoint) -> QuerySet[Adapter]:
    """The endpoint's LoRA adapters, by name, with what counting their replicas needs."""
    return (Adapter.objects.filter(endpoint=endpoint).select_related("endpoint")
            .prefetch_related(Prefetch("endpoint__replicas", queryset=Replica.objects.filter(
                state=State.READY))))


def hub_token_of(source: ModelSpec | Adapter) -> str | None:
    """A model's or an adapter's hub access token, opened for the one step that downloads
    its files."""
    return unseal(source.hf_token_sealed) if source.hf_token_sealed else None


def models_of(*, organization: Organization) -> QuerySet[ModelSpec]:
    """The models the organisation added from the hub, newest first."""
    return ModelSpec.objects.filter(organization=organization).order_by("-added_at", "-id")


@dataclass
class EnginesOnline:
    """What the nodes that take an organisation's replicas run (engines_online)."""

    architectures: set[str]  # the model architectures their vLLM builds support
    versions: set[str]  # those builds' versions
    largest_cache: int  # the largest model cache among them, bytes
    tool_parsers: set[str]  # engine.parsers: what their builds offer
    reasoning_parsers: set[str]


def engines_online(*, organization_id: UUID | None) -> EnginesOnline:
    """What the nodes that take the organisation's replicas run: the shared fleet and its
    own nodes (None: the shared fleet)."""
    found = EnginesOnline(architectures=set(), versions=set(), largest_cache=0,
                          tool_parsers=set(), reasoning_parsers=set())
    for architectures, version, cache, tool_parsers, reasoning_parsers in Node.objects.filter(
            Q(organization=None) | Q(organization_id=organization_id),
            state=NodeState.ONLINE, draining=False).values_list(
            "architectures", "vllm_version", "model_cache_bytes", "tool_parsers",
            "reasoning_parsers"):
        found.architectures.update(architectures)
        if version:
            found.versions.add(version)
        found.largest_cache = max(found.largest_cache, cache)
        found.tool_parsers.update(tool_parsers)
        found.reasoning_parsers.update(reasoning_parsers)
    return found


def node_takes_replicas(*, name: str) -> bool:
    """Whether node `name` is registered, online and not draining."""
    return Node.objects.filter(name=name, state=NodeState.ONLINE, draining=False).exists()


def gpu_catalog() -> QuerySet[GPUType]:
    return GPUType.objects.all()


def regions_online(*, organization_id: UUID | None = None) -> QuerySet[Region]:
    """The regions with a node that takes new replicas now, shared or the organisation's own:
    those its endpoints may require."""
    return Region.objects.filter(
        Q(nodes__organization=None) | Q(nodes__organization_id=organization_id),
        nodes__state=NodeState.ONLINE, nodes__draining=False).distinct()


def regions() -> QuerySet[Region]:
    """The regions, each with its shared nodes that take new replicas now (online, not
    draining) and their GPU types, and its own prices where an operator set them."""
    return Region.objects.prefetch_related(
        Prefetch("nodes", queryset=Node.objects.filter(
            state=NodeState.ONLINE, draining=False, organization=None,
            gpu_type__isnull=False).select_related("gpu_type")),
        Prefetch("prices", queryset=RegionalPrice.objects.select_related("gpu_type")))


def gpu_type_for_device(*, device_name: str, memory_bytes: int) -> GPUType | None:
    """The catalog type whose match string is in the driver's name, closest in memory."""
    candidates = [
        gpu for gpu in GPUType.objects.exclude(device_match="")
        if gpu.device_match.lower() in device_name.lower()
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda gpu: abs(gpu.memory_bytes - memory_bytes))


def endpoints_of(*, organization: Organization) -> QuerySet[Endpoint]:
    """The organisation's endpoints that are not deleted, with what their responses show:
    their replicas that are not stopped (stopped ones are history, and grow without end)."""
    live = (Replica.objects.exclude(state=State.STOPPED).select_related("node")
            .order_by("-created_at"))
    return (Endpoint.objects.filter(organization=organization, deleted_at=None)
            .select_related("model", "gpu_type", "region")
            .prefetch_related(Prefetch("replicas", queryset=live)))


def quota_used_by(*, organization_ids: Iterable[UUID], excluding: UUID | None = None) -> Quota:
    """What the organisations' endpoints (but `excluding`, an endpoint id) hold against
    quotas, together: every endpoint not deleted; and of those that should run, their
    replicas and GPUs at their most replicas, so that scaling within max_replicas never passes
    a quota. A CPU engine holds no GPU."""
    kept = Endpoint.objects.filter(organization_id__in=list(organization_ids), deleted_at=None)
    if excluding is not None:
        kept = kept.exclude(id=excluding)
    running = kept.filter(desired_state=DesiredState.RUNNING)
    held = running.aggregate(
        replicas=Sum("max_replicas", default=0),
        gpus=Sum(F("gpu_count") * F("max_replicas"), default=0, filter=~Q(gpu_type__slug=CPU)))
    return Quota(endpoints=kept.count(), gpus=held["gpus"], replicas=held["replicas"])


@dataclass(frozen=True)
class HoldState:
    """What the requests held for an endpoint's cold start wait on (gateway.hold)."""

    changed: tuple[object, ...]  # differs whenever what a held request reads may have
    unplaced: str  # its replica's stage when it waits for a node and none is placed


def hold_states(*, endpoint_ids: Iterable[str]) -> dict[str, HoldState]:
    """Each endpoint's HoldState, in one query however many there are; an endpoint that is
    gone is absent."""
    rows = (Endpoint.objects.filter(id__in=list(endpoint_ids))
            # Its live replicas alone: stopped ones pile up, one a wake.
            .annotate(live=FilteredRelation("replicas", condition=~Q(
                replicas__state__in=[State.STOPPED, State.FAILED])))
            .values("id", "state", "desired_state", "desired_replicas", "deleted_at")
            .annotate(ready=Count("live", filter=Q(live__state=State.READY)),
                      placed=Count("live", filter=~Q(live__state=State.PENDING)),
                      stage=Max("live__stage"), percent=Max("live__progress_percent"),
                      served_adapters=StringAgg(Cast("live__adapters", TextField()), ";",
                                         filter=Q(live__state=State.READY), default=""),
                      unplaced=Max("live__stage", filter=Q(
                          live__state=State.PENDING, live__stage__startswith=UNPLACED_STAGE))))
    return {str(row["id"]): HoldState(
        changed=tuple(value for name, value in row.items() if name != "id"),
        unplaced=row["unplaced"] if row["unplaced"] and not row["placed"] else "")
        for row in rows}


def progress_of(*, endpoint: Endpoint, replicas: Iterable[Replica]) -> dict[str, object]:
    """Where the endpoint stands, as {stage, percent}: its furthest replica while it starts."""
    live = [r for r in replicas if r.state not in (State.STOPPED, State.FAILED)]
    if endpoint.state in (State.READY, State.STOPPED, State.FAILED) or not live:
        return {"stage": endpoint.state, "percent": 100 if endpoint.state != State.PENDING
                else 0}
    leader = max(live, key=lambda replica: replica.progress_percent)
    return {"stage": leader.stage or leader.state, "percent": leader.progress_percent}


def replicas_behind_parsers(*, endpoint: Endpoint) -> int:
    """How many of the endpoint's ready replicas run engines started with other parsers than
    its model's now (set since, or by an agent that starts none): a restart applies them."""
    return Replica.objects.filter(endpoint=endpoint, state=State.READY).exclude(
        tool_call_parser=endpoint.model.tool_call_parser,
        reasoning_parser=endpoint.model.reasoning_parser).count()


def endpoints_for_gateway(*, organization_id: UUID | str) -> QuerySet[Endpoint]:
    """The organisation's live endpoints with their ready replicas and nodes: what the
    gateway routes by."""
    ready = Replica.objects.filter(state=State.READY, port__isnull=False,
                                   node__isnull=False).select_related("node")
    return (Endpoint.objects.filter(organization_id=organization_id, deleted_at=None)
            .select_related("organization", "model")
            .prefetch_related(unended_replicas(),
                              Prefetch("replicas", queryset=ready, to_attr="ready_replicas"),
                              Prefetch("adapters", queryset=Adapter.objects.only(
                                  "id", "endpoint_id", "name"))))


def unended_replicas() -> Prefetch:
    """An endpoint's replicas but those stopped or failed, whose rows grow with every wake,
    scale-up and rollout: for code that reads `endpoint.replicas.all()` every few seconds."""
    return Prefetch("replicas", queryset=Replica.objects.exclude(
        state__in=(State.STOPPED, State.FAILED)))


def median_start_seconds(*, model_id: int, gpu_type_id: int, last: int = 20) -> float | None:
    """How long the last `last` replicas of this model on this kind of node took from being
    asked for to ready, leaving out downloads of weights (a start from a node's cache has
    none), as a median in seconds; None when there is no history."""
    spans = (Replica.objects.filter(endpoint__model_id=model_id, node__gpu_type_id=gpu_type_id,
                                    ready_at__isnull=False)
             .order_by("-ready_at").values_list("created_at", "ready_at", "download_seconds")
             [:last])
    seconds = [(ready - created).total_seconds() - (downloaded or 0.0)
               for created, ready, downloaded in spans
               if ready is not None]  # never None here; the type says it may be
    return statistics.median(seconds) if seconds else None


def start_counted_from(replica: Replica) -> datetime:
    """When the replica's start began, as far as its ETA goes: a download of its weights is
    no part of a start's median (median_start_seconds), so its start counts from when its
    download ended, or is expected to (later than now while it runs, or before it has
    begun: expected_download_seconds)."""
    if replica.download_done_at is not None:
        return replica.download_done_at
    if replica.download_seconds is not None:
        return replica.created_at + timedelta(seconds=replica.download_seconds)
    if replica.state in (State.PENDING, State.SCHEDULING, State.STARTING):
        expected = expected_download_seconds(model=replica.endpoint.model,
                                             gpu_type_id=replica.endpoint.gpu_type_id,
                                             node=replica.node)
        return replica.created_at + timedelta(seconds=expected)
    return replica.created_at


def expected_download_seconds(*, model: ModelSpec, gpu_type_id: int, node: Node | None = None,
                              last: int = 20) -> float:
    """How long a start of `model` will download for before its engine starts: 0 where its
    `node` holds its pinned weights (or, not placed yet, an online node of its kind does: the
    scheduler prefers one) or its files are not known (a model kvrun builds, or one not
    pinned yet), else its size at the median rate of the last `last` downloads; 0 too with
    no download to go by."""
    size = _bytes_of(model.files)
    candidates = [node] if node is not None else Node.objects.filter(
        state=NodeState.ONLINE, gpu_type_id=gpu_type_id).only("model_cache")
    if not size or not model.hf_commit or any(
            candidate.holds_weights(model) for candidate in candidates):
        return 0.0
    rates = [_bytes_of(files) / seconds
             for files, seconds in Replica.objects.filter(download_seconds__gt=0)
             .order_by("-created_at").values_list("endpoint__model__files", "download_seconds")
             [:last] if seconds]
    rates = [rate for rate in rates if rate > 0]
    return size / statistics.median(rates) if rates else 0.0


def _bytes_of(files: list[dict]) -> int:
    return sum(int(file.get("size") or 0) for file in files)


def replica_timeline(*, endpoint_id: UUID, since: datetime, until: datetime
                     ) -> list[tuple[datetime, Counter[str]]]:
    """How many of the endpoint's replicas held devices in each phase (BilledPhase) from
    `since` to `until`, read from the GPU-time ledger: an entry at `since` and one at each
    moment a replica changed phase after it, each counting from then to the next entry."""
    changes: dict[datetime, Counter[str]] = defaultdict(Counter)
    for phase, started, ended in (
            ReplicaInterval.objects.filter(endpoint_id=endpoint_id, started_at__lt=until)
            .filter(Q(ended_at=None) | Q(ended_at__gt=since))
            .values_list("phase", "started_at", "ended_at")):
        changes[max(started, since)][phase] += 1
        if ended is not None and ended < until:
            changes[ended][phase] -= 1
    counts: Counter[str] = Counter()
    timeline = []
    for moment in sorted({since, *changes}):
        counts.update(changes[moment])  # adds, negative counts included
        timeline.append((moment, +counts))
    return timeline


@dataclass(frozen=True)
class OwnNode:
    """One of an organisation's own nodes as its members see it: its replicas there now,
    with their endpoints, and how many of its GPUs no replica holds."""

    node: Node
    engines: list[Replica]
    free_devices: int


def own_nodes_of(*, organization: Organization) -> list[OwnNode]:
    """The organisation's own nodes, by name, with their engines."""
    nodes = list(Node.objects.filter(organization=organization)
                 .select_related("gpu_type", "region"))
    held = held_on(nodes)
    return [OwnNode(node=node, engines=held[node.id],
                    free_devices=len(free_devices(node, held[node.id]))) for node in nodes]
