"""`make bench` target `models`: models from a hub, side by side in one run.

Against the hub on loopback (bench/hub_server.py), with a control worker and a node agent:
  download  kvrun's model cache fetching a ~1 GiB repository (resumable, every file checked
            against the hub's SHA-256) against a plain download of the same files from the
            same server at 4 Gbit/s, alternating rounds: the ratio of medians;
  sizing    the demo model added by its hub id: kvrun's figures from the hub's metadata
            against the same checkpoint read locally, and against the KV capacity the
            engine logs once it runs;
  starts    the first start downloads; each later one starts from the node's cache: the
            bytes the hub sent for them, and kvrun's own time to ready over the engine's
            own start, in-run (engine starts vary too much between runs for a ratio);
  adapters  an endpoint with LoRA slots, through a web process's gateway: the time from
            adding an adapter (from the hub) to its first answer on the running endpoint;
            completion tokens per second with four adapters interleaved against the base
            model alone on the same engine, alternating rounds (a ratio of medians); and
            whether the usage records per adapter equal the requests sent to it.
Writes bench/results/models.json.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402

from accounts.models import Organization, Role  # noqa: E402
from bench import seed  # noqa: E402
from bench.hub_server import Hub  # noqa: E402
from bench.provision import delete_and_settle, kvrun_start, start_processes  # noqa: E402
from bench.record import Figure, Goal, print_goals, write  # noqa: E402
from billing.ingestion import do_ingest_usage  # noqa: E402
from billing.models import UsageRecord  # noqa: E402
from endpoints.models import Endpoint, ModelSpec, Node, State  # noqa: E402
from endpoints.planning import plan  # noqa: E402
from endpoints.policies import EndpointPolicy  # noqa: E402
from endpoints.services import (  # noqa: E402
    do_add_adapter_from_hub,
    do_add_model_from_hub,
    do_create_endpoint,
    do_load_catalogs,
)
from engine import demo_model, hf_checkpoint, hub, lora  # noqa: E402
from engine.model_cache import ModelCache  # noqa: E402
from engine.sizing import CPU  # noqa: E402

GOALS = [
    Goal("sizing_error_pct", "KV tokens: hub metadata, local checkpoint and vLLM's log",
         at_most=0, unit="%"),
    Goal("download_ratio", "kvrun's fetch / a plain download of the same files", at_most=1.25),
    Goal("cached_start_bytes", "bytes downloaded by starts from the node's cache", at_most=0,
         unit="B"),
    Goal("cached_start_overhead_s", "kvrun's own time to ready from cached weights, in-run",
         below=2, unit="s"),
    Goal("adapter_records_exact", "usage records per adapter equal the requests sent to it",
         at_least=True),
]
SHOWN = [
    Figure("repository_bytes", "the downloaded repository", "B"),
    Figure("plain_download_s", "plain download, median", "s"),
    Figure("kvrun_fetch_s", "kvrun's fetch, checked, median", "s"),
    Figure("kv_tokens_hub", "KV tokens sized from the hub's metadata"),
    Figure("kv_tokens_local", "KV tokens sized from the local checkpoint"),
    Figure("kv_tokens_logged", "KV tokens vLLM logged"),
    Figure("first_start_s", "first start, downloading included", "s"),
    Figure("cached_start_s", "start from the node's cache, median", "s"),
    Figure("adapter_ready_s", "an adapter added to a running endpoint, to its first answer, "
                              "median", "s"),
    Figure("adapter_tps_ratio", "tokens/s, 4 adapters interleaved / the base model alone"),
]
ADAPTERS = 4
HUB_BYTES_PER_SECOND = 500e6  # 4 Gbit/s: a node's fast link to the hub or its mirror
ADAPTER_REQUESTS, ADAPTER_TOKENS = 16, 64  # per round, 4 at a time
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
SHARDS, SHARD_BYTES = 4, 256 * 2**20
CONTEXT_LENGTH, CONCURRENCY = 2048, 4


def big_repository(folder: Path) -> Path:
    """~1 GiB in four shards: what the download comparison fetches (never loaded)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    for index in range(1, SHARDS + 1):
        with open(folder / f"model-{index:05d}-of-{SHARDS:05d}.safetensors", "wb") as out:
            for _ in range(SHARD_BYTES // 2**20):
                out.write(os.urandom(2**20))
    return folder


def plain_download(url: str, files: list[hub.HubFile], into: Path) -> float:
    """The same files from the same server with a streaming GET each, nothing checked."""
    started = time.monotonic()
    with httpx.Client(timeout=60) as client:
        for file in files:
            with client.stream("GET", f"{url}/bench/big/resolve/main/{file.path}") as answer, \
                    open(into / file.path.replace("/", "_"), "wb") as out:
                for chunk in answer.iter_bytes(2**20):
                    out.write(chunk)
    return time.monotonic() - started


def kvrun_fetch(url: str, commit: str, files: list[hub.HubFile], into: Path) -> float:
    started = time.monotonic()
    ModelCache(into, budget_bytes=2 * SHARDS * SHARD_BYTES).fetch(
        endpoint=url, repo_id="bench/big", commit=commit, files=files, token=None)
    return time.monotonic() - started


def main() -> int:
    scratch = Path(tempfile.mkdtemp(prefix="bench-models-", dir=settings.KVRUN_STATE_DIR))
    served = Hub(scratch / "hub").start()
    settings.KVRUN_HUB_URL = os.environ["KVRUN_HUB_URL"] = served.url  # the agent's too
    try:
        return measure(served, scratch)
    finally:
        served.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def measure(served: Hub, scratch: Path) -> int:
    commit = served.publish("bench/big", big_repository(scratch / "big"))
    files = list(hub.pin(endpoint=served.url, repo_id="bench/big")[1])
    plain: list[float] = []
    fetched: list[float] = []
    # At a network's rate: from loopback on two cores, with the hub in this process, the
    # download takes every core and the check has none to overlap with, which a node
    # fetching over a network has.
    served.rate_bytes_per_second = HUB_BYTES_PER_SECOND
    for round_number in range(ROUNDS):
        rounds = scratch / f"round-{round_number}"
        (rounds / "plain").mkdir(parents=True)
        # Each goes first in turn: the second writes while the page cache flushes the first.
        for kind in ("plain", "kvrun")[::1 if round_number % 2 == 0 else -1]:
            if kind == "plain":
                plain.append(plain_download(served.url, files, rounds / "plain"))
            else:
                fetched.append(kvrun_fetch(served.url, commit, files, rounds / "kvrun"))
        shutil.rmtree(rounds)
        print(f"round {round_number + 1}: plain {plain[-1]:.2f} s, kvrun {fetched[-1]:.2f} s",
              flush=True)
    served.rate_bytes_per_second = None

    do_load_catalogs()
    demo = demo_model.build(scratch / "demo")
    served.publish("bench/demo", demo)
    owner = seed.owner()
    organization = seed.organization("bench", owned_by=owner)
    children, web = start_processes(Path(settings.KVRUN_STATE_DIR) / "bench-logs")
    try:
        deadline = time.monotonic() + 300
        while not Node.objects.filter(name="bench-node").exclude(architectures=[]).exists():
            assert time.monotonic() < deadline, "the node never reported its vLLM build"
            time.sleep(0.5)
        model = do_add_model_from_hub(organization=organization, actor_role=Role.OWNER,
                                      added_by=owner, repo_id="bench/demo")
        sized = plan(model=model, context_length=CONTEXT_LENGTH, concurrency=CONCURRENCY,
                     kv_cache_dtype="auto").summary
        # The same checkpoint as `manage.py import_model` reads it from a folder, unsaved.
        local = ModelSpec(**{**hf_checkpoint.describe(demo), "licence": "unknown"})
        kv_tokens_local = plan(model=local, context_length=CONTEXT_LENGTH,
                               concurrency=CONCURRENCY, kv_cache_dtype="auto"
                               ).summary["kv_cache_tokens"]
        first, _, logged, _ = kvrun_start(organization, model, "bench-first")
        cached, own, sent = [], [], 0
        for round_number in range(ROUNDS):
            before = served.bytes_sent
            elapsed, engine_own, _, _ = kvrun_start(organization, model, f"bench-{round_number}")
            sent += served.bytes_sent - before
            cached.append(elapsed)
            own.append(engine_own)
            print(f"start {round_number + 1} from the cache: {elapsed:.2f} s "
                  f"(engine itself {engine_own:.2f} s)", flush=True)
        adapters = measure_adapters(served, organization, model, scratch, web)
    finally:
        for child in children:
            child.terminate()
            child.wait(30)
    assert sized["gpu_type"] == CPU
    predicted = sized["kv_cache_tokens"]
    worst = max(abs(predicted - logged), abs(predicted - kv_tokens_local))
    result = {
        "rounds": ROUNDS,
        "repository_bytes": sum(f.size for f in files),
        "plain_download_s": round(statistics.median(plain), 3),
        "kvrun_fetch_s": round(statistics.median(fetched), 3),
        "download_ratio": round(statistics.median(fetched) / statistics.median(plain), 3),
        "kv_tokens_hub": predicted,
        "kv_tokens_local": kv_tokens_local,
        "kv_tokens_logged": logged,
        "sizing_error_pct": round(worst / logged * 100, 4),
        "first_start_s": round(first, 3),
        "cached_start_s": round(statistics.median(cached), 3),
        "cached_start_bytes": sent,
        "cached_start_overhead_s": round(statistics.median(
            t - e for t, e in zip(cached, own, strict=True)), 3),
        **adapters,
        "plain_runs_s": [round(x, 3) for x in plain],
        "kvrun_runs_s": [round(x, 3) for x in fetched],
    }
    met = write("models", result, goals=GOALS, shown=SHOWN)
    print(f"\nmodels (loopback hub, CPU engine, median of {ROUNDS} rounds)")
    print(f"  {'plain download of 1 GiB':<40}{result['plain_download_s']:>9.2f} s")
    print(f"  {'kvrun fetch, checked':<40}{result['kvrun_fetch_s']:>9.2f} s")
    print(f"  {'KV tokens hub / local / logged':<40}{predicted:>9,} / {kv_tokens_local:,} / "
          f"{logged:,}")
    print(f"  {'first start (downloads)':<40}{result['first_start_s']:>9.2f} s")
    print(f"  {'start from the cache':<40}{result['cached_start_s']:>9.2f} s")
    print(f"  {'adapter added to first answer':<40}{result['adapter_ready_s']:>9.2f} s")
    print(f"  {'tokens/s, 4 adapters / base alone':<40}{result['adapter_tps_ratio']:>9.3f}")
    print_goals(result, GOALS)
    return 0 if met else 1


def measure_adapters(served: Hub, organization: Organization, model: ModelSpec, scratch: Path,
                     web: str) -> dict[str, object]:
    """The adapters' figures, on an endpoint with four LoRA slots of `model`."""
    for number in range(ADAPTERS):
        served.publish(f"bench/lora-{number}", lora.build_demo_adapter(
            scratch / f"lora-{number}", seed=number, base_model=model.hf_repo,
            shape=demo_model.lora_shape()))
    endpoint = do_create_endpoint(
        organization=organization, actor_role=Role.OWNER, created_by=None, name="bench-lora",
        model=model, policy=EndpointPolicy(context_length=CONTEXT_LENGTH,
                                           concurrency=CONCURRENCY, lora_adapters=ADAPTERS,
                                           lora_max_rank=8))
    wait_for(lambda: Endpoint.objects.get(id=endpoint.id).state == State.READY, 300)
    _, secret = seed.key(organization)
    with httpx.Client(base_url=web, timeout=120,
                      headers={"Authorization": f"Bearer {secret}"}) as client:
        ready = []
        for number in range(ADAPTERS):
            added = time.monotonic()
            do_add_adapter_from_hub(endpoint=endpoint, actor_role=Role.OWNER, added_by=None,
                                    name=f"a{number}", repo_id=f"bench/lora-{number}")
            wait_for(lambda n=number: complete(client, f"bench-lora:a{n}", 1)[0] == 200, 60)
            ready.append(time.monotonic() - added)
            print(f"adapter {number + 1} served {ready[-1]:.2f} s after it was added",
                  flush=True)
        base_tps, mixed_tps, sent = [], [], Counter[str]()
        request_ids: list[str] = []
        for round_number in range(ROUNDS):
            for mixed in (False, True)[::1 if round_number % 2 == 0 else -1]:
                names = [f"bench-lora:a{n % ADAPTERS}" if mixed else "bench-lora"
                         for n in range(ADAPTER_REQUESTS)]
                tps, ids = throughput(client, names)
                (mixed_tps if mixed else base_tps).append(tps)
                sent.update(name.partition(":")[2] for name in names)
                request_ids += ids
            print(f"round {round_number + 1}: base {base_tps[-1]:.1f} tokens/s, "
                  f"4 adapters {mixed_tps[-1]:.1f} tokens/s", flush=True)
    stored = Counter[str]()
    deadline = time.monotonic() + 60
    while sum(stored.values()) < len(request_ids) and time.monotonic() < deadline:
        do_ingest_usage()
        stored = Counter(UsageRecord.objects.filter(request_id__in=request_ids)
                         .values_list("adapter", flat=True))
    delete_and_settle(endpoint)
    return {"adapter_ready_s": round(statistics.median(ready), 3),
            "adapter_ready_runs_s": [round(x, 3) for x in ready],
            "adapter_tps_ratio": round(statistics.median(mixed_tps)
                                       / statistics.median(base_tps), 3),
            "adapter_base_tps": round(statistics.median(base_tps), 1),
            "adapter_mixed_tps": round(statistics.median(mixed_tps), 1),
            "adapter_requests": dict(sorted(sent.items())),
            "adapter_records": dict(sorted(stored.items())),
            "adapter_records_exact": stored == sent}


def complete(client: httpx.Client, model: str, max_tokens: int) -> tuple[int, int, str]:
    """(status, completion tokens, request id) of one completion through the gateway."""
    answer = client.post("/v1/completions", json={
        "model": model, "prompt": "Every prompt token and every generated token is metered",
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    tokens = answer.json()["usage"]["completion_tokens"] if answer.status_code == 200 else 0
    return answer.status_code, tokens, answer.headers.get("x-request-id", "")


def throughput(client: httpx.Client, names: list[str]) -> tuple[float, list[str]]:
    """Completion tokens per second over `names`' requests, CONCURRENCY at a time."""
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(lambda name: complete(client, name, ADAPTER_TOKENS), names))
    elapsed = time.monotonic() - started
    assert all(status == 200 for status, _, _ in answers), answers
    return sum(tokens for _, tokens, _ in answers) / elapsed, [ids for _, _, ids in answers]


def wait_for(ready: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
