from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from endpoints.models import (
    DEFAULT_LORA_RANK,
    LORA_RANK_REFUSAL,
    LORA_RANKS,
    MAX_CONCURRENCY,
    MAX_DISK_TIER_GIB,
    MAX_HOST_TIER_GIB,
    MAX_IDLE_SECONDS,
    MAX_LORA_ADAPTERS,
    MAX_LORA_HOST_ADAPTERS,
    MAX_REPLICAS_PER_ENDPOINT,
    MIN_CONTEXT_LENGTH,
    Adapter,
    CacheIsolation,
    Endpoint,
    EndpointEvent,
    GPUType,
    KVCacheDtype,
    ModelSpec,
    Region,
    Replica,
    ScalingMetric,
    State,
    Task,
)
from endpoints.selectors import OwnNode, models_visible_to, progress_of
from kvrun.common.api import StrictSerializer

MODEL_FIELDS = ["slug", "name", "hf_repo", "hf_revision", "hf_commit", "family", "architecture",
                "parameters", "active_parameters", "weights_bytes", "layers", "hidden_size",
                "attention_heads", "kv_heads", "head_dim", "vocab_size", "max_context",
                "attention_kind", "kv_lora_rank", "qk_rope_head_dim", "sliding_window",
                "sliding_window_layers", "default_dtype", "licence", "task", "chat_template",
                "tool_call_parser", "reasoning_parser"]


# What clients send as "model": the catalog's slugs hold dots (llama-3.2-3b-instruct), which
# a slug field's schema pattern would refuse.
MODEL_SLUG_HELP = "What clients send as \"model\"; letters, digits, '-', '_' and '.'."


class ModelSpecSerializer(serializers.ModelSerializer):
    slug = serializers.CharField(read_only=True, help_text=MODEL_SLUG_HELP)

    class Meta:
        model = ModelSpec
        fields = MODEL_FIELDS


class OwnModelSerializer(serializers.ModelSerializer):
    """A model an organisation added from the hub; its access token shows as its last four
    characters only."""

    slug = serializers.CharField(read_only=True, help_text=MODEL_SLUG_HELP)
    download_bytes = serializers.SerializerMethodField()
    hf_token = serializers.SerializerMethodField()
    added_by = serializers.EmailField(source="added_by.email", default=None, read_only=True)

    class Meta:
        model = ModelSpec
        fields = [*MODEL_FIELDS, "trust_remote_code", "download_bytes", "hf_token", "added_by",
                  "added_at"]

    def get_download_bytes(self, model: ModelSpec) -> int:
        return sum(f["size"] for f in model.files)

    def get_hf_token(self, model: ModelSpec) -> str | None:
        return f"…{model.hf_token_last4}" if model.hf_token_last4 else None


class HubModelInput(StrictSerializer):
    hf_repo = serializers.CharField(max_length=200, help_text="The hub id: owner/name.")
    hf_revision = serializers.CharField(
        max_length=200, required=False, allow_blank=True, default="",
        help_text="A branch, tag or commit; empty: the default branch. Pinned to its commit.")
    hf_token = serializers.CharField(
        max_length=400, required=False, allow_blank=True, default="", write_only=True,
        help_text="For a gated or private repository: a read token. Kept sealed, never shown.")


class ModelFromHubInput(HubModelInput):
    task = serializers.ChoiceField(
        choices=Task.choices, required=False,
        help_text="What it serves: generate (chat and completions), embed or score (rerank); "
        "left out: what its config says. A generative checkpoint trained to embed (such as "
        "Qwen3-Embedding) is added with embed.")
    tool_call_parser = serializers.CharField(
        max_length=40, required=False, allow_blank=True,
        help_text="vLLM's tool-call parser for its engines (one the nodes' vLLM offers); \"\": "
        "none; left out: its family's, where its tokenizer has the parser's markers.")
    reasoning_parser = serializers.CharField(
        max_length=40, required=False, allow_blank=True,
        help_text="vLLM's reasoning parser, chosen the same way.")


class AdapterNameInput(StrictSerializer):
    name = serializers.SlugField(max_length=63,
                                 help_text="Clients call it as model \"<endpoint>:<name>\".")


class AdapterInput(AdapterNameInput, HubModelInput):
    """A LoRA adapter by its hub id."""


@extend_schema_field({"type": "string", "format": "binary", "minLength": 1})
class NonEmptyFileField(serializers.FileField):
    """A file upload, refused when empty (FileField's default), as its schema says."""


class AdapterUploadInput(AdapterNameInput):
    """A LoRA adapter's two files, as a multipart upload."""

    config = NonEmptyFileField(help_text="adapter_config.json")
    weights = NonEmptyFileField(help_text="adapter_model.safetensors")


class AdapterSerializer(serializers.ModelSerializer):
    model = serializers.SerializerMethodField(help_text="What clients send as \"model\".")
    replicas_serving = serializers.SerializerMethodField(
        help_text="Ready replicas whose engines serve it now.")

    class Meta:
        model = Adapter
        fields = ["name", "model", "source", "hf_repo", "hf_revision", "hf_commit",
                  "hf_token_last4", "base_model", "rank", "target_modules", "size_bytes",
                  "added_at", "replicas_serving"]

    def get_model(self, adapter: Adapter) -> str:
        return f"{adapter.endpoint.name}:{adapter.name}"

    def get_replicas_serving(self, adapter: Adapter) -> int:
        return adapter.serving(adapter.endpoint.replicas.all())


class GPUTypeSerializer(serializers.ModelSerializer):
    memory_gib = serializers.SerializerMethodField()

    class Meta:
        model = GPUType
        exclude = ["id", "device_match"]

    def get_memory_gib(self, gpu: GPUType) -> float:
        return round(gpu.memory_bytes / 2**30, 1)


class RegionSerializer(serializers.ModelSerializer):
    online_gpu_types = serializers.SerializerMethodField(
        help_text="The GPU types of its shared nodes that take new replicas now.")
    hourly_prices_usd = serializers.SerializerMethodField(
        help_text="Per device-hour, by GPU type, where an operator priced the region apart "
                  "from the general price; endpoints requiring the region pay it.")

    class Meta:
        model = Region
        fields = ["slug", "name", "online_gpu_types", "hourly_prices_usd"]

    def get_online_gpu_types(self, region: Region) -> list[str]:
        return sorted({node.gpu_type.slug for node in region.nodes.all()})

    def get_hourly_prices_usd(self, region: Region) -> dict[str, str]:
        return {price.gpu_type.slug: str(price.hourly_price_usd)
                for price in region.prices.all()}


class OwnNodeEngineSerializer(serializers.Serializer):
    endpoint = serializers.CharField(source="endpoint.name")
    replica = serializers.UUIDField(source="id")
    state = serializers.CharField()


class OwnNodeSerializer(serializers.Serializer):
    """One of the organisation's own nodes (endpoints.selectors.OwnNode) and its health."""

    name = serializers.CharField(source="node.name")
    state = serializers.CharField(source="node.state",
                                  help_text="online, lost, recovering or revoked.")
    draining = serializers.BooleanField(source="node.draining")
    region = serializers.CharField(source="node.region.slug", default=None)
    zone = serializers.CharField(source="node.zone")
    gpu_type = serializers.CharField(source="node.gpu_type.slug", default=None)
    gpus = serializers.SerializerMethodField()
    free_gpus = serializers.IntegerField(source="free_devices")
    memory_bytes = serializers.IntegerField(source="node.memory_bytes")
    disk_bytes = serializers.IntegerField(source="node.disk_bytes")
    vllm_version = serializers.CharField(source="node.vllm_version")
    last_heartbeat_at = serializers.DateTimeField(source="node.last_heartbeat_at")
    engines = OwnNodeEngineSerializer(many=True, help_text="Its replicas there now.")

    def get_gpus(self, own: OwnNode) -> int:
        return len(own.node.devices)


class ReplicaSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", default=None, read_only=True)

    class Meta:
        model = Replica
        fields = ["id", "state", "stage", "progress_percent", "node", "device_indices",
                  "kv_cache_tokens", "restarts", "failure_reason", "log_tail", "created_at",
                  "ready_at", "stopped_at"]


class EndpointSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.slug", read_only=True)
    gpu_type = serializers.CharField(source="gpu_type.slug", read_only=True)
    region = serializers.CharField(source="region.slug", default=None, read_only=True)
    progress = serializers.SerializerMethodField()
    replicas = serializers.SerializerMethodField()

    class Meta:
        model = Endpoint
        fields = ["id", "name", "model", "context_length", "concurrency", "gpu_type", "gpu_count",
                  "region", "own_nodes_only", "kv_cache_dtype", "prefix_caching", "host_tier_gib",
                  "disk_tier_gib", "lora_adapters", "lora_max_rank", "lora_host_adapters",
                  "cache_isolation", "prefix_affinity", "policy_version", "min_replicas",
                  "max_replicas", "scale_to_zero_after_seconds", "scaling_metric",
                  "scaling_target", "scale_up_window_seconds", "scale_down_window_seconds",
                  "last_scaled_at", "desired_replicas", "desired_state", "state", "failure_reason",
                  "progress",
                  "hourly_price_usd", "sizing", "replicas", "created_at"]

    @extend_schema_field({"type": "object", "properties": {
        "stage": {"type": "string"}, "percent": {"type": "integer"}}})
    def get_progress(self, endpoint: Endpoint) -> dict:
        return progress_of(endpoint=endpoint, replicas=endpoint.replicas.all())

    @extend_schema_field(ReplicaSerializer(many=True))
    def get_replicas(self, endpoint: Endpoint) -> list:
        recent = [r for r in endpoint.replicas.all() if r.state != State.STOPPED][:20]
        return ReplicaSerializer(recent, many=True).data


class EventSerializer(serializers.ModelSerializer):
    replica = serializers.UUIDField(source="replica_id", read_only=True)

    class Meta:
        model = EndpointEvent
        fields = ["at", "state", "message", "replica"]


class VisibleModelField(serializers.SlugRelatedField):
    """A model by slug among those the organisation in the serializer's context sees (the
    public catalog without one): another organisation's model is unknown, as if absent."""

    def get_queryset(self) -> QuerySet[ModelSpec]:
        return models_visible_to(organization=self.context.get("organization"))


def _model_field() -> serializers.SlugRelatedField:
    return VisibleModelField(
        slug_field="slug", queryset=ModelSpec.objects.none(),
        error_messages={"does_not_exist": "Unknown model {value!r}; GET /api/v1/models/ lists "
                                          "the catalog, and GET /api/v1/organizations/<org>/"
                                          "models/ your own (sized at POST /api/v1/"
                                          "organizations/<org>/sizing/)."})


class SizingInput(StrictSerializer):
    model = _model_field()
    context_length = serializers.IntegerField(min_value=MIN_CONTEXT_LENGTH,
                                              max_value=2**31 - 1)  # its column
    concurrency = serializers.IntegerField(min_value=1, max_value=MAX_CONCURRENCY)
    gpu_type = serializers.SlugRelatedField(
        slug_field="slug", queryset=GPUType.objects.all(), required=False, allow_null=True,
        error_messages={"does_not_exist": "Unknown GPU type {value!r}; GET /api/v1/gpu-types/ "
                                          "lists them."})
    gpu_count = serializers.ChoiceField(choices=[1, 2, 4, 8], required=False, allow_null=True)
    region = serializers.SlugRelatedField(
        slug_field="slug", queryset=Region.objects.all(), required=False, allow_null=True,
        help_text="Run only in this region, sized for what is online there; null: any.",
        error_messages={"does_not_exist": "Unknown region {value!r}; GET /api/v1/regions/ "
                                          "lists them."})
    own_nodes_only = serializers.BooleanField(
        default=False, help_text="Run only on the organisation's own nodes, sized and priced "
                                 "for what is online there; false: its own nodes first, then "
                                 "shared ones.")
    kv_cache_dtype = serializers.ChoiceField(choices=KVCacheDtype.choices, default="auto")
    host_tier_gib = serializers.IntegerField(
        default=0, min_value=0, max_value=MAX_HOST_TIER_GIB,
        help_text="Host-memory KV tier per replica, GiB (vLLM's native offloading); 0 for none.")
    disk_tier_gib = serializers.IntegerField(
        default=0, min_value=0, max_value=MAX_DISK_TIER_GIB,
        help_text="Disk KV tier per replica, GiB (LMCache; needs a host tier); 0 for none.")
    lora_adapters = serializers.IntegerField(
        default=0, min_value=0, max_value=MAX_LORA_ADAPTERS,
        help_text="LoRA adapters held on the device at once; 0 serves none.")
    lora_max_rank = serializers.ChoiceField(
        choices=LORA_RANKS, default=DEFAULT_LORA_RANK,
        error_messages={"invalid_choice": LORA_RANK_REFUSAL},
        help_text="The largest rank of an adapter the endpoint serves.")


class ScalingInput(StrictSerializer):
    """How an endpoint scales; on a change, only the fields sent change."""

    min_replicas = serializers.IntegerField(
        required=False, max_value=MAX_REPLICAS_PER_ENDPOINT,
        help_text="0 lets the endpoint scale to zero while idle; its next request wakes it.")
    max_replicas = serializers.IntegerField(required=False, max_value=MAX_REPLICAS_PER_ENDPOINT)
    scale_to_zero_after_seconds = serializers.IntegerField(
        required=False, max_value=MAX_IDLE_SECONDS,
        help_text="With min_replicas 0: seconds without a request before scaling to zero.")
    scaling_metric = serializers.ChoiceField(choices=ScalingMetric.choices, required=False)
    scaling_target = serializers.FloatField(
        required=False, allow_null=True,
        help_text="Per ready replica, in the metric's unit; null: the metric's default.")
    scale_up_window_seconds = serializers.IntegerField(required=False)
    scale_down_window_seconds = serializers.IntegerField(required=False)


class EndpointInput(SizingInput, ScalingInput):
    name = serializers.SlugField(max_length=63)
    max_replicas = serializers.IntegerField(
        required=False, allow_null=True, max_value=MAX_REPLICAS_PER_ENDPOINT,
        help_text="null: min_replicas, or 1 where that is 0.")
    prefix_caching = serializers.BooleanField(default=True)
    cache_isolation = serializers.ChoiceField(
        choices=CacheIsolation.choices, default=CacheIsolation.ORGANIZATION,
        help_text="Whose requests may reuse one another's cached prefixes.")
    prefix_affinity = serializers.BooleanField(
        default=True, help_text="Send requests sharing a prompt prefix to the same replica.")
    lora_host_adapters = serializers.IntegerField(
        default=0, min_value=0, max_value=MAX_LORA_HOST_ADAPTERS,
        help_text="Adapters kept in host memory, ready to swap in; 0: as many as on the "
                  "device.")


class PolicyInput(StrictSerializer):
    """A change of KV policy: only the fields sent change."""

    context_length = serializers.IntegerField(min_value=MIN_CONTEXT_LENGTH, max_value=2**31 - 1,
                                              required=False)
    concurrency = serializers.IntegerField(min_value=1, max_value=MAX_CONCURRENCY,
                                           required=False)
    kv_cache_dtype = serializers.ChoiceField(choices=KVCacheDtype.choices, required=False)
    prefix_caching = serializers.BooleanField(required=False)
    host_tier_gib = serializers.IntegerField(min_value=0, max_value=MAX_HOST_TIER_GIB,
                                             required=False)
    disk_tier_gib = serializers.IntegerField(min_value=0, max_value=MAX_DISK_TIER_GIB,
                                             required=False)
    cache_isolation = serializers.ChoiceField(choices=CacheIsolation.choices, required=False)
    prefix_affinity = serializers.BooleanField(required=False)
    lora_adapters = serializers.IntegerField(min_value=0, max_value=MAX_LORA_ADAPTERS,
                                             required=False)
    lora_max_rank = serializers.ChoiceField(choices=LORA_RANKS, required=False,
                                            error_messages={"invalid_choice": LORA_RANK_REFUSAL})
    lora_host_adapters = serializers.IntegerField(min_value=0, max_value=MAX_LORA_HOST_ADAPTERS,
                                                  required=False)


class ScaleInput(StrictSerializer):
    replicas = serializers.IntegerField()
