"""What the dashboard's pages show, as plain data: an endpoint's live status (progress, ETA,
replicas, events, its engine's last log lines), the wait of a request at zero, a GPU's memory
as bar segments, and the snippets that call an endpoint. Views and templates render these;
nothing here renders or reads a request."""

import json

from django.utils import timezone

from billing.selectors import tokens_by_adapter
from endpoints import selectors
from endpoints.models import Endpoint, Task
from endpoints.states import COMING_UP, ENDPOINT_AT_REST, State

LOG_LINES = 15
EVENTS_SHOWN = 20
SNIPPET_MAX_TOKENS = 64


def adapters(endpoint: Endpoint) -> list[dict[str, object]]:
    """Each LoRA adapter of the endpoint: what clients call it, where it came from, how many
    ready replicas serve it, and its last day's requests and tokens; the base model first,
    for comparison, when any adapter exists."""
    rows = list(selectors.adapters_of(endpoint=endpoint))
    if not rows:
        return []
    used = tokens_by_adapter(endpoint_id=endpoint.id)
    replicas = list(endpoint.replicas.all())
    nothing = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    shown: list[dict[str, object]] = [{"name": "", "model": endpoint.name, "base": True,
                                       **used.get("", nothing)}]
    for adapter in rows:
        source = (f"{adapter.hf_repo} @ {adapter.hf_commit[:12]}" if adapter.hf_repo
                  else f"upload, {adapter.size_bytes / 1024**2:.1f} MiB")
        shown.append({
            "name": adapter.name, "model": f"{endpoint.name}:{adapter.name}", "base": False,
            "source": source, "rank": adapter.rank, "targets": ", ".join(adapter.target_modules),
            "serving": adapter.serving(replicas),
            "replicas": sum(1 for replica in replicas if replica.state == State.READY),
            **used.get(adapter.name, nothing)})
    return shown


def model_names(endpoint: Endpoint) -> list[str]:
    """What clients call the endpoint: its name, then each adapter's `<endpoint>:<adapter>`."""
    return [endpoint.name, *(f"{endpoint.name}:{name}" for name in
                             selectors.adapters_of(endpoint=endpoint).values_list("name",
                                                                                  flat=True))]


def wake_seconds(endpoint: Endpoint) -> float | None:
    """For an endpoint scaled to zero: how long its next request will wait, from this model's
    recent starts on this kind of node; None otherwise or with no start to go by."""
    if endpoint.state != State.IDLE:
        return None
    return selectors.median_start_seconds(model_id=endpoint.model_id,
                                          gpu_type_id=endpoint.gpu_type_id)


def endpoint_status(endpoint: Endpoint) -> dict[str, object]:
    """State, progress, ETA, replicas, events and the leading engine's last log lines."""
    replicas = list(endpoint.replicas.all())
    progress = selectors.progress_of(endpoint=endpoint, replicas=replicas)
    starting = [replica for replica in replicas
                if replica.state in COMING_UP]
    leader = max(starting, key=lambda replica: replica.progress_percent, default=None)
    status: dict[str, object] = {
        "progress": progress, "replicas": [r for r in replicas if r.state != State.STOPPED][:20],
        "ready": sum(replica.state == State.READY for replica in replicas),
        "events": list(endpoint.events.order_by("-at", "-id")[:EVENTS_SHOWN]),
        "settled": endpoint.state in ENDPOINT_AT_REST,
        "kv_cache_tokens": next((replica.kv_cache_tokens for replica in replicas
                                 if replica.kv_cache_tokens), None),
        "wake_seconds": wake_seconds(endpoint),
    }
    if status["kv_cache_tokens"]:
        status["kv_cache_requests"] = status["kv_cache_tokens"] // endpoint.context_length
    logged = leader or next((replica for replica in replicas if replica.log_tail), None)
    if logged is not None:
        status["log_lines"] = "\n".join(logged.log_tail.splitlines()[-LOG_LINES:])
    if leader is not None:
        elapsed = (timezone.now() - leader.created_at).total_seconds()
        # Negative while its weights download: the start proper has not begun.
        started = (timezone.now() - selectors.start_counted_from(leader)).total_seconds()
        median = (selectors.median_start_seconds(model_id=endpoint.model_id,
                                                 gpu_type_id=endpoint.gpu_type_id))
        status.update(elapsed_seconds=round(elapsed), median_seconds=median)
        if median:
            status["eta_seconds"] = max(0, round(median - started))
            # Between stage changes the bar moves with time, capped below the next stage.
            by_time = min(95, round(100 * max(0.0, started) / median))
            status["progress"] = {**progress, "percent": max(progress["percent"], by_time)}
    return status


def snippets(name: str, gateway: str, task: str = Task.GENERATE) -> dict[str, str]:
    """How to call the endpoint `name` from curl and from Python, by its model's task."""
    if task == Task.EMBED:
        path, body = "/v1/embeddings", {"model": name, "input": ["Hello!", "Hi there."]}
        python = ("import os\n\nfrom openai import OpenAI\n\n"
                  f"client = OpenAI(base_url=\"{gateway}/v1\", "
                  "api_key=os.environ[\"KVRUN_API_KEY\"])\n"
                  f"answer = client.embeddings.create(model=\"{name}\", "
                  "input=[\"Hello!\", \"Hi there.\"])\n"
                  "print(len(answer.data[0].embedding), answer.usage.prompt_tokens)\n")
    elif task == Task.SCORE:
        path, body = "/v1/rerank", {"model": name, "query": "Hello!",
                                    "documents": ["Hi there.", "Goodbye."]}
        python = ("import os\n\nimport httpx\n\n"
                  f"answer = httpx.post(\"{gateway}/v1/rerank\", headers={{\"Authorization\": "
                  "f\"Bearer {os.environ['KVRUN_API_KEY']}\"}, json={\n"
                  f"    \"model\": \"{name}\", \"query\": \"Hello!\", "
                  "\"documents\": [\"Hi there.\", \"Goodbye.\"]})\n"
                  "for result in answer.json()[\"results\"]:\n"
                  "    print(result[\"relevance_score\"], result[\"document\"][\"text\"])\n")
    else:
        path, body = "/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": SNIPPET_MAX_TOKENS}
        python = ("import os\n\nfrom openai import OpenAI\n\n"
                  f"client = OpenAI(base_url=\"{gateway}/v1\", "
                  "api_key=os.environ[\"KVRUN_API_KEY\"])\n"
                  f"answer = client.chat.completions.create(\n    model=\"{name}\",\n"
                  "    messages=[{\"role\": \"user\", \"content\": \"Hello!\"}],\n"
                  f"    max_tokens={SNIPPET_MAX_TOKENS},\n)\n"
                  "print(answer.choices[0].message.content)\n")
    return {
        "curl": (f"curl {gateway}{path} \\\n"
                 f"  -H \"Authorization: Bearer $KVRUN_API_KEY\" \\\n"
                 f"  -H 'Content-Type: application/json' \\\n"
                 f"  -d '{json.dumps(body)}'"),
        "python": python,
    }


def memory_bar(summary: dict, device: int, *, task: str = Task.GENERATE
               ) -> list[dict[str, object]]:
    """One GPU's memory as bar segments: weights, LoRA adapters' slots (where it has any),
    the KV cache asked for (for a pooling model, what one batch holds), runtime, headroom."""
    weights = summary["weight_bytes_per_gpu"]
    adapters = summary.get("lora_bytes_per_gpu", 0)  # sized before adapters were served: 0
    kv = summary["kv_needed_bytes_per_gpu"]
    overhead = summary["runtime_overhead_bytes_per_gpu"]
    headroom = max(0, device - weights - adapters - kv - overhead)
    batch = "KV cache" if task == Task.GENERATE else "one batch"
    segments = (("weights", weights), ("LoRA adapters", adapters), (batch, kv),
                ("runtime", overhead), ("headroom", headroom))
    return [{"name": name, "bytes": value, "percent": round(100 * value / device, 1)}
            for name, value in segments if value or name != "LoRA adapters"]
