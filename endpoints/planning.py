"""Sizing for endpoints: the catalog's rows turned into engine.sizing's inputs and back."""

import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError

from endpoints.models import GPUType, ModelSpec, NodeState
from engine import sizing
from engine.sizing import CPU


def shape_of(model: ModelSpec) -> sizing.ModelShape:
    return sizing.ModelShape(
        name=model.name, parameters=model.parameters, layers=model.layers,
        attention_heads=model.attention_heads, kv_heads=model.kv_heads, head_dim=model.head_dim,
        max_context=model.max_context, attention_kind=model.attention_kind,
        kv_lora_rank=model.kv_lora_rank, qk_rope_head_dim=model.qk_rope_head_dim,
        sliding_window=model.sliding_window, sliding_window_layers=model.sliding_window_layers or 0,
    )


def accelerator_of(gpu: GPUType) -> sizing.Accelerator:
    # A CPU node's "device memory" is the RAM kvrun may give one engine.
    memory = settings.KVRUN_CPU_ENGINE_MEMORY_BYTES if gpu.slug == CPU else gpu.memory_bytes
    return sizing.Accelerator(slug=gpu.slug, name=gpu.name, memory_bytes=memory,
                              hourly_price=gpu.hourly_price_usd)


def weight_dtype_of(model: ModelSpec) -> str:
    return model.default_dtype if model.default_dtype in sizing.WEIGHT_BYTES_PER_PARAM else "bfloat16"


@dataclass(frozen=True)
class Plan:
    gpu_type: GPUType
    gpu_count: int
    summary: dict[str, Any]


def plan(*, model: ModelSpec, context_length: int, concurrency: int, kv_cache_dtype: str,
         gpu_type: GPUType | None = None, gpu_count: int | None = None) -> Plan:
    """The hardware for an endpoint, chosen or checked. Raises ValidationError saying what
    would fit when the request fits nothing offered."""
    candidates = _candidate_types(gpu_type)
    is_cpu = [gpu.slug for gpu in candidates] == [CPU]
    request = sizing.Request(
        context_length=context_length, concurrency=concurrency,
        weight_dtype=weight_dtype_of(model), kv_dtype=kv_cache_dtype,
        gpu_memory_utilization=1.0 if is_cpu else sizing.DEFAULT_GPU_MEMORY_UTILIZATION,
        block_tokens=sizing.CPU_BLOCK_TOKENS if is_cpu else sizing.GPU_BLOCK_TOKENS,
    )
    counts = (1,) if is_cpu else ((gpu_count,) if gpu_count else sizing.TP_SIZES)
    if gpu_count and not sizing.valid_tp(shape_of(model), gpu_count):
        raise ValidationError({"gpu_count": [
            f"{model.name} has {model.attention_heads} attention heads, which vLLM cannot split "
            f"over {gpu_count} GPUs; choose a count that divides {model.attention_heads}."]})
    by_slug = {gpu.slug: gpu for gpu in candidates}
    decision = sizing.choose(shape_of(model), request,
                             [accelerator_of(gpu) for gpu in candidates], counts)
    if decision.choice is None:
        field = "gpu_type" if gpu_type else "concurrency"
        raise ValidationError({field: [decision.explanation + " Lower the context length or "
                                       "the concurrency, use fp8 KV cache, or pick more GPUs."]})
    choice = decision.choice
    return Plan(gpu_type=by_slug[choice.accelerator.slug], gpu_count=choice.count,
                summary=_summary(model, request, decision, is_cpu))


def _candidate_types(gpu_type: GPUType | None) -> list[GPUType]:
    """The asked type; else the types on online nodes; else every GPU type in the catalog."""
    if gpu_type is not None:
        return [gpu_type]
    present = list(GPUType.objects.filter(node__state=NodeState.ONLINE).distinct())
    gpus = [gpu for gpu in present if gpu.slug != CPU]
    if gpus:
        return gpus
    if present:
        return present
    return list(GPUType.objects.exclude(slug=CPU))


def _summary(model: ModelSpec, request: sizing.Request, decision: sizing.Decision,
             is_cpu: bool) -> dict[str, Any]:
    choice = decision.choice
    shape = shape_of(model)
    return {
        "explanation": decision.explanation,
        "gpu_type": choice.accelerator.slug,
        "gpu_count": choice.count,
        "hourly_price_usd": str(choice.hourly_price),
        "weight_bytes_per_gpu": choice.weight_bytes_per_gpu,
        "kv_bytes_per_token": sizing.kv_bytes_per_token(shape, kv_dtype=request.kv_dtype,
                                                        tp=choice.count),
        "kv_needed_bytes_per_gpu": choice.kv_needed_per_gpu,
        "kv_available_bytes_per_gpu": choice.kv_available_per_gpu,
        "runtime_overhead_bytes_per_gpu": choice.overhead_bytes_per_gpu,
        "block_tokens": request.block_tokens,
        "max_concurrency_at_context": sizing.largest_concurrency(shape, request, choice),
        "max_context_at_concurrency": sizing.largest_context(
            shape, request, choice, concurrency=request.concurrency),
        "cpu_kv_space_gib": max(1, math.ceil(choice.kv_needed_per_gpu / sizing.GIB))
        if is_cpu else None,
        "alternatives": [
            {"gpu_type": fit.accelerator.slug, "gpu_count": fit.count,
             "hourly_price_usd": str(fit.hourly_price)} for fit in decision.alternatives
        ],
    }

