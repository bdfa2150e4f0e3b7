import hashlib
import uuid
from collections.abc import Iterable

from django.contrib.postgres.fields import ArrayField
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from endpoints.states import BilledPhase, State
from engine import lora, tasks
from engine.kv_policy import KVPolicy

# The endpoint's contract, defined here once: the services, forms, serializers, wizard and
# API schema import these bounds and defaults.
#
# A context shorter than one CPU engine's KV block holds no real chat prompt (the template
# alone of most chat models takes tens of tokens), so it is refused rather than sized.
MIN_CONTEXT_LENGTH = 128
DEFAULT_CONTEXT_LENGTH = 4096
# Sequences one engine schedules at once (vLLM's --max-num-seqs); beyond this, a typo.
MAX_CONCURRENCY = 4096
DEFAULT_CONCURRENCY = 8
# A hard cap, whatever an organisation's quota: a reconcile pass over one endpoint costs the
# square of its replicas, on the queue that also carries usage ingestion.
MAX_REPLICAS_PER_ENDPOINT = 16
# A host tier beyond this is a typo, not a plan: the largest hosts have a few TiB of memory.
MAX_HOST_TIER_GIB = 4096
MAX_DISK_TIER_GIB = 65536
# LoRA: adapters an engine holds on the device at once (vLLM's --max-loras), each taking
# device memory at the largest rank whether used or not (engine.lora.device_bytes); beyond
# this, a typo. Those kept in host memory, ready to swap in (--max-cpu-loras), cost no device
# memory; 0 keeps as many as the device holds.
MAX_LORA_ADAPTERS = 32
MAX_LORA_HOST_ADAPTERS = 256
DEFAULT_LORA_RANK = 16
LORA_RANKS = lora.RANKS
LORA_RANK_REFUSAL = (f"Choose a rank vLLM takes: {', '.join(map(str, LORA_RANKS[:-1]))} or "
                     f"{LORA_RANKS[-1]}.")
DEFAULT_IDLE_SECONDS = 900
MAX_IDLE_SECONDS = 30 * 24 * 3600  # a month; beyond, the endpoint may as well not scale to zero
# The autoscaler judges a window by the engines' samples: one needs a few scrapes to say
# anything, and the samples are kept as read for two hours (telemetry.models.RAW_KEPT).
SHORTEST_WINDOW_SECONDS, LONGEST_WINDOW_SECONDS = 15, 7200
DEFAULT_SCALE_UP_WINDOW_SECONDS, DEFAULT_SCALE_DOWN_WINDOW_SECONDS = 60, 300

# Engines get the name as --served-model-name, so one that starts with "-" would be read as
# another flag (such as --trust-remote-code): a name starts with a letter.
validate_endpoint_name = RegexValidator(
    r"^[A-Za-z][A-Za-z0-9_-]*\Z",
    message="Start the name with a letter, then use letters, digits and hyphens only, such as "
            "support-chat.")


class AttentionKind(models.TextChoices):
    MHA = "mha", "multi-head"
    GQA = "gqa", "grouped-query"
    MLA = "mla", "multi-head latent"


class Task(models.TextChoices):
    """What a model's endpoints serve (engine.tasks)."""

    GENERATE = tasks.GENERATE, "chat and completions"
    EMBED = tasks.EMBED, "embeddings"
    SCORE = tasks.SCORE, "rerank and score"


class ModelSpec(models.Model):
    """An open model in the catalog, with the numbers from its published config.json."""

    slug = models.SlugField(max_length=80, unique=True)
    name = models.CharField(max_length=120)
    hf_repo = models.CharField(max_length=200, blank=True)
    family = models.CharField(max_length=40)
    architecture = models.CharField(max_length=80)
    parameters = models.BigIntegerField(help_text="Total parameter count.")
    active_parameters = models.BigIntegerField(
        null=True, blank=True, help_text="Parameters used per token, for mixture-of-experts models."
    )
    layers = models.PositiveIntegerField()
    hidden_size = models.PositiveIntegerField()
    intermediate_size = models.PositiveIntegerField(
        null=True, blank=True, help_text="The MLP's width: with the attention's, what LoRA "
        "slots take on the device.")
    attention_heads = models.PositiveIntegerField()
    kv_heads = models.PositiveIntegerField()
    head_dim = models.PositiveIntegerField()
    vocab_size = models.PositiveIntegerField()
    max_context = models.PositiveIntegerField(help_text="max_position_embeddings")
    attention_kind = models.CharField(max_length=3, choices=AttentionKind.choices)
    kv_lora_rank = models.PositiveIntegerField(null=True, blank=True, help_text="MLA latent rank")
    qk_rope_head_dim = models.PositiveIntegerField(null=True, blank=True, help_text="MLA rope dim")
    sliding_window = models.PositiveIntegerField(null=True, blank=True)
    sliding_window_layers = models.PositiveIntegerField(
        null=True, blank=True, help_text="How many layers use the sliding window."
    )
    default_dtype = models.CharField(max_length=20)
    weights_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="What the checkpoint's weights take as its files state "
        "them (quantized ones included); sizing uses it in place of parameters x dtype bytes.")
    licence = models.CharField(max_length=40)
    task = models.CharField(max_length=10, choices=Task.choices, default=Task.GENERATE,
                            help_text="Generate text, or pool it into embeddings or scores.")
    # A model added from the hub by an organisation is its own: no other one sees it, until an
    # operator promotes it to the public catalog (organization empty).
    organization = models.ForeignKey("accounts.Organization", null=True, blank=True,
                                     on_delete=models.CASCADE, related_name="models")
    added_by = models.ForeignKey("accounts.User", null=True, blank=True,
                                 on_delete=models.SET_NULL, related_name="+")
    added_at = models.DateTimeField(default=timezone.now)
    hf_revision = models.CharField(max_length=200, blank=True,
                                   help_text="The branch, tag or commit asked for.")
    hf_commit = models.CharField(
        max_length=40, blank=True, help_text="The commit the revision resolved to when added: "
        "every engine loads exactly these files.")
    files = models.JSONField(default=list, blank=True,
                             help_text="[{path, size, sha256}]: what a node's model cache fetches "
                                       "and checks.")
    chat_template = models.BooleanField(
        default=True, help_text="Its tokenizer has a chat template; without one only "
        "completions work.")
    trust_remote_code = models.BooleanField(
        default=False, help_text="Its engines run code from its repository (an operator allowed "
        "it for this model).")
    # engine.parsers: without a tool-call parser an engine takes no tools at all.
    tool_call_parser = models.CharField(
        max_length=40, blank=True, help_text="vLLM's --tool-call-parser for its engines; empty: "
        "they take no tools.")
    reasoning_parser = models.CharField(
        max_length=40, blank=True, help_text="vLLM's --reasoning-parser for its engines; empty: "
        "any thinking stays in the answer's text.")
    # The access token for a gated or private repository, sealed (kvrun.common.sealing) with a
    # key kept outside the database; read only by the step that downloads the weights.
    hf_token_sealed = models.TextField(blank=True)
    hf_token_last4 = models.CharField(max_length=4, blank=True)

    class Meta:
        ordering = ["family", "parameters"]
        verbose_name = "model"
        constraints = [
            models.UniqueConstraint(fields=["organization", "hf_repo", "hf_commit"],
                                    condition=models.Q(organization__isnull=False),
                                    name="one_model_per_organization_repository_commit"),
        ]

    def __str__(self) -> str:
        return self.name


class Region(models.Model):
    """Where nodes are, as an operator names it (a site, or a cloud's region): an endpoint
    that requires one has its replicas there and nowhere else."""

    slug = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=80)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.name


class GPUType(models.Model):
    """A kind of accelerator kvrun can place engines on, with its list price."""

    slug = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=80)
    vendor = models.CharField(max_length=20)
    device_match = models.CharField(
        max_length=40, blank=True, help_text="Found in the driver's device name, e.g. 'H200'."
    )
    memory_bytes = models.BigIntegerField(help_text="Usable device memory.")
    bandwidth_gb_s = models.PositiveIntegerField(help_text="Memory bandwidth, GB/s.")
    hourly_price_usd = models.DecimalField(max_digits=8, decimal_places=4)
    # Quoted, like hourly_price_usd, from billing's price versions (billing.rollup).
    own_node_price_usd = models.DecimalField(
        max_digits=8, decimal_places=4, default=0,
        help_text="Per device-hour on an organisation's own node.")

    class Meta:
        ordering = ["hourly_price_usd"]
        verbose_name = "GPU type"

    def __str__(self) -> str:
        return self.name


class RegionalPrice(models.Model):
    """The list price of a GPU type in a region whose operator priced it apart: what sizing
    and endpoints there quote. Kept from billing's price versions (billing.rollup)."""

    region = models.ForeignKey(Region, on_delete=models.CASCADE, related_name="prices")
    gpu_type = models.ForeignKey(GPUType, on_delete=models.CASCADE, related_name="+")
    hourly_price_usd = models.DecimalField(max_digits=8, decimal_places=4)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["region", "gpu_type"],
                                               name="endpoints_regional_price_once")]

    def __str__(self) -> str:
        return f"{self.gpu_type} in {self.region}: ${self.hourly_price_usd}/h"


class NodeState(models.TextChoices):
    ONLINE = "online"
    LOST = "lost"
    # Heartbeats again (back from lost, or registered anew) while its agent still runs
    # engines kvrun no longer expects there: it takes no replicas until the agent has stopped
    # them, or their memory would still be taken when a new engine loads on the same devices.
    RECOVERING = "recovering"
    # Its credential was revoked (fleet.enrolment.do_revoke_node): its agent is refused, its
    # replicas are replaced elsewhere, and only enrolling it anew brings it back.
    REVOKED = "revoked"


class Node(models.Model):
    """A host running a node agent, which reaches kvrun through the node channel (fleet)."""

    name = models.CharField(max_length=100, unique=True)
    address = models.GenericIPAddressField(
        default="127.0.0.1", help_text="Where its engines listen; reachable from web processes.")
    state = models.CharField(max_length=10, choices=NodeState.choices, default=NodeState.ONLINE)
    # Set by the operator who made its join token (fleet.enrolment), never by the node.
    region = models.ForeignKey(Region, null=True, blank=True, on_delete=models.PROTECT,
                               related_name="nodes")
    zone = models.CharField(max_length=40, blank=True)
    # Likewise from its join token: an organisation's own node runs its endpoints alone.
    organization = models.ForeignKey(
        "accounts.Organization", null=True, blank=True, on_delete=models.PROTECT,
        related_name="nodes", help_text="Whose own node it is; none: the shared fleet's.")
    gpu_type = models.ForeignKey(GPUType, null=True, blank=True, on_delete=models.PROTECT)
    devices = models.JSONField(default=list, help_text="[{index, name, memory_bytes}] per GPU")
    cpu_count = models.PositiveIntegerField()
    memory_bytes = models.BigIntegerField()
    disk_bytes = models.BigIntegerField(
        default=0, help_text="The file system its KV tiers on disk and its model cache are on.")
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(default=timezone.now)
    draining = models.BooleanField(
        default=False, help_text="Takes no new replicas; its replicas move to other nodes.")
    vllm_version = models.CharField(max_length=40, blank=True)
    architectures = ArrayField(models.CharField(max_length=100), default=list, blank=True,
                               help_text="The model architectures its vLLM build runs.")
    tool_parsers = ArrayField(models.CharField(max_length=40), default=list, blank=True,
                              help_text="The tool-call parsers its vLLM build offers.")
    reasoning_parsers = ArrayField(models.CharField(max_length=40), default=list, blank=True,
                                   help_text="The reasoning parsers its vLLM build offers.")
    model_cache_bytes = models.BigIntegerField(
        default=0, help_text="The disk its agent keeps for downloaded weights.")
    model_cache = models.JSONField(
        default=list, blank=True,
        help_text="[{repo_id, commit, bytes, last_used}]: the weights its agent keeps now.")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def holds_weights(self, model: "ModelSpec") -> bool:
        """Whether its model cache has `model`'s pinned files: a start there downloads none."""
        return bool(model.hf_commit) and any(
            entry["repo_id"] == model.hf_repo and entry["commit"] == model.hf_commit
            for entry in self.model_cache)


class DesiredState(models.TextChoices):
    """What the user asked an endpoint to be; the reconciler moves its replicas there."""

    RUNNING = "running", "running"
    STOPPED = "stopped", "stopped"


class KVCacheDtype(models.TextChoices):
    AUTO = "auto", "same as the model"
    FP8 = "fp8", "fp8 (half the memory)"


class ScalingMetric(models.TextChoices):
    """What the autoscaler keeps near its target, per ready replica: the gateways' requests
    in flight, or the engines' waiting requests or KV cache usage."""

    IN_FLIGHT = "in_flight", "requests in flight"
    WAITING = "waiting", "requests waiting"
    KV_CACHE_USAGE = "kv_cache_usage", "KV cache usage, %"


class CacheIsolation(models.TextChoices):
    """Whose requests may reuse one another's cached prefixes (vLLM's cache_salt)."""

    ORGANIZATION = "organization", "within the organisation"
    KEY = "key", "within each API key"


class Endpoint(models.Model):
    """A dedicated deployment of one model for one organisation.

    `desired_state` and `desired_replicas` are what the user asked for; the reconciler moves
    replicas towards them. `state` summarises the replicas for the user.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE,
                                     related_name="endpoints")
    name = models.SlugField(max_length=63, validators=[validate_endpoint_name])
    model = models.ForeignKey(ModelSpec, on_delete=models.PROTECT, related_name="endpoints")
    context_length = models.PositiveIntegerField()
    concurrency = models.PositiveIntegerField()
    gpu_type = models.ForeignKey(GPUType, on_delete=models.PROTECT, related_name="endpoints")
    gpu_count = models.PositiveSmallIntegerField()
    region = models.ForeignKey(
        Region, null=True, blank=True, on_delete=models.PROTECT, related_name="endpoints",
        help_text="Its replicas run in this region only; none: in any.")
    own_nodes_only = models.BooleanField(
        default=False, help_text="Its replicas run on its organisation's own nodes only.")
    kv_cache_dtype = models.CharField(max_length=8, choices=KVCacheDtype.choices,
                                      default=KVCacheDtype.AUTO)
    prefix_caching = models.BooleanField(default=True)
    host_tier_gib = models.PositiveIntegerField(
        default=0, help_text="Host-memory KV tier per replica, GiB; 0 for none.")
    disk_tier_gib = models.PositiveIntegerField(
        default=0, help_text="Disk KV tier per replica (LMCache), GiB; 0 for none.")
    cache_isolation = models.CharField(max_length=12, choices=CacheIsolation.choices,
                                       default=CacheIsolation.ORGANIZATION)
    prefix_affinity = models.BooleanField(
        default=True, help_text="Send requests that share a prompt prefix to the same replica, "
                                "where its cache holds that prefix (with two or more replicas).")
    lora_adapters = models.PositiveSmallIntegerField(
        default=0, help_text="LoRA adapters its engines hold on the device at once; 0 serves "
                             "none.")
    lora_max_rank = models.PositiveSmallIntegerField(
        default=DEFAULT_LORA_RANK, help_text="The largest rank of an adapter it serves.")
    lora_host_adapters = models.PositiveSmallIntegerField(
        default=0, help_text="Adapters kept in host memory, ready to swap in; 0: as many as "
                             "on the device.")
    policy_version = models.PositiveIntegerField(
        default=1, help_text="Raised by each change to what engines start with; replicas "
                             "started under an older one are replaced one at a time.")
    min_replicas = models.PositiveSmallIntegerField(
        default=1, help_text="0 lets the endpoint scale to zero while idle.")
    scale_to_zero_after_seconds = models.PositiveIntegerField(
        default=DEFAULT_IDLE_SECONDS,
        help_text="With min_replicas 0: how long without a request before the endpoint scales "
                  "to zero.")
    scaling_metric = models.CharField(max_length=16, choices=ScalingMetric.choices,
                                      default=ScalingMetric.IN_FLIGHT)
    scaling_target = models.FloatField(
        null=True, blank=True, help_text="Per ready replica, in the metric's unit; empty: the "
                                         "endpoint's concurrency, 1 waiting, or 90 % of the KV "
                                         "cache.")
    scale_up_window_seconds = models.PositiveIntegerField(
        default=DEFAULT_SCALE_UP_WINDOW_SECONDS,
        help_text="How long the metric stays above target before a replica is added.")
    scale_down_window_seconds = models.PositiveIntegerField(
        default=DEFAULT_SCALE_DOWN_WINDOW_SECONDS,
        help_text="How long the load would fit on one replica fewer before one is removed.")
    last_scaled_at = models.DateTimeField(
        null=True, blank=True, help_text="The autoscaler's last change: the next one waits a "
                                         "window from it.")
    max_replicas = models.PositiveSmallIntegerField(default=1)
    desired_replicas = models.PositiveSmallIntegerField(default=1)
    desired_state = models.CharField(max_length=10, choices=DesiredState.choices,
                                     default=DesiredState.RUNNING)
    state = models.CharField(max_length=12, choices=State.choices, default=State.PENDING)
    failure_reason = models.TextField(blank=True)
    sizing = models.JSONField(default=dict, help_text="The sizing decision, in numbers and words.")
    hourly_price_usd = models.DecimalField(max_digits=10, decimal_places=4)
    created_by = models.ForeignKey("accounts.User", null=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "name"],
                                    condition=models.Q(deleted_at=None),
                                    name="endpoints_endpoint_name_unique"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def target(self) -> float:
        """The scaling target per replica, the default of its metric where none is set."""
        if self.scaling_target is not None:
            return self.scaling_target
        return {ScalingMetric.IN_FLIGHT: float(self.concurrency), ScalingMetric.WAITING: 1.0,
                ScalingMetric.KV_CACHE_USAGE: 90.0}[self.scaling_metric]

    @property
    def kv_policy(self) -> KVPolicy:
        """What its engines are told of their KV cache."""
        return KVPolicy(kv_cache_dtype=self.kv_cache_dtype, prefix_caching=self.prefix_caching,
                        host_tier_gib=self.host_tier_gib, disk_tier_gib=self.disk_tier_gib)


class Replica(models.Model):
    """One engine process serving an endpoint on a node."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="replicas")
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="replicas")
    device_indices = ArrayField(models.PositiveSmallIntegerField(), default=list, blank=True)
    state = models.CharField(max_length=12, choices=State.choices, default=State.PENDING)
    stage = models.CharField(max_length=80, blank=True)
    progress_percent = models.PositiveSmallIntegerField(default=0)
    progress_at = models.DateTimeField(null=True, blank=True,
                                       help_text="When its agent last reported progress.")
    # A download of its weights: when it should end (while it runs), and how long it took.
    download_done_at = models.DateTimeField(null=True, blank=True)
    download_seconds = models.FloatField(null=True, blank=True)
    failure_reason = models.TextField(blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    tls = models.BooleanField(
        default=False, help_text="Its engine serves HTTPS with a certificate signed for it on "
                                 "its node (fleet.certificates): set when signed, cleared when "
                                 "its engine is started again.")
    pid = models.PositiveIntegerField(null=True, blank=True)
    kv_cache_tokens = models.BigIntegerField(null=True, blank=True)
    adapters = ArrayField(models.CharField(max_length=63), default=list, blank=True,
                          help_text="The LoRA adapters its engine serves, as its agent last "
                                    "read them: the gateway routes an adapter's requests to "
                                    "these replicas only.")
    policy_version = models.PositiveIntegerField(
        default=1, help_text="The endpoint's policy version its engine started with.")
    # As its agent started the engine (engine.parsers), which the gateway says and checks:
    # a model's parsers changed since, or an agent that starts none, leave these empty.
    tool_call_parser = models.CharField(max_length=40, blank=True)
    reasoning_parser = models.CharField(max_length=40, blank=True)
    restarts = models.PositiveSmallIntegerField(default=0)
    next_start_at = models.DateTimeField(null=True, blank=True, help_text="Restart backoff.")
    log_tail = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"{self.endpoint.name}/{str(self.id)[:8]}"


class AdapterSource(models.TextChoices):
    HUB = "hub", "Hugging Face hub"
    UPLOAD = "upload", "upload"


class Adapter(models.Model):
    """A LoRA adapter an endpoint serves beside its model: clients call it as
    `<endpoint>:<name>`. Its files come from the hub at a pinned commit, or were uploaded
    (AdapterFile); each node writes them to its model cache and its engines load them from
    there."""

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="adapters")
    name = models.SlugField(max_length=63, validators=[validate_endpoint_name])
    source = models.CharField(max_length=6, choices=AdapterSource.choices)
    hf_repo = models.CharField(max_length=200, blank=True)
    hf_revision = models.CharField(max_length=200, blank=True)
    hf_commit = models.CharField(max_length=40, blank=True)
    files = models.JSONField(default=list, help_text="[{path, size, sha256}]")
    hf_token_sealed = models.TextField(blank=True)
    hf_token_last4 = models.CharField(max_length=4, blank=True)
    base_model = models.CharField(max_length=200, blank=True,
                                  help_text="The model it says it was trained on.")
    rank = models.PositiveSmallIntegerField()
    target_modules = ArrayField(models.CharField(max_length=40), default=list)
    size_bytes = models.BigIntegerField()
    added_by = models.ForeignKey("accounts.User", null=True, blank=True,
                                 on_delete=models.SET_NULL, related_name="+")
    added_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["endpoint", "name"],
                                               name="one_adapter_name_per_endpoint")]

    def __str__(self) -> str:
        return self.name

    @property
    def folder(self) -> str:
        """Its folder in a node's model cache: the commit's snapshot, or its upload's digest
        (a change of weights is a new folder, so no engine's prefix cache mixes the two)."""
        if self.source == AdapterSource.HUB:
            return f"{self.hf_repo.replace('/', '--')}/{self.hf_commit}"
        # Both files: the same weights under another config (alpha, targets) are another
        # adapter.
        both = "".join(sorted(f["sha256"] for f in self.files))
        return f"uploads/{hashlib.sha256(both.encode()).hexdigest()}"

    def serving(self, replicas: Iterable["Replica"]) -> int:
        """How many of `replicas` are ready and serve it."""
        return sum(1 for replica in replicas
                   if replica.state == State.READY and self.name in replica.adapters)


class AdapterFile(models.Model):
    """One file of an uploaded adapter, kept in the database until a node writes it out."""

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="uploads")
    path = models.CharField(max_length=100)
    content = models.BinaryField()
    sha256 = models.CharField(max_length=64)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["adapter", "path"],
                                               name="one_upload_per_adapter_path")]


class EndpointEvent(models.Model):
    """Every lifecycle transition the user can see, with its time. Rows are never updated."""

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="events")
    replica = models.ForeignKey(Replica, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="events")
    at = models.DateTimeField(default=timezone.now)
    state = models.CharField(max_length=12, choices=State.choices)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["endpoint", "at"])]


class ReplicaInterval(models.Model):
    """A span during which a replica held its devices in one phase: the GPU-time ledger.

    Written by the replica's state transitions in their own transaction (lifecycle): a
    transition opens the next phase's interval and closes the open one, which is then never
    changed again. At most one interval of a replica is open, so a transition delivered twice
    records one. Endpoint, organisation, devices and price region are copied from the
    endpoint, and whether its node was the organisation's own, when the interval opens, as a
    ledger row keeps what was true then.
    """

    replica = models.ForeignKey(Replica, on_delete=models.PROTECT, related_name="intervals")
    endpoint = models.ForeignKey(Endpoint, on_delete=models.PROTECT, related_name="intervals")
    organization = models.ForeignKey("accounts.Organization", on_delete=models.PROTECT,
                                     related_name="replica_intervals")
    gpu_type = models.ForeignKey(GPUType, on_delete=models.PROTECT, related_name="+")
    gpu_count = models.PositiveSmallIntegerField()
    # What prices it: the region the endpoint requires, whose price was quoted (none: the
    # GPU type's general price, wherever it ran), and whether the node was its own.
    price_region = models.ForeignKey(Region, null=True, blank=True, on_delete=models.PROTECT,
                                     related_name="+")
    own_node = models.BooleanField(default=False)
    phase = models.CharField(max_length=10, choices=BilledPhase.choices)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True,
                                    help_text="Empty while the replica is still in this phase.")

    class Meta:
        ordering = ["started_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["replica"], condition=models.Q(ended_at=None),
                                    name="endpoints_interval_one_open_per_replica"),
            models.CheckConstraint(condition=models.Q(ended_at__gte=models.F("started_at")),
                                   name="endpoints_interval_ends_after_start"),
        ]
        indexes = [
            models.Index(fields=["endpoint", "started_at"]),
            models.Index(fields=["ended_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.replica} {self.phase} from {self.started_at:%Y-%m-%d %H:%M:%S}"
