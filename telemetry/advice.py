"""Advice backed by an endpoint's measurements, with what each change would give by the
sizing model (endpoints.planning).

- cache-bound: the KV cache at least 90 % full in half the samples of the last ten minutes,
  or requests preempted. The changes, each with the concurrency it reaches: fp8 KV, another
  replica, a larger GPU, and a host tier only on GPU nodes whose prefix hit rate shows a
  working set larger than the device cache (offloading costs a few per cent of throughput
  where the working set fits: −1.5 to −2.6 % in llm-d's published runs).
- context oversized: over a day of at least MIN_REQUESTS requests, a context budget at least
  OVERSIZE × what a request takes: the 99th-percentile prompt plus the 99th-percentile
  max_tokens (the engine refuses a request whose prompt and max_tokens pass the context; one
  that asks none is given what its context leaves, so those keep the budget as it is). The
  change: a budget of that, and at least twice the prompt percentile, rounded up to a power
  of two, with what it frees, and the cheaper hardware it would fit.

An advice opens once (an event on the endpoint says so), is refreshed while its condition
holds, and resolves when it no longer does.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from endpoints import planning
from endpoints.models import MAX_REPLICAS_PER_ENDPOINT, Endpoint, EndpointEvent
from endpoints.scheduling import Placement
from engine.sizing import CPU
from telemetry import selectors
from telemetry.models import Advice, AdviceKind

CACHE_WINDOW = timedelta(minutes=10)
SUSTAINED_SHARE = 0.5
CONTEXT_WINDOW = timedelta(hours=24)
MIN_REQUESTS = 100
OVERSIZE = 4
HOST_TIER_GIB = 64  # the host tier proposed: a size most GPU hosts spare per replica
LOW_HIT_RATE = 0.5


@dataclass(frozen=True)
class Finding:
    kind: str
    message: str
    figures: dict
    change: dict


def findings(endpoint: Endpoint, *, now: datetime) -> list[Finding]:
    found = [_cache_bound(endpoint, now=now), _context_oversized(endpoint, now=now)]
    return [finding for finding in found if finding is not None]


def _window(endpoint: Endpoint, since: datetime, until: datetime) -> dict | None:
    _, points = selectors.series(endpoint_id=endpoint.id, since=since, until=until, steps=1)
    return points[0] if points else None


def _cache_bound(endpoint: Endpoint, *, now: datetime) -> Finding | None:
    window = _window(endpoint, now - CACHE_WINDOW, now)
    if window is None or ((window["kv_cache_high_share"] or 0) < SUSTAINED_SHARE
                          and not window["preemptions"]):
        return None
    held = endpoint.sizing.get("max_concurrency_at_context") or endpoint.concurrency
    context = endpoint.context_length
    ways, change = [], {}
    on_cpu = endpoint.gpu_type.slug == CPU
    if on_cpu:
        # A CPU engine's KV pool is exactly its budget: room comes from a larger budget.
        more = endpoint.concurrency * 2
        try:
            planning.plan(model=endpoint.model, context_length=context, concurrency=more,
                          kv_cache_dtype=endpoint.kv_cache_dtype, gpu_type=endpoint.gpu_type,
                          gpu_count=endpoint.gpu_count, placement=Placement.of(endpoint),
                          judge_placement=False)  # judged as the policy change it offers
        except ValidationError:
            pass
        else:
            ways.append(f"a budget of {more} concurrent requests: the engine's KV pool grows "
                        f"to {more * context:,} tokens of the node's memory (one click)")
            change = {"concurrency": more}
    elif endpoint.kv_cache_dtype == "auto":
        fp8 = planning.largest_concurrency_on(
            model=endpoint.model, context_length=context, kv_cache_dtype="fp8",
            gpu_type=endpoint.gpu_type, gpu_count=endpoint.gpu_count)
        ways.append(f"fp8 KV cache: room for {fp8:,} requests of {context:,} tokens at once "
                    f"per replica instead of {held:,}, on the same hardware (one click)")
        change = {"kv_cache_dtype": "fp8"}
    if endpoint.desired_replicas < min(endpoint.max_replicas, MAX_REPLICAS_PER_ENDPOINT):
        ways.append(f"another replica: {held * (endpoint.desired_replicas + 1):,} at once in all, "
                    f"for ${endpoint.hourly_price_usd:.2f}/h more")
    larger = next((option for option in planning.options(
        model=endpoint.model, context_length=context, kv_cache_dtype=endpoint.kv_cache_dtype,
        placement=Placement.of(endpoint))
        if option.max_concurrency > held and option.gpu_type.slug != CPU), None)
    if larger is not None and larger.gpu_type != endpoint.gpu_type:
        ways.append(f"{larger.gpu_count} × {larger.gpu_type.name}: {larger.max_concurrency:,} at "
                    f"once per replica, ${larger.hourly_price:.2f}/h (a new endpoint)")
    hit_rate = window["prefix_hit_rate"]
    if (not on_cpu and not endpoint.host_tier_gib and hit_rate is not None
            and hit_rate < LOW_HIT_RATE and _tier_fits(endpoint)):
        tokens = planning.plan(
            model=endpoint.model, context_length=context, concurrency=endpoint.concurrency,
            kv_cache_dtype=endpoint.kv_cache_dtype, gpu_type=endpoint.gpu_type,
            gpu_count=endpoint.gpu_count, host_tier_gib=HOST_TIER_GIB,
            placement=Placement.of(endpoint), judge_placement=False,
        ).summary["host_tier_tokens"]
        ways.append(f"a {HOST_TIER_GIB} GiB host tier: {tokens:,} more tokens of cached "
                    f"prefixes, as the hit rate of {hit_rate:.0%} says they do not fit")
    share = window["kv_cache_high_share"] or 0
    message = (f"Cache-bound: the KV cache was at least 90 % full in {share:.0%} of the last "
               f"{CACHE_WINDOW.seconds // 60} minutes' samples, with {window['preemptions']} "
               "preemption(s).")
    if ways:
        message += " To give it room: " + "; ".join(ways) + "."
    figures = {"kv_cache_high_share": round(share, 3), "preemptions": window["preemptions"],
               "prefix_hit_rate": hit_rate, "max_concurrency_at_context": held}
    return Finding(kind=AdviceKind.CACHE_BOUND, message=message, figures=figures, change=change)


def _context_oversized(endpoint: Endpoint, *, now: datetime) -> Finding | None:
    requests, p99, answer_p99 = selectors.served_over(
        endpoint_id=endpoint.id, since=now - CONTEXT_WINDOW, until=now)
    context = endpoint.context_length
    if requests < MIN_REQUESTS or not p99 or answer_p99 is None:
        return None
    needed = p99 + answer_p99
    if needed * OVERSIZE > context:
        return None
    suggested = 1 << max(9, int(max(2 * p99, needed) - 1).bit_length())
    if suggested >= context:
        return None
    fits = planning.largest_concurrency_on(
        model=endpoint.model, context_length=suggested, kv_cache_dtype=endpoint.kv_cache_dtype,
        gpu_type=endpoint.gpu_type, gpu_count=endpoint.gpu_count)
    message = (f"The context budget of {context:,} tokens is {context / needed:.0f} × what a "
               f"request takes: the 99th percentile prompt ({p99:,.0f} tokens) plus the 99th "
               f"percentile max_tokens ({answer_p99:,.0f}), over {requests:,} requests in 24 h. "
               f"At {suggested:,} tokens the same hardware holds {fits} requests at once "
               "(one click).")
    try:
        cheaper = planning.plan(model=endpoint.model, context_length=suggested,
                                concurrency=endpoint.concurrency,
                                kv_cache_dtype=endpoint.kv_cache_dtype,
                                placement=Placement.of(endpoint))
    except ValidationError:
        cheaper = None
    price = (Placement.of(endpoint).hourly_price(cheaper.gpu_type) * cheaper.gpu_count
             if cheaper else None)
    if price is not None and price < endpoint.hourly_price_usd:
        message += (f" Or, as a new endpoint, {cheaper.gpu_count} × {cheaper.gpu_type.name} at "
                    f"${price:.2f}/h instead of ${endpoint.hourly_price_usd:.2f}/h.")
    figures = {"prompt_tokens_p99": round(p99), "max_tokens_p99": round(answer_p99),
               "requests": requests, "context_length": context,
               "suggested_context_length": suggested, "max_concurrency_at_suggested": fits}
    return Finding(kind=AdviceKind.CONTEXT_OVERSIZED, message=message, figures=figures,
                   change={"context_length": suggested})


def do_advise_endpoint(*, endpoint: Endpoint, now: datetime) -> list[Advice]:
    """Open, refresh or resolve the endpoint's advice from its figures as of `now`; returns
    the advice open afterwards. Safe to run twice or from two workers: a second opening of
    the same kind finds the first (a partial unique constraint) and refreshes it."""
    found = {finding.kind: finding for finding in findings(endpoint, now=now)}
    Advice.objects.filter(endpoint=endpoint, resolved_at=None).exclude(
        kind__in=list(found)).update(resolved_at=now)
    for finding in found.values():
        fields = {"message": finding.message, "figures": finding.figures,
                  "change": finding.change, "last_seen_at": now}
        if Advice.objects.filter(endpoint=endpoint, kind=finding.kind,
                                 resolved_at=None).update(**fields):
            continue
        try:
            with transaction.atomic():
                Advice.objects.create(endpoint=endpoint, kind=finding.kind, opened_at=now,
                                      **fields)
                EndpointEvent.objects.create(endpoint=endpoint, state=endpoint.state,
                                             message=f"advice: {finding.message}")
        except IntegrityError:  # opened meanwhile by another run
            Advice.objects.filter(endpoint=endpoint, kind=finding.kind,
                                  resolved_at=None).update(**fields)
    return list(Advice.objects.filter(endpoint=endpoint, resolved_at=None))


def _tier_fits(endpoint: Endpoint) -> bool:
    """Whether a node online could give the endpoint's replicas the host tier advised."""
    try:
        planning.check_tiers(host_tier_gib=HOST_TIER_GIB, disk_tier_gib=endpoint.disk_tier_gib,
                             gpu_type=endpoint.gpu_type, gpu_count=endpoint.gpu_count,
                             placement=Placement.of(endpoint))
    except ValidationError:
        return False
    return True
