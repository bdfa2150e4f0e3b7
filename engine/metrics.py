"""Read a vLLM engine's Prometheus text (/metrics). Pure Python, no Django."""

from collections import defaultdict


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
