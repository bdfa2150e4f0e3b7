"""The offload self-test: once an engine with a KV tier serves, the same long prompt twice.
The tier must take the prompt's KV and the repeat must be faster; otherwise the verdict names
the likely cause, since offloading that silently does nothing is the common failure (LMCache
issues #419, #1109, #1741, #1938). Pure Python, no Django.

What the engine's /metrics can show differs by tier. vLLM's native host tier counts the bytes
it stores and loads. LMCache counts in its own process, not in vLLM's /metrics; what vLLM shows
of it is its connector's lookups (`external_prefix_cache_queries`) and hits. And with prefix
caching on, the repeat is served from the device's own prefix cache before any tier is asked,
so the tier's return path shows only with prefix caching off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.metrics import totals
from engine.tls import EngineAddress

TIER_PREFIXES = ("vllm:kv_offload_", "vllm:external_prefix_cache_")
PROMPT_TOKENS = 4096  # long enough to fill many blocks, short enough for any context
TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class Verdict:
    works: bool
    message: str
    figures: dict


def tier_counters(text: str) -> dict[str, float]:
    """The native tier's counters and the connector's external lookups in an engine's
    /metrics: counters only (`_total`), never their `_created` timestamps or gauges."""
    return {name: value for name, value in totals(text).items()
            if name.startswith(TIER_PREFIXES) and name.endswith("_total")}


def _moved(before: dict[str, float], after: dict[str, float], counter: str) -> float:
    name = f"vllm:{counter}_total"
    return after.get(name, 0.0) - before.get(name, 0.0)


def judge(*, before: dict[str, float], after_first: dict[str, float],
          after_second: dict[str, float], first_seconds: float, second_seconds: float,
          disk_tier: bool, prefix_caching: bool) -> Verdict:
    """The verdict on one self-test from the tier's counters around its two requests."""
    stored = _moved(before, after_first, "kv_offload_store_bytes")
    looked_up = _moved(before, after_first, "external_prefix_cache_queries")
    returned = (_moved(after_first, after_second, "kv_offload_load_bytes")
                + _moved(after_first, after_second, "external_prefix_cache_hits"))
    failures = _moved(before, after_second, "kv_offload_allocation_failure")
    figures = {"stored_bytes": stored, "looked_up_tokens": looked_up, "returned": returned,
               "allocation_failures": failures, "first_s": round(first_seconds, 3),
               "second_s": round(second_seconds, 3)}
    if not after_first:
        return Verdict(False, "KV tier self-test: the engine reports no offload counters, so "
                              "its connector is not running: the flags kvrun's table gives "
                              "this vLLM version may not map to the tier (version mapping).",
                       figures)
    if disk_tier and not looked_up:
        return Verdict(False, "KV tier self-test: the engine never asked its LMCache "
                              "connector for a long prompt: the connector kvrun's table names "
                              "may not be the one this vLLM version loads (version mapping).",
                       figures)
    if not disk_tier and (failures or not stored):
        return Verdict(False, "KV tier self-test: the tier stored nothing of a long "
                              "prompt" + (
                                  f" and refused {failures:.0f} allocation(s)" if failures
                                  else "") +
                       ": its pool may be too small for the blocks it is offered.", figures)
    if disk_tier and not prefix_caching and not returned:
        return Verdict(False, "KV tier self-test: LMCache gave none of a long prompt back on "
                              "its repeat: its processes may hash chunks differently "
                              "(PYTHONHASHSEED), or its pool may be too small.", figures)
    if second_seconds >= first_seconds:
        return Verdict(False, f"KV tier self-test: the repeat took {second_seconds:.2f} s, no "
                              f"faster than the first {first_seconds:.2f} s.", figures)
    took = (f"{stored / 2**20:,.1f} MiB stored" if not disk_tier
            else f"{looked_up:,.0f} tokens looked up in LMCache")
    served = ("; the device's prefix cache served the repeat, so the tier gives KV back only "
              "once the device has evicted it" if prefix_caching
              else f"; the tier gave back {returned:,.0f}" + (" tokens" if disk_tier
                                                               else " bytes"))
    return Verdict(True, f"KV tier self-test passed: {took}, the repeat {second_seconds:.2f} s "
                         f"against {first_seconds:.2f} s{served}.", figures)


def run(*, address: EngineAddress, model: str, disk_tier: bool, prefix_caching: bool,
        context_length: int) -> Verdict:
    """Send the prompt twice to a serving engine and judge (token ids: any tokenizer)."""
    prompt = [10 + n % 200 for n in range(min(PROMPT_TOKENS, context_length - 8))]
    with address.client(timeout=TIMEOUT_SECONDS) as client:
        def counters() -> dict[str, float]:
            return tier_counters(client.get("/metrics", timeout=10).text)

        def timed() -> float:
            started = time.monotonic()
            client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                 "max_tokens": 1}).raise_for_status()
            return time.monotonic() - started

        before = counters()
        first = timed()
        after_first = counters()
        second = timed()
        after_second = counters()
    return judge(before=before, after_first=after_first, after_second=after_second,
                 first_seconds=first, second_seconds=second, disk_tier=disk_tier,
                 prefix_caching=prefix_caching)
