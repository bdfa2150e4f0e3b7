"""The offload self-test: once an engine with a KV tier serves, the same long prompt twice.
The tier must take the prompt's KV (its store counters move) or give it back (its load
counters, or the connector's external hits), and the repeat must be faster; otherwise the
verdict names the likely cause, since offloading that silently does nothing is the common
failure (LMCache issues #419, #1109, #1741, #1938). Pure Python, no Django.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from engine.metrics import totals

TIER_PREFIXES = ("vllm:kv_offload_", "vllm:external_prefix_cache_", "lmcache:")
PROMPT_TOKENS = 4096  # long enough to fill many blocks, short enough for any context
TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class Verdict:
    works: bool
    message: str
    figures: dict


def tier_counters(text: str) -> dict[str, float]:
    """The tier's own counters and the connector's external lookups in an engine's /metrics."""
    return {name: value for name, value in totals(text).items()
            if name.startswith(TIER_PREFIXES)}


def _moved(before: dict[str, float], after: dict[str, float], *words: str) -> float:
    return sum(value - before.get(name, 0.0) for name, value in after.items()
               if any(word in name for word in words))


def judge(*, before: dict[str, float], after_first: dict[str, float],
          after_second: dict[str, float], first_seconds: float, second_seconds: float,
          disk_tier: bool) -> Verdict:
    """The verdict on one self-test from the counters around its two requests."""
    stored = _moved(before, after_first, "store_bytes", "stored")
    returned = (_moved(after_first, after_second, "load_bytes", "retrieved")
                + _moved(after_first, after_second, "external_prefix_cache_hits"))
    failures = _moved(before, after_second, "allocation_failure")
    figures = {"stored": stored, "returned": returned, "allocation_failures": failures,
               "first_s": round(first_seconds, 3), "second_s": round(second_seconds, 3)}
    if not after_first:
        return Verdict(False, "KV tier self-test: the engine reports no offload counters, so "
                              "its connector is not running: the flags kvrun's table gives "
                              "this vLLM version may not map to the tier (version mapping).",
                       figures)
    if failures or not stored:
        return Verdict(False, "KV tier self-test: the tier stored nothing of a long "
                              "prompt" + (
                                  f" and refused {failures:.0f} allocation(s)" if failures
                                  else "") +
                       ": its pool may be too small for the blocks it is offered.", figures)
    if disk_tier and not returned:
        return Verdict(False, "KV tier self-test: the tier stored the prompt but gave none of "
                              "it back on the repeat: LMCache's processes may hash chunks "
                              "differently (PYTHONHASHSEED).", figures)
    if second_seconds >= first_seconds:
        return Verdict(False, f"KV tier self-test: the repeat took {second_seconds:.2f} s, no "
                              f"faster than the first {first_seconds:.2f} s.", figures)
    return Verdict(True, f"KV tier self-test passed: {stored / 2**20:,.1f} MiB stored, the "
                         f"repeat {second_seconds:.2f} s against {first_seconds:.2f} s.",
                   figures)


def run(*, base_url: str, api_key: str, model: str, disk_tier: bool, context_length: int
        ) -> Verdict:
    """Send the prompt twice to a serving engine and judge (token ids: any tokenizer)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    prompt = [10 + n % 200 for n in range(min(PROMPT_TOKENS, context_length - 8))]

    def counters() -> dict[str, float]:
        return tier_counters(httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text)

    def timed() -> float:
        started = time.monotonic()
        httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=TIMEOUT_SECONDS,
                   json={"model": model, "prompt": prompt, "max_tokens": 1}).raise_for_status()
        return time.monotonic() - started

    before = counters()
    first = timed()
    after_first = counters()
    second = timed()
    return judge(before=before, after_first=after_first, after_second=counters(),
                 first_seconds=first, second_seconds=second, disk_tier=disk_tier)
