"""The operators' console for catalogs, nodes, endpoints and their replicas.

Node and endpoint rows belong to their agents and to the dashboard/API: here they are read
only, and operators change them through actions that call the same services.
"""

from datetime import datetime

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from accounts.models import Organization, Role
from endpoints.dispatch import request_pull
from endpoints.models import (
    Endpoint,
    EndpointEvent,
    GPUType,
    ModelSpec,
    Node,
    NodeState,
    Region,
    Replica,
    ReplicaInterval,
    State,
)
from endpoints.selectors import hub_token_of
from endpoints.services import (
    do_drain_node,
    do_pin_model,
    do_promote_models,
    do_restart_endpoint,
    do_start_endpoint,
    do_stop_endpoint,
    do_undrain_node,
)
from endpoints.states import ON_NODE
from engine.hub import HubRefusal
from engine.sizing import GIB
from kvrun.common.paginators import BoundedCountPaginator


def age(moment: datetime) -> str:
    seconds = max(0, int((timezone.now() - moment).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows that are written elsewhere: an operator views them and uses the actions, which need
    the change permission on the list; a row's own page is view-only."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(ModelSpec)
class ModelSpecAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "family", "parameters", "layers", "kv_heads", "head_dim",
                    "max_context", "attention_kind", "licence", "pinned"]
    list_filter = ["family", "attention_kind", ("organization", admin.EmptyFieldListFilter)]
    search_fields = ["name", "slug", "hf_repo"]
    list_select_related = ["organization"]
    # The sealed token never shows; its last four characters say which one it is.
    exclude = ["hf_token_sealed"]
    readonly_fields = ["organization", "added_by", "added_at", "hf_commit", "files",
                       "hf_token_last4"]
    actions = ["promote", "pin", "pull_onto_nodes"]

    @admin.display(description="owner", ordering="organization__name")
    def owner(self, model: ModelSpec) -> str:
        return model.organization.name if model.organization else "public catalog"

    @admin.display(description="pinned commit")
    def pinned(self, model: ModelSpec) -> str:
        return model.hf_commit[:12] or "—"

    @admin.action(description="Promote to the public catalog (every organisation sees and "
                              "can run it; its access token, if any, downloads it for all)",
                  permissions=["change"])
    def promote(self, request: HttpRequest, queryset: QuerySet[ModelSpec]) -> None:
        promoted = do_promote_models(model_ids=list(queryset.values_list("id", flat=True)))
        self.message_user(request, f"{promoted} model(s) are in the public catalog now.",
                          messages.SUCCESS)

    @admin.action(description="Pin: resolve the hub revision to its commit now (nodes "
                              "download that commit, whatever the branch does later)",
                  permissions=["change"])
    def pin(self, request: HttpRequest, queryset: QuerySet[ModelSpec]) -> None:
        pinned = 0
        for model in queryset.exclude(hf_repo="").exclude(hf_repo__startswith="/").filter(
                hf_commit=""):
            try:
                do_pin_model(model=model, token=hub_token_of(model))
            except HubRefusal as exc:
                self.message_user(request, f"{model.name}: {exc.message}", messages.ERROR)
            else:
                pinned += 1
        self.message_user(request, f"{pinned} model(s) pinned; models pinned already, and "
                                   "those built locally, are left as they are.",
                          messages.SUCCESS)

    @admin.action(description="Pre-pull: download the weights onto every online node that "
                              "may run them", permissions=["change"])
    def pull_onto_nodes(self, request: HttpRequest, queryset: QuerySet[ModelSpec]) -> None:
        pulls = 0
        for model in queryset:
            # An organisation's model (and its hub token) goes to shared nodes and its own
            # nodes alone; a catalog model to shared nodes: never to another's own node.
            for node in Node.objects.filter(Q(organization=None)
                                            | Q(organization_id=model.organization_id),
                                            state=NodeState.ONLINE):
                request_pull(model_id=model.id, node=node)
                pulls += 1
        self.message_user(request, f"{queryset.count()} model(s) are downloading: {pulls} "
                                   "pull(s) onto the online nodes that may run them; each "
                                   "node's page shows its cache.", messages.SUCCESS)


@admin.register(Region)
class RegionAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "online_nodes"]
    search_fields = ["slug", "name"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Region]:
        return super().get_queryset(request).annotate(online=Count(
            "nodes", filter=Q(nodes__state=NodeState.ONLINE)))

    @admin.display(description="nodes online", ordering="online")
    def online_nodes(self, region: Region) -> int:
        return region.online  # type: ignore[attr-defined]  # annotated above


@admin.register(GPUType)
class GPUTypeAdmin(admin.ModelAdmin):
    list_display = ["name", "vendor", "memory_bytes", "bandwidth_gb_s", "hourly_price_usd"]
    list_filter = ["vendor"]
    search_fields = ["name", "slug", "device_match"]


class ReplicaInline(admin.TabularInline):
    """Replicas that are not stopped; the whole history is in the replica list."""

    model = Replica
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Replica]:
        return (super().get_queryset(request).exclude(state=State.STOPPED)
                .select_related("endpoint", "node"))


class EngineInline(ReplicaInline):
    verbose_name = "engine"
    verbose_name_plural = "engines (replicas not stopped)"
    fields = ["endpoint", "state", "stage", "port", "pid", "device_indices", "ready_at"]
    readonly_fields = fields


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = ["name", "state", "draining", "region", "zone", "owner", "gpu_type",
                    "device_count", "engines", "heartbeat", "address"]
    list_filter = ["state", "draining", "region", ("organization", admin.EmptyFieldListFilter),
                   "gpu_type"]
    search_fields = ["name", "address", "organization__slug"]
    list_select_related = ["gpu_type", "region", "organization"]
    fields = ["name", "address", "state", "draining", "region", "zone", "owner", "gpu_type",
              "device_list", "cpu_count",
              "memory", "registered_at", "heartbeat", "vllm_version", "cached_models"]
    readonly_fields = fields
    inlines = [EngineInline]
    actions = ["drain", "undrain"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Node]:
        return super().get_queryset(request).annotate(
            live_replicas=Count("replicas", filter=Q(replicas__state__in=ON_NODE)))

    @admin.display(description="owner", ordering="organization__slug")
    def owner(self, node: Node) -> str:
        return node.organization.slug if node.organization else "shared"

    @admin.display(description="GPUs")
    def device_count(self, node: Node) -> int:
        return len(node.devices)

    @admin.display(description="engines", ordering="live_replicas")
    def engines(self, node: Node) -> int:
        return node.live_replicas

    @admin.display(description="devices")
    def device_list(self, node: Node) -> str:
        return format_html_join(
            "", "<div>{}: {} ({} GiB)</div>",
            ((d["index"], d["name"], round(d["memory_bytes"] / GIB)) for d in node.devices),
        ) or "none (CPU only)"

    @admin.display(description="model cache")
    def cached_models(self, node: Node) -> str:
        used = sum(entry["bytes"] for entry in node.model_cache)
        rows = format_html_join("", "<div>{} @ {}: {} GB, last used {}</div>", (
            (entry["repo_id"], entry["commit"][:12], round(entry["bytes"] / 1e9, 2),
             entry["last_used"][:19].replace("T", " ")) for entry in node.model_cache))
        return format_html("{}<div>{} of {} GB used</div>", rows, round(used / 1e9, 2),
                           round(node.model_cache_bytes / 1e9, 1))

    @admin.display(description="memory")
    def memory(self, node: Node) -> str:
        return f"{round(node.memory_bytes / GIB)} GiB"

    @admin.display(description="last heartbeat", ordering="last_heartbeat_at")
    def heartbeat(self, node: Node) -> str:
        return (f"{timezone.localtime(node.last_heartbeat_at):%Y-%m-%d %H:%M:%S} "
                f"({age(node.last_heartbeat_at)})")

    @admin.action(description="Drain: take no new replicas, move their replicas elsewhere",
                  permissions=["change"])
    def drain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        nodes = list(queryset)
        moved = sum(do_drain_node(node_id=node.id) for node in nodes)
        self.message_user(request, f"Draining {len(nodes)} node(s); {moved} replica(s) are "
                                   "moving to other nodes.", messages.SUCCESS)

    @admin.action(description="Undrain: take new replicas again", permissions=["change"])
    def undrain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        undrained = sum(do_undrain_node(node_id=node.id) for node in queryset)
        self.message_user(request, f"{undrained} node(s) take new replicas again.",
                          messages.SUCCESS)


class EndpointReplicaInline(ReplicaInline):
    fields = ["node", "state", "stage", "port", "pid", "device_indices", "restarts", "ready_at"]
    readonly_fields = fields


@admin.register(Endpoint)
class EndpointAdmin(ReadOnlyAdmin):
    list_display = ["name", "organization", "model", "gpus", "state", "desired_state",
                    "desired_replicas", "hourly_price_usd", "created_at"]
    list_filter = ["state", "desired_state", "gpu_type", "model",
                   ("deleted_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "organization__name", "organization__slug", "model__slug"]
    list_select_related = ["organization", "model", "gpu_type"]
    ordering = ["-created_at"]
    fields = ["id", "name", "organization", "model", "gpus", "context_length", "concurrency",
              "kv_cache_dtype", "prefix_caching", "min_replicas", "max_replicas",
              "desired_replicas", "desired_state", "state", "failure_reason", "sizing",
              "hourly_price_usd", "created_by", "created_at", "deleted_at"]
    readonly_fields = fields
    inlines = [EndpointReplicaInline]
    actions = ["stop", "start", "restart"]

    @admin.display(description="GPUs", ordering="gpu_count")
    def gpus(self, endpoint: Endpoint) -> str:
        return f"{endpoint.gpu_count} × {endpoint.gpu_type.name}"

    # Operators act with an owner's rights over any organisation's endpoints.
    @admin.action(description="Stop the selected endpoints", permissions=["change"])
    def stop(self, request: HttpRequest, queryset: QuerySet[Endpoint]) -> None:
        endpoints = list(queryset)
        for endpoint in endpoints:
            do_stop_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
        self.message_user(request, f"Stopping {len(endpoints)} endpoint(s).", messages.SUCCESS)

    @admin.action(description="Start the selected endpoints", permissions=["change"])
    def start(self, request: HttpRequest, queryset: QuerySet[Endpoint]) -> None:
        # A deleted endpoint stays stopped: the reconciler never runs one.
        endpoints = list(queryset.filter(deleted_at=None))
        started = 0
        for endpoint in endpoints:
            try:
                do_start_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
            except ValidationError as exc:  # past its organisation's quota
                self.refused(request, endpoint, exc)
                continue
            started += 1
        self.message_user(request, f"Starting {started} endpoint(s)"
                                   f"{skipped_deleted(queryset, len(endpoints))}.",
                          messages.SUCCESS)

    @admin.action(description="Restart the selected endpoints with fresh replicas",
                  permissions=["change"])
    def restart(self, request: HttpRequest, queryset: QuerySet[Endpoint]) -> None:
        restarted = replaced = 0
        endpoints = list(queryset.filter(deleted_at=None))
        for endpoint in endpoints:
            try:
                replaced += do_restart_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
            except ValidationError as exc:  # deleted meanwhile, or past its quota
                self.refused(request, endpoint, exc)
                continue
            restarted += 1
        skipped = skipped_deleted(queryset, len(endpoints))
        self.message_user(request, f"Restarting {restarted} endpoint(s); {replaced} replica(s) "
                                   f"are being replaced{skipped}.", messages.SUCCESS)

    def refused(self, request: HttpRequest, endpoint: Endpoint, error: ValidationError) -> None:
        self.message_user(request, f"{endpoint.name} ({endpoint.organization}): "
                                   f"{' '.join(error.messages)}", messages.ERROR)


def skipped_deleted(queryset: QuerySet[Endpoint], acted_on: int) -> str:
    skipped = queryset.count() - acted_on
    return f" ({skipped} deleted, skipped)" if skipped else ""


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    list_display = ["short_id", "endpoint", "organization", "node", "state", "stage",
                    "device_indices", "port", "pid", "restarts", "created_at", "ready_at"]
    list_filter = ["state", "node"]
    search_fields = ["endpoint__name", "endpoint__organization__slug", "node__name"]
    list_select_related = ["endpoint__organization", "node"]
    ordering = ["-created_at"]
    fields = ["id", "endpoint", "node", "device_indices", "state", "stage", "progress_percent",
              "failure_reason", "port", "pid", "kv_cache_tokens", "restarts", "next_start_at",
              "created_at", "ready_at", "stopped_at", "log_tail"]
    readonly_fields = fields

    @admin.display(description="replica", ordering="id")
    def short_id(self, replica: Replica) -> str:
        return str(replica.id)[:8]

    @admin.display(description="organization", ordering="endpoint__organization__slug")
    def organization(self, replica: Replica) -> Organization:
        return replica.endpoint.organization


@admin.register(EndpointEvent)
class EndpointEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "endpoint", "replica_id_prefix", "state", "message"]
    list_filter = ["state", "at"]
    # Exact names: the event table only grows, and a substring search would scan all of it.
    search_fields = ["=endpoint__name", "=endpoint__organization__slug"]
    search_help_text = "An endpoint's name or an organisation's slug, exactly."
    list_select_related = ["endpoint"]
    ordering = ["-id"]  # newest first along the primary key, not a sort of the whole table
    paginator = BoundedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = ["at", "endpoint", "replica", "state", "message"]
    readonly_fields = fields

    @admin.display(description="replica")
    def replica_id_prefix(self, event: EndpointEvent) -> str:
        return str(event.replica_id)[:8] if event.replica_id else ""


@admin.register(ReplicaInterval)
class ReplicaIntervalAdmin(ReadOnlyAdmin):
    """The GPU-time ledger: written by replicas' transitions only, never changed here."""

    list_display = ["started_at", "ended_at", "endpoint", "organization", "replica_id_prefix",
                    "phase", "gpu_type", "gpu_count", "seconds"]
    list_filter = ["phase", "gpu_type", "started_at"]
    search_fields = ["=endpoint__name", "=organization__slug"]
    search_help_text = "An endpoint's name or an organisation's slug, exactly."
    list_select_related = ["endpoint", "organization", "gpu_type"]
    ordering = ["-id"]
    paginator = BoundedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = ["replica", "endpoint", "organization", "gpu_type", "gpu_count", "phase",
              "started_at", "ended_at"]
    readonly_fields = fields

    @admin.display(description="replica")
    def replica_id_prefix(self, interval: ReplicaInterval) -> str:
        return str(interval.replica_id)[:8]

    @admin.display(description="seconds so far")
    def seconds(self, interval: ReplicaInterval) -> str:
        end = interval.ended_at or timezone.now()
        return f"{(end - interval.started_at).total_seconds():,.3f}"
