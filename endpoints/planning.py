"""Sizing for endpoints: the catalog's rows turned into engine.sizing's inputs and back.

`plan` picks (or checks) the hardware for an endpoint; when nothing online holds the request
it raises `Unfit`, whose advice fits the cause: weights that fit nothing online name the GPU
that would hold them and the models that do fit, while a KV cache that does not fit names the
largest concurrency and context that do. `options` lists the real alternatives: each GPU
type at the fewest GPUs that hold a request, with the concurrency it reaches and its price.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet

from endpoints.models import DEFAULT_CONTEXT_LENGTH, AttentionKind, GPUType, ModelSpec, NodeState
from endpoints.scheduling import Placement, largest_share
from endpoints.selectors import model_catalog
from engine import sizing, tasks
from engine.kv_policy import LMCACHE_LORA_REFUSAL, KVPolicy, refusals
from engine.lora import LoraShape
from engine.sizing import CPU, GPU

# How to bring a node of a missing kind online, in words a newcomer can follow.
ADD_NODE_ADVICE = ("start a node agent on a host with one (manage.py node_agent; "
                   "docs/operations.md, \"Adding a GPU node\" says how)")


def shape_of(model: ModelSpec) -> sizing.ModelShape:
    return sizing.ModelShape(
        name=model.name, parameters=model.parameters, layers=model.layers,
        attention_heads=model.attention_heads, kv_heads=model.kv_heads, head_dim=model.head_dim,
        max_context=model.max_context, attention_kind=model.attention_kind,
        kv_lora_rank=model.kv_lora_rank, qk_rope_head_dim=model.qk_rope_head_dim,
        sliding_window=model.sliding_window, sliding_window_layers=model.sliding_window_layers or 0,
        weights_bytes=model.weights_bytes, lora=lora_shape_of(model),
        pooling=model.task in tasks.POOLING, kv_cache=tasks.keeps_kv_cache(model.architecture),
        hidden_size=model.hidden_size, intermediate_size=model.intermediate_size or 0,
    )


def lora_shape_of(model: ModelSpec) -> LoraShape | None:
    """The dimensions LoRA adapters of `model` follow; None where its config did not state
    its MLP's width (a catalog row from before it was kept)."""
    if not model.intermediate_size:
        return None
    return LoraShape(layers=model.layers, hidden_size=model.hidden_size,
                     intermediate_size=model.intermediate_size,
                     attention_heads=model.attention_heads, kv_heads=model.kv_heads,
                     head_dim=model.head_dim, vocab_size=model.vocab_size)


def accelerator_of(gpu: GPUType, placement: Placement | None = None) -> sizing.Accelerator:
    """`gpu` as sizing reads it, at its price in `placement` (by default, the general price)."""
    # A CPU node's "device memory" is the RAM kvrun may give one engine.
    memory = settings.KVRUN_CPU_ENGINE_MEMORY_BYTES if gpu.slug == CPU else gpu.memory_bytes
    return sizing.Accelerator(slug=gpu.slug, name=gpu.name, memory_bytes=memory,
                              hourly_price=(placement or Placement()).hourly_price(gpu))


def weight_dtype_of(model: ModelSpec) -> str:
    if model.default_dtype in sizing.WEIGHT_BYTES_PER_PARAM:
        return model.default_dtype
    return "bfloat16"


def lora_refusal(model: ModelSpec) -> str | None:
    """Why endpoints of `model` cannot hold LoRA adapters, in words; None when they can."""
    if model.task in tasks.POOLING:
        return (f"{model.name} serves {model.get_task_display()}: kvrun serves LoRA adapters "
                "on models that generate.")
    if model.attention_kind == AttentionKind.MLA:
        return (f"{model.name} uses latent attention, whose LoRA layers kvrun cannot size yet; "
                "serve adapters on another model.")
    if model.active_parameters is not None:
        return (f"{model.name} is a mixture of experts, whose experts' LoRA layers kvrun "
                "cannot size yet; serve adapters on a dense model.")
    if lora_shape_of(model) is None:
        return (f"kvrun does not know {model.name}'s layer sizes, so it cannot size LoRA "
                "adapters for it; serve adapters on a model added from the hub, or ask an "
                "operator.")
    return None


def request_for(model: ModelSpec, *, context_length: int, concurrency: int, kv_cache_dtype: str,
                gpu: GPUType, lora_adapters: int = 0, lora_max_rank: int = 0
                ) -> sizing.Request:
    """What sizing evaluates on `gpu`: CPU engines use all of their memory and 128-token blocks."""
    is_cpu = gpu.slug == CPU
    return sizing.Request(
        context_length=context_length, concurrency=concurrency,
        weight_dtype=weight_dtype_of(model), kv_dtype=kv_cache_dtype,
        gpu_memory_utilization=1.0 if is_cpu else sizing.DEFAULT_GPU_MEMORY_UTILIZATION,
        block_tokens=sizing.CPU_BLOCK_TOKENS if is_cpu else sizing.GPU_BLOCK_TOKENS,
        lora_adapters=lora_adapters, lora_max_rank=lora_max_rank,
    )


def counts_for(gpu: GPUType) -> tuple[int, ...]:
    return (1,) if gpu.slug == CPU else sizing.TP_SIZES


@dataclass(frozen=True)
class Option:
    """One real hardware choice at the asked context: the fewest GPUs of a type that hold
    the weights and at least one request, and how many requests they hold at once."""

    gpu_type: GPUType
    gpu_count: int
    max_concurrency: int
    online: bool
    hourly_price: Decimal  # of all its GPUs


@dataclass(frozen=True)
class Plan:
    gpu_type: GPUType
    gpu_count: int
    summary: dict[str, Any]


@dataclass(frozen=True)
class Advice:
    """Why a request fits nothing online, and what would: the message for the field to
    change, plus the choices a page can offer as links."""

    field: str
    message: str
    cause: str  # "weights": the model fits nothing online; "kv_cache": its KV cache does not
    holder: Option | None = None  # the cheapest catalog hardware that holds the whole request
    fitting_models: list[ModelSpec] = field(default_factory=list)
    largest_concurrency: int = 0


class Unfit(ValidationError):
    """A request that fits no hardware on offer; `advice` says what would."""

    def __init__(self, advice: Advice) -> None:
        super().__init__({advice.field: [advice.message]})
        self.advice = advice


def online_gpu_types(placement: Placement) -> QuerySet[GPUType]:
    """Types of the nodes in `placement` that take new replicas: online and not draining."""
    nodes = placement.nodes("node__") & Q(node__state=NodeState.ONLINE, node__draining=False)
    return GPUType.objects.filter(nodes).distinct()


def online_gpu_type_ids(placement: Placement) -> set[int]:
    return set(online_gpu_types(placement).values_list("id", flat=True))


def placement_refusals(*, placement: Placement, gpu_type: GPUType | None
                       ) -> dict[str, list[str]]:
    """Why an endpoint cannot require `placement`'s region or its own nodes (on `gpu_type`,
    where chosen): nothing is online there, or not that type. Empty where it can (or
    requires neither)."""
    if placement.region is None and not placement.own_nodes_only:
        return {}
    field = "region" if placement.region is not None else "own_nodes_only"
    here = list(online_gpu_types(placement))
    if not here:
        other = ("choose another region, or none to run in any" if not placement.own_nodes_only
                 else "enrol one (docs/operations.md, \"Your organisation's own nodes\"), or "
                      "let it run on shared nodes too")
        return {field: [f"No node is online{placement.where()} now; {other}."]}
    if gpu_type is not None and gpu_type not in here:
        return {"gpu_type": [f"No {gpu_type.name} node is online{placement.where()}; there: "
                             + ", ".join(gpu.name for gpu in here) + "."]}
    return {}


def plan(*, model: ModelSpec, context_length: int, concurrency: int, kv_cache_dtype: str,
         gpu_type: GPUType | None = None, gpu_count: int | None = None,
         host_tier_gib: int = 0, disk_tier_gib: int = 0, lora_adapters: int = 0,
         lora_max_rank: int = 0, placement: Placement | None = None,
         judge_placement: bool = True) -> Plan:
    """The hardware for an endpoint, chosen or checked, with its KV policy admitted, priced
    and judged for `placement` (by default the shared fleet, anywhere): only what is online
    there. Raises ValidationError naming the field to change: a region (or own nodes) with
    nothing (or not the chosen type) online, a GPU count vLLM cannot split
    the model over, a KV tier the chosen hardware's vLLM build cannot use (saying why), or
    `Unfit` saying what would fit when the request fits nothing offered. `judge_placement`
    False (a policy change of an endpoint whose hardware is decided) prices for `placement`
    without asking that anything be online there now."""
    placement = placement or Placement()
    if judge_placement and (refused := placement_refusals(placement=placement,
                                                          gpu_type=gpu_type)):
        raise ValidationError(refused)
    candidates = _candidate_types(gpu_type, placement)
    if not candidates:
        raise ValidationError({"gpu_type": ["The GPU catalog is empty; an operator loads it "
                                            "with `python manage.py load_catalogs`."]})
    if lora_adapters and (refusal := lora_refusal(model)):
        raise ValidationError({"lora_adapters": [refusal]})
    if lora_adapters and disk_tier_gib:
        raise ValidationError({"disk_tier_gib": [LMCACHE_LORA_REFUSAL]})
    if gpu_count and not sizing.valid_tp(shape_of(model), gpu_count):
        raise ValidationError({"gpu_count": [
            f"{model.name} has {model.attention_heads} attention heads, which vLLM cannot split "
            f"over {gpu_count} GPUs; choose a count that divides {model.attention_heads}."]})
    is_cpu = [gpu.slug for gpu in candidates] == [CPU]
    request = request_for(model, context_length=context_length, concurrency=concurrency,
                          kv_cache_dtype=kv_cache_dtype, gpu=candidates[0],
                          lora_adapters=lora_adapters, lora_max_rank=lora_max_rank)
    counts = (1,) if is_cpu else ((gpu_count,) if gpu_count else sizing.TP_SIZES)
    by_slug = {gpu.slug: gpu for gpu in candidates}
    decision = sizing.choose(shape_of(model), request,
                             [accelerator_of(gpu, placement) for gpu in candidates], counts)
    if decision.choice is None:
        raise Unfit(_advice(model, request, candidates, gpu_type=gpu_type, gpu_count=gpu_count,
                            placement=placement))
    choice = decision.choice
    chosen = by_slug[choice.accelerator.slug]
    policy = KVPolicy(kv_cache_dtype=kv_cache_dtype, host_tier_gib=host_tier_gib,
                      disk_tier_gib=disk_tier_gib)
    refused = refusals(policy, device=CPU if chosen.slug == CPU else GPU)
    if refused:
        raise ValidationError({field: [f"{reason} (the plan: {choice.count} × {chosen.name})"]
                               for field, reason in refused.items()})
    return Plan(gpu_type=chosen, gpu_count=choice.count,
                summary=_summary(model, request, decision, is_cpu, policy, placement))


def check_tiers(*, host_tier_gib: int, disk_tier_gib: int, gpu_type: GPUType, gpu_count: int,
                placement: Placement) -> None:
    """Raise ValidationError, saying the most there is, where KV tiers are more than any
    node online in `placement` gives a replica on `gpu_count` of `gpu_type`: its GPUs' share of
    a node's host memory and disk. Nothing is judged where no such node is online."""
    largest = largest_share(gpu_type=gpu_type, gpu_count=gpu_count, placement=placement)
    if largest is None:
        return
    found = {}
    if host_tier_gib * sizing.GIB > largest.host_bytes:
        found["host_tier_gib"] = [
            f"A host tier of {host_tier_gib} GiB is more than any node gives a replica on "
            f"{gpu_count} × {gpu_type.name}: at most {largest.host_bytes // sizing.GIB} GiB, "
            "their share of a node's host memory."]
    if disk_tier_gib * sizing.GIB > largest.disk_bytes:
        found["disk_tier_gib"] = [
            f"A disk tier of {disk_tier_gib} GiB is more than any node gives a replica on "
            f"{gpu_count} × {gpu_type.name}: at most {largest.disk_bytes // sizing.GIB} GiB, "
            "their share of a node's disk beside its model cache."]
    if found:
        raise ValidationError(found)


def options(*, model: ModelSpec, context_length: int, kv_cache_dtype: str,
            placement: Placement | None = None) -> list[Option]:
    """Every catalog GPU type (the CPU only where a CPU node is online) at the fewest GPUs
    that hold one request of `context_length`, cheapest first, priced and online in `placement`
    (by default, the shared fleet anywhere)."""
    placement = placement or Placement()
    online = online_gpu_type_ids(placement)
    shape = shape_of(model)
    found = []
    for gpu in GPUType.objects.all():
        if gpu.slug == CPU and gpu.id not in online:
            continue
        request = request_for(model, context_length=context_length, concurrency=1,
                              kv_cache_dtype=kv_cache_dtype, gpu=gpu)
        for count in counts_for(gpu):
            if not sizing.valid_tp(shape, count):
                continue
            fit = sizing.evaluate(shape, request, accelerator_of(gpu, placement), count)
            if fit.fits:
                found.append(Option(gpu_type=gpu, gpu_count=count, online=gpu.id in online,
                                    hourly_price=placement.hourly_price(gpu) * count,
                                    max_concurrency=sizing.largest_concurrency(shape, request,
                                                                               fit)))
                break
    return sorted(found, key=lambda option: (option.hourly_price, -option.max_concurrency))


def _candidate_types(gpu_type: GPUType | None, placement: Placement) -> list[GPUType]:
    """The asked type; else the types on online nodes in `placement`; else every GPU type in
    the catalog."""
    if gpu_type is not None:
        return [gpu_type]
    present = list(online_gpu_types(placement))
    gpus = [gpu for gpu in present if gpu.slug != CPU]
    if gpus:
        return gpus
    if present:
        return present
    return list(GPUType.objects.exclude(slug=CPU))


def _advice(model: ModelSpec, request: sizing.Request, candidates: list[GPUType], *,
            gpu_type: GPUType | None, gpu_count: int | None, placement: Placement) -> Advice:
    shape = shape_of(model)
    weights = sizing.weight_bytes(shape, request.weight_dtype)
    holder = _cheapest_holder(model, request, placement)
    holder_text = _holder_text(holder, request)
    # What the asked hardware holds: at the asked count where there is one.
    fits = [sizing.evaluate(shape, request, accelerator_of(gpu, placement), count)
            for gpu in candidates for count in counts_for(gpu)
            if sizing.valid_tp(shape, count) and gpu_count in (None, count)]
    best = max(fits, key=lambda fit: sizing.largest_concurrency(shape, request, fit)
               if fit.kv_available_per_gpu > 0 else -1, default=None)
    where = (gpu_type.name if gpu_type else "any GPU in the catalog"
             if not online_gpu_type_ids(placement) else "the hardware online (" + ", ".join(
                 f"{gpu.name}: {sizing.gib_text(accelerator_of(gpu).memory_bytes)} per "
                 f"{'engine' if gpu.slug == CPU else 'GPU'}" for gpu in candidates) + ")")
    if best is None or sizing.largest_context(shape, request, best,
                                              concurrency=1) < request.block_tokens:
        # The weights (with one block of KV) fit nothing: no knob but the hardware helps,
        # or another model of the same task.
        fitting = models_that_fit_online(models=model_catalog().filter(task=model.task),
                                         context_length=request.context_length,
                                         concurrency=request.concurrency,
                                         kv_cache_dtype=request.kv_dtype, placement=placement)
        message = (f"{model.name}'s weights need {sizing.gb_text(weights)} "
                   f"({request.weight_dtype}), more than {where} can hold. {holder_text}")
        if fitting:
            message += " Models that fit what is online: " + ", ".join(
                m.name for m in fitting[:6]) + "."
        return Advice(field="gpu_type" if gpu_type else "model", message=message,
                      cause="weights", holder=holder, fitting_models=fitting)
    most = sizing.largest_concurrency(shape, request, best)
    longest = sizing.largest_context(shape, request, best, concurrency=request.concurrency)
    ways = []
    if most >= 1:
        ways.append(f"lower the concurrency to {most}")
    if longest >= request.block_tokens:
        ways.append(f"lower the context length to {longest:,} tokens")
    if request.kv_dtype == "auto":
        fp8 = fp8_request(request)
        fp8_most = sizing.largest_concurrency(
            shape, fp8, sizing.evaluate(shape, fp8, best.accelerator, best.count))
        if fp8_most > most:
            ways.append(f"use fp8 KV cache ({fp8_most} requests at this context)")
    left = max(0, best.kv_available_per_gpu)
    message = (f"{request.concurrency} requests × {request.context_length:,} tokens need "
               f"{sizing.gib_text(best.kv_needed_per_gpu)} of KV cache per GPU; {best.count} × "
               f"{best.accelerator.name} has {sizing.gib_text(left)} left after the weights "
               f"and runtime, which holds {most} at this context.")
    if ways:
        message += " " + _sentence("To fit, " + _either(ways))
    else:
        tokens = left // sizing.kv_bytes_per_token(shape, kv_dtype=request.kv_dtype,
                                                   tp=best.count)
        message += (f" That is room for about {tokens:,} tokens in all: too little to serve "
                    "this model here.")
    message += " " + holder_text
    return Advice(field="gpu_type" if gpu_type else "concurrency", message=message,
                  cause="kv_cache", holder=holder, largest_concurrency=most)


def fp8_request(request: sizing.Request) -> sizing.Request:
    return sizing.Request(**{**request.__dict__, "kv_dtype": "fp8"})


def largest_concurrency_on(*, model: ModelSpec, context_length: int, kv_cache_dtype: str,
                           gpu_type: GPUType, gpu_count: int) -> int:
    """How many requests of `context_length` the given hardware holds at once."""
    shape = shape_of(model)
    request = request_for(model, context_length=context_length, concurrency=1,
                          kv_cache_dtype=kv_cache_dtype, gpu=gpu_type)
    return sizing.largest_concurrency(
        shape, request, sizing.evaluate(shape, request, accelerator_of(gpu_type), gpu_count))


def _cheapest_holder(model: ModelSpec, request: sizing.Request,
                     placement: Placement) -> Option | None:
    """The cheapest GPUs in the whole catalog that hold the request, online in `placement` or
    not."""
    gpus = {gpu.slug: gpu for gpu in GPUType.objects.exclude(slug=CPU)}
    if not gpus:
        return None
    shape = shape_of(model)
    on_gpu = request_for(model, context_length=request.context_length,
                         concurrency=request.concurrency, kv_cache_dtype=request.kv_dtype,
                         gpu=next(iter(gpus.values())))
    choice = sizing.choose(shape, on_gpu,
                           [accelerator_of(gpu, placement) for gpu in gpus.values()]).choice
    if choice is None:
        return None
    gpu = gpus[choice.accelerator.slug]
    return Option(gpu_type=gpu, gpu_count=choice.count,
                  online=gpu.id in online_gpu_type_ids(placement),
                  hourly_price=placement.hourly_price(gpu) * choice.count,
                  max_concurrency=sizing.largest_concurrency(shape, on_gpu, choice))


def _holder_text(holder: Option | None, request: sizing.Request) -> str:
    if holder is None:
        return "No GPU in the catalog holds this request; lower the context or the concurrency."
    text = (f"{holder.gpu_count} × {holder.gpu_type.name} (${holder.hourly_price:.2f}/h) would "
            f"hold the weights and the KV cache for {request.concurrency} × "
            f"{request.context_length:,} tokens")
    if holder.online:
        return _sentence(text + "; pick it as the GPU type")
    return _sentence(f"{text}, but no {holder.gpu_type.name} node is online: {ADD_NODE_ADVICE}")


def models_that_fit_online(*, models: Iterable[ModelSpec], context_length: int,
                           concurrency: int, kv_cache_dtype: str,
                           placement: Placement | None = None) -> list[ModelSpec]:
    """Those of `models` that online hardware in `placement` (by default, the shared fleet)
    holds at this concurrency (at their own maximum context where the asked one is
    longer)."""
    online = list(online_gpu_types(placement or Placement()))
    fitting = []
    for model in models:
        shape = shape_of(model)
        for gpu in online:
            asked = request_for(model, context_length=min(context_length, model.max_context),
                                concurrency=concurrency, kv_cache_dtype=kv_cache_dtype, gpu=gpu)
            if any(sizing.evaluate(shape, asked, accelerator_of(gpu), count).fits
                   for count in counts_for(gpu) if sizing.valid_tp(shape, count)):
                fitting.append(model)
                break
    return fitting


def _summary(model: ModelSpec, request: sizing.Request, decision: sizing.Decision,
             is_cpu: bool, policy: KVPolicy, placement: Placement) -> dict[str, Any]:
    choice = decision.choice
    shape = shape_of(model)
    per_token = sizing.kv_bytes_per_token(shape, kv_dtype=request.kv_dtype, tp=choice.count)
    # A host tier's size is the whole replica's, over all its ranks (vLLM's
    # --kv-offloading-size); LMCache's disk tier likewise.
    per_token_all_ranks = per_token * choice.count
    # A CPU engine's KV pool is exactly what its policy needs (the concurrency at the
    # context, in whole blocks): host memory is shared by the node's engines. A GPU engine
    # gets what is left of its own devices after the weights and the runtime.
    kv_pool_bytes = choice.kv_needed_per_gpu if is_cpu else choice.kv_available_per_gpu
    return {
        "explanation": decision.explanation,
        "gpu_type": choice.accelerator.slug,
        "gpu_count": choice.count,
        "hourly_price_usd": str(choice.hourly_price),
        "weight_bytes_per_gpu": choice.weight_bytes_per_gpu,
        "kv_bytes_per_token": per_token,
        "kv_needed_bytes_per_gpu": choice.kv_needed_per_gpu,
        "kv_available_bytes_per_gpu": choice.kv_available_per_gpu,
        "runtime_overhead_bytes_per_gpu": choice.overhead_bytes_per_gpu,
        "lora_bytes_per_gpu": choice.lora_bytes_per_gpu,
        "block_tokens": request.block_tokens,
        "kv_cache_tokens": kv_pool_bytes // per_token,
        "host_tier_gib": policy.host_tier_gib,
        "host_tier_tokens": policy.host_tier_gib * sizing.GIB // per_token_all_ranks,
        "disk_tier_gib": policy.disk_tier_gib,
        "disk_tier_tokens": policy.disk_tier_gib * sizing.GIB // per_token_all_ranks,
        "max_concurrency_at_context": sizing.largest_concurrency(shape, request, choice),
        "max_context_at_concurrency": sizing.largest_context(
            shape, request, choice, concurrency=request.concurrency),
        "cpu_kv_cache_bytes": kv_pool_bytes if is_cpu else None,
        "alternatives": _alternatives(model, request, choice, placement),
    }


def _alternatives(model: ModelSpec, request: sizing.Request, choice: sizing.Fit,
                  placement: Placement) -> list[dict[str, Any]]:
    """Other GPU types worth a look: the nearest cheaper ones (at a lower concurrency) and
    the nearest pricier ones that hold more; never the chosen type at a higher count."""
    shape = shape_of(model)
    chosen = sizing.largest_concurrency(shape, request, choice)
    others = [option for option in options(model=model, context_length=request.context_length,
                                           kv_cache_dtype=request.kv_dtype, placement=placement)
              if option.gpu_type.slug != choice.accelerator.slug]
    cheaper = [option for option in others if option.hourly_price < choice.hourly_price][-2:]
    larger = [option for option in others if option.hourly_price > choice.hourly_price
              and option.max_concurrency > chosen][:2]
    return [{"gpu_type": option.gpu_type.slug, "gpu_count": option.gpu_count,
             "hourly_price_usd": str(option.hourly_price),
             "max_concurrency_at_context": option.max_concurrency, "online": option.online}
            for option in cheaper + larger]


def _either(ways: list[str]) -> str:
    return ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + ", or " + ways[-1]


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def sizing_preview(model: ModelSpec) -> dict[str, Any]:
    """What `model` needs at its default context (or its longest, if shorter) for one
    request: the plan's summary, or `{"refused": why}` where nothing offered holds it."""
    try:
        return plan(model=model, context_length=min(DEFAULT_CONTEXT_LENGTH, model.max_context),
                    concurrency=1, kv_cache_dtype="auto").summary
    except ValidationError as exc:
        return {"refused": " ".join(exc.messages)}
