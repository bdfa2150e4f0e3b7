from django.db import models
from django.utils import timezone


class AttentionKind(models.TextChoices):
    MHA = "mha", "multi-head"
    GQA = "gqa", "grouped-query"
    MLA = "mla", "multi-head latent"


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
    licence = models.CharField(max_length=40)

    class Meta:
        ordering = ["family", "parameters"]
        verbose_name = "model"

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

    class Meta:
        ordering = ["hourly_price_usd"]
        verbose_name = "GPU type"

    def __str__(self) -> str:
        return self.name


class NodeState(models.TextChoices):
    ONLINE = "online"
    LOST = "lost"


class Node(models.Model):
    """A host running a node agent; it serves the Celery queue `node.<name>`."""

    name = models.CharField(max_length=100, unique=True)
    state = models.CharField(max_length=10, choices=NodeState.choices, default=NodeState.ONLINE)
    gpu_type = models.ForeignKey(GPUType, null=True, blank=True, on_delete=models.PROTECT)
    devices = models.JSONField(default=list, help_text="[{index, name, memory_bytes}] per GPU")
    cpu_count = models.PositiveIntegerField()
    memory_bytes = models.BigIntegerField()
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def queue(self) -> str:
        return f"node.{self.name}"
