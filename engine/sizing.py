"""How much accelerator memory an endpoint needs, and the cheapest hardware that holds it.

Pure Python, no Django. KV bytes follow vLLM's own arithmetic so that kvrun's figures match
the `KV cache size: N tokens` an engine logs:

    per token, per rank = 2 (K and V) x layers x max(1, KV heads / TP) x head dim x KV dtype bytes
    MLA (DeepSeek)      = layers x (latent rank + rope dim) x KV dtype bytes, not split by TP
    sliding-window layers hold at most `window` tokens of a request.

Requests occupy whole blocks (16 tokens on GPUs, 128 on vLLM's CPU backend).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal

from engine.lora import LoraShape, device_bytes

# Device kinds: a GPU node's, and a CPU node's (also the catalog's GPU-type slug for CPU nodes).
GPU = "gpu"
CPU = "cpu"
GIB = 1024**3
GB = 1000**3
TP_SIZES = (1, 2, 4, 8)
GPU_BLOCK_TOKENS = 16
CPU_BLOCK_TOKENS = 128
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
# CUDA context, activations for a full prefill batch and CUDA graphs, per GPU. vLLM profiles
# this at start-up; 2 GiB is what 7B-70B models measure at default batch sizes.
RUNTIME_OVERHEAD_BYTES = 2 * GIB

WEIGHT_BYTES_PER_PARAM = {"bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "float8_e4m3fn": 1.0,
                          "int4": 0.5}
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class ModelShape:
    """The numbers from a model's config.json that sizing needs."""

    name: str
    parameters: int
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    max_context: int
    attention_kind: str = "gqa"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    # The checkpoint's weights as its files state them; None: parameters x the dtype's bytes.
    weights_bytes: int | None = None
    # Its linear layers' dimensions, for the device memory LoRA slots take; None: unknown.
    lora: LoraShape | None = None
    # A pooling model (engine.tasks) reads each input whole in one step and writes nothing:
    # what a batch needs is its activations, and its KV cache where the model keeps one
    # (a decoder's; an encoder such as BERT keeps none).
    pooling: bool = False
    kv_cache: bool = True
    hidden_size: int = 0
    intermediate_size: int = 0


@dataclass(frozen=True)
class Accelerator:
    slug: str
    name: str
    memory_bytes: int
    hourly_price: Decimal


@dataclass(frozen=True)
class Request:
    """What the user asks for: a context length, a concurrency, and the dtypes."""

    context_length: int
    concurrency: int
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_tokens: int = GPU_BLOCK_TOKENS
    # LoRA adapters held on the device at once (0: none), at most this rank.
    lora_adapters: int = 0
    lora_max_rank: int = 0


def weight_bytes(model: ModelShape, dtype: str) -> int:
    if model.weights_bytes is not None:
        return model.weights_bytes
    return math.ceil(model.parameters * WEIGHT_BYTES_PER_PARAM[dtype])


def kv_bytes_per_token_per_layer(model: ModelShape, *, kv_dtype: str, tp: int) -> int:
    value_bytes = KV_DTYPE_BYTES[kv_dtype]
    if model.attention_kind == "mla":
        assert model.kv_lora_rank is not None and model.qk_rope_head_dim is not None, model
        return (model.kv_lora_rank + model.qk_rope_head_dim) * value_bytes
    return 2 * max(1, model.kv_heads // tp) * model.head_dim * value_bytes


def kv_bytes_per_token(model: ModelShape, *, kv_dtype: str = "auto", tp: int = 1) -> int:
    """KV bytes one token occupies on one rank, all layers (no window cap)."""
    return model.layers * kv_bytes_per_token_per_layer(model, kv_dtype=kv_dtype, tp=tp)


def kv_bytes_for_request(model: ModelShape, *, tokens: int, kv_dtype: str = "auto", tp: int = 1,
                         block_tokens: int = GPU_BLOCK_TOKENS) -> int:
    """KV bytes one request of `tokens` tokens holds on one rank, rounded up to whole blocks."""
    per_layer = kv_bytes_per_token_per_layer(model, kv_dtype=kv_dtype, tp=tp)
    full_layers = model.layers - model.sliding_window_layers
    windowed = min(tokens, model.sliding_window or tokens)
    return per_layer * (full_layers * _blocks(tokens, block_tokens)
                        + model.sliding_window_layers * _blocks(windowed, block_tokens))


def activation_bytes_per_token(model: ModelShape, *, tp: int = 1) -> int:
    """What one token of a pooling model's batch holds on one rank at the widest point of a
    layer, in 16 bits: its residual (whole on every rank) and the wider of its attention's
    query, key and value projections and its MLP's gate and up halves (split over ranks),
    the peak vLLM's profiling run measures at start-up."""
    projections = max((model.attention_heads + 2 * model.kv_heads) * model.head_dim,
                      2 * model.intermediate_size)
    return 2 * (model.hidden_size + projections // tp)


def request_bytes(model: ModelShape, request: Request, *, tokens: int, tp: int) -> int:
    """What one request of `tokens` tokens holds on one rank beyond the weights: its KV
    cache, and for a pooling model its activations (all of a batch's are held at once)."""
    held = kv_bytes_for_request(model, tokens=tokens, kv_dtype=request.kv_dtype, tp=tp,
                                block_tokens=request.block_tokens) if model.kv_cache else 0
    if model.pooling:
        held += tokens * activation_bytes_per_token(model, tp=tp)
    return held


def _blocks(tokens: int, block_tokens: int) -> int:
    return math.ceil(tokens / block_tokens) * block_tokens


def kv_cache_tokens(model: ModelShape, *, kv_bytes: int, kv_dtype: str = "auto",
                    tp: int = 1) -> int:
    """Tokens a KV pool of `kv_bytes` per rank holds, as vLLM reports `KV cache size`."""
    return kv_bytes // kv_bytes_per_token(model, kv_dtype=kv_dtype, tp=tp)


@dataclass(frozen=True)
class Fit:
    """One hardware choice, with the per-GPU arithmetic behind it."""

    accelerator: Accelerator
    count: int
    weight_bytes_per_gpu: int
    kv_needed_per_gpu: int
    kv_available_per_gpu: int
    overhead_bytes_per_gpu: int
    usable_bytes_per_gpu: int
    lora_bytes_per_gpu: int = 0

    @property
    def fits(self) -> bool:
        return self.kv_available_per_gpu >= self.kv_needed_per_gpu

    @property
    def hourly_price(self) -> Decimal:
        return self.accelerator.hourly_price * self.count


@dataclass(frozen=True)
class Decision:
    model: ModelShape
    request: Request
    choice: Fit | None
    explanation: str
    alternatives: list[Fit] = field(default_factory=list)


def evaluate(model: ModelShape, request: Request, accelerator: Accelerator, count: int) -> Fit:
    usable = int(accelerator.memory_bytes * request.gpu_memory_utilization)
    weights = math.ceil(weight_bytes(model, request.weight_dtype) / count)
    needed = request.concurrency * request_bytes(model, request, tokens=request.context_length,
                                                 tp=count)
    adapters = lora_bytes(model, request, tp=count)
    available = usable - weights - adapters - RUNTIME_OVERHEAD_BYTES
    return Fit(accelerator=accelerator, count=count, weight_bytes_per_gpu=weights,
               kv_needed_per_gpu=needed, kv_available_per_gpu=available,
               overhead_bytes_per_gpu=RUNTIME_OVERHEAD_BYTES, usable_bytes_per_gpu=usable,
               lora_bytes_per_gpu=adapters)


def lora_bytes(model: ModelShape, request: Request, *, tp: int) -> int:
    """What the request's LoRA slots take on each GPU (engine.lora.device_bytes)."""
    if not request.lora_adapters or model.lora is None:
        return 0
    return device_bytes(model.lora, adapters=request.lora_adapters,
                        max_rank=request.lora_max_rank, tp=tp, dtype=request.weight_dtype)


def valid_tp(model: ModelShape, count: int) -> bool:
    """vLLM splits attention heads evenly across ranks."""
    return model.attention_heads % count == 0


def choose(model: ModelShape, request: Request, accelerators: list[Accelerator],
           counts: tuple[int, ...] = TP_SIZES) -> Decision:
    """The cheapest (accelerator, count) that holds the weights and the requested KV cache."""
    fits = [evaluate(model, request, accelerator, count)
            for accelerator in accelerators for count in counts if valid_tp(model, count)]
    fitting = sorted((fit for fit in fits if fit.fits),
                     key=lambda fit: (fit.hourly_price, fit.count))
    choice = fitting[0] if fitting else None
    return Decision(model=model, request=request, choice=choice,
                    explanation=explain(model, request, choice, fits), alternatives=fitting[1:4])


def explain(model: ModelShape, request: Request, choice: Fit | None, fits: list[Fit]) -> str:
    held = gib_text(request.concurrency * request_bytes(model, request,
                                                        tokens=request.context_length, tp=1))
    weights = gb_text(weight_bytes(model, request.weight_dtype))
    if model.pooling:
        asked = (f"weights {weights} + {held} for a batch of {request.concurrency} × "
                 f"{_k(request.context_length)} tokens")
    else:
        asked = (f"weights {weights} + KV {held} for {request.concurrency} × "
                 f"{_k(request.context_length)} tokens")
    if request.lora_adapters and model.lora is not None:
        asked += (f" + LoRA {gib_text(lora_bytes(model, request, tp=1))} for "
                  f"{request.lora_adapters} adapter(s) of rank {request.lora_max_rank}")
    if choice is None:
        best = max(fits, key=lambda fit: fit.kv_available_per_gpu, default=None)
        if best is None or best.kv_available_per_gpu <= 0:
            return f"{asked}: the weights alone fit no offered GPU configuration."
        return (f"{asked} fits no offered GPU configuration; the largest, "
                f"{best.count} × {best.accelerator.name}, "
                f"{_capacity_text(model, request, best)}.")
    text = f"{asked} → {choice.count} × {choice.accelerator.name}"
    one = next((fit for fit in fits if fit.accelerator == choice.accelerator and fit.count == 1),
               None)
    if choice.count > 1 and one is not None:
        text += f"; 1 × {choice.accelerator.name} {_capacity_text(model, request, one)}"
    return text


def _capacity_text(model: ModelShape, request: Request, fit: Fit) -> str:
    if fit.kv_available_per_gpu <= 0:
        return "cannot hold the weights"
    concurrency = largest_concurrency(model, request, fit)
    if concurrency >= 1:
        return f"fits {concurrency} × {_k(request.context_length)}"
    context = largest_context(model, request, fit, concurrency=1)
    return f"fits 1 × {_k(context)}" if context else "cannot hold one block of KV"


def largest_concurrency(model: ModelShape, request: Request, fit: Fit) -> int:
    """How many requests of the asked context the hardware holds at once."""
    per_request = request_bytes(model, request, tokens=request.context_length, tp=fit.count)
    return max(0, fit.kv_available_per_gpu // max(1, per_request))


def largest_context(model: ModelShape, request: Request, fit: Fit, *, concurrency: int) -> int:
    """The longest context (whole blocks, at most the model's) that `concurrency` requests get."""
    low, high = 0, model.max_context
    while low < high:
        middle = (low + high + 1) // 2
        needed = concurrency * request_bytes(model, request, tokens=middle, tp=fit.count)
        if needed <= fit.kv_available_per_gpu:
            low = middle
        else:
            high = middle - 1
    return low // request.block_tokens * request.block_tokens if low < model.max_context else low


def gb_text(value: int) -> str:
    return f"{value / GB:,.0f} GB" if value >= GB else f"{value / 1000**2:,.1f} MB"


def gib_text(value: int) -> str:
    return f"{value / GIB:,.1f} GiB" if value >= GIB / 10 else f"{value / 1024**2:,.1f} MiB"


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 and tokens >= 1024 else f"{tokens:,}"
