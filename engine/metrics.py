"""Read a vLLM engine's Prometheus text (/metrics). Pure Python, no Django."""

import re
from collections import defaultdict
from dataclasses import dataclass, field


def totals(text: str) -> dict[str, float]:
    """Each metric's samples summed over their labels, e.g. {"vllm:prompt_tokens_total": 12}."""
    sums: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        try:
            sums[name] += float(value)
        except ValueError:
            continue
    return dict(sums)


def engine_token_totals(text: str) -> dict[str, float]:
    """The prompt and generated tokens the engine has processed since it started."""
    found = totals(text)
    return {"prompt": found.get("vllm:prompt_tokens_total", 0.0),
            "generation": found.get("vllm:generation_tokens_total", 0.0)}


@dataclass(frozen=True)
class EngineSnapshot:
    """One reading of an engine's /metrics: gauges as they were, counters and histogram
    buckets as the cumulative totals the engine keeps since it started. A rate is the
    difference of two snapshots over their time apart, never one snapshot's totals."""

    kv_cache_usage: float  # the share of the KV cache's blocks in use, 0 to 1
    running: int
    waiting: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which found there
    external_queries: int | None  # the same for a KV connector's tier; None without one
    external_hits: int | None
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    requests: int  # finished
    ttft_buckets: dict[str, float] = field(default_factory=dict)  # le → cumulative count
    itl_buckets: dict[str, float] = field(default_factory=dict)
    prompt_buckets: dict[str, float] = field(default_factory=dict)  # prompt tokens a request
    # The max_tokens a request could generate (asked, or what its context left it).
    max_tokens_buckets: dict[str, float] = field(default_factory=dict)


# Past this no count of an engine's is real (2**53: where floats stop counting by one), and
# the database's bigint columns would refuse the sample.
LARGEST_COUNT = 2**53


def snapshot(text: str) -> EngineSnapshot:
    """The snapshot in an engine's Prometheus text (vLLM's V1 metric names). Raises
    ValueError on a value that cannot be a reading (negative, not finite, a usage above
    one), so that one engine's bad answer is left out rather than stored."""
    found = totals(text)

    def whole(name: str) -> int:
        return _count(name, found.get(name, 0.0))

    def count(name: str) -> int:
        return whole(f"vllm:{name}_total")

    usage = found.get("vllm:kv_cache_usage_perc", 0.0)
    if not 0 <= usage <= 1:
        raise ValueError(f"vllm:kv_cache_usage_perc is {usage}, not a share from 0 to 1")
    external = "vllm:external_prefix_cache_queries_total" in found
    return EngineSnapshot(
        kv_cache_usage=usage,
        running=whole("vllm:num_requests_running"),
        waiting=whole("vllm:num_requests_waiting"),
        prefix_queries=count("prefix_cache_queries"), prefix_hits=count("prefix_cache_hits"),
        external_queries=count("external_prefix_cache_queries") if external else None,
        external_hits=count("external_prefix_cache_hits") if external else None,
        preemptions=count("num_preemptions"), prompt_tokens=count("prompt_tokens"),
        generation_tokens=count("generation_tokens"), requests=count("request_success"),
        ttft_buckets=buckets(text, "vllm:time_to_first_token_seconds"),
        itl_buckets=buckets(text, "vllm:inter_token_latency_seconds"),
        prompt_buckets=buckets(text, "vllm:request_prompt_tokens"),
        max_tokens_buckets=buckets(text, "vllm:request_params_max_tokens"))


LE = re.compile(r'le="([^"]+)"')


def buckets(text: str, histogram: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts by upper bound (`le`), summed over its other
    labels."""
    found: dict[str, float] = defaultdict(float)
    prefix = histogram + "_bucket{"
    for line in text.splitlines():
        if line.startswith(prefix):
            series, _, value = line.rpartition(" ")
            bound = LE.search(series)
            if bound:
                found[bound.group(1)] += _count(histogram, float(value))
    return dict(found)


def _count(name: str, value: float) -> int:
    if not 0 <= value <= LARGEST_COUNT:  # NaN fails both
        raise ValueError(f"{name} is {value}, not a count")
    return int(value)


def quantile(q: float, counts: dict[str, float]) -> float | None:
    """The q-quantile of observations given as cumulative counts per bucket bound (the
    difference of two snapshots' buckets), interpolated within its bucket as Prometheus's
    histogram_quantile does; None without observations."""
    bounds = sorted(((float(le), value) for le, value in counts.items()), key=lambda b: b[0])
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in bounds:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower  # past the highest finite bound: that bound, as Prometheus does
            if cumulative == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower
