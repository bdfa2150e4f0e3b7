"""`make bench` target `kv`: what kvrun's KV governance gives, through the whole product
(gateway → node agent → real vLLM engines), on the catalog's prefill-heavy bench model
(`kvrun-bench-prefill`, random weights), each CPU engine bound to a core of its own.

  the model       its shape, its prefill cost per 1,000 prompt tokens and its cost per
                  decoded token on one engine, through the gateway with caching off.
  prefix caching  multi-turn conversations whose turns share a growing prefix, sent to an
                  endpoint with prefix caching on and to one with it off: hit rate (cached
                  over prompt tokens, as metered) and TTFT p50/p95 of each, and the ratio off/on.
  routing         tenants (one API key each, caches kept apart per key), each with its own
                  long document, asking questions in random order against one endpoint of two
                  replicas: routed least-loaded, then by prefix affinity (a routing change,
                  no restart), taking turns for three rounds each, every round with fresh
                  documents. Hit rate and TTFT p50/p95. Under affinity, the share of requests
                  that went to their prefix's replica (the rest spilled past its load bound, by
                  the gateway's own counter), and each engine's own count of prefix-cache hits
                  beside the hits metered for the requests routed to it.

Each engine's KV pool is its policy's budget (the concurrency at the context), so the
tenants' documents together overflow one replica's cache: the regime where routing decides
what stays cached. TTFT is the client's time to the first streamed token. The same script runs
unchanged on a GPU host (there the pools are as large as the devices allow). Goals: caching
makes TTFT p50 at least 2 × faster; affinity's hit rate at least 1.8 × least-loaded's and its
TTFT p50 at most 0.8 × least-loaded's. Writes bench/results/kv.json.
"""

import os
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")
django.setup()

import httpx  # noqa: E402
import orjson  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db.models import Sum  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from accounts.models import Organization, Role  # noqa: E402
from bench import seed  # noqa: E402
from bench.provision import start_processes  # noqa: E402
from bench.record import Figure, Goal, print_goals, write  # noqa: E402
from billing.ingestion import do_ingest_usage  # noqa: E402
from billing.models import UsageRecord  # noqa: E402
from endpoints.models import Endpoint, ModelSpec, Replica, State  # noqa: E402
from endpoints.policies import EndpointPolicy, EndpointScaling  # noqa: E402
from endpoints.services import (  # noqa: E402
    do_change_endpoint_policy,
    do_create_endpoint,
    do_delete_endpoint,
    do_load_catalogs,
)
from engine import demo_model, metrics  # noqa: E402
from fleet.certificates import engine_address  # noqa: E402
from kvrun.celery import app  # noqa: E402
from nodes.config import AgentConfig  # noqa: E402

SEED = 20261204
MODEL = "kvrun-bench-prefill"
CORES_PER_ENGINE = 1
CONTEXT, CONCURRENCY = 2048, 4  # a KV budget of 8,192 tokens per replica
CONVERSATIONS, TURNS = 4, 6
TENANTS, QUESTIONS = 16, 6
ROUNDS = 3  # of each routing, taking turns
# Each document makes its prompts share six whole 128-token blocks of the CPU engine (768 of
# the demo tokenizer's tokens) and a few tokens more, so that a question stays within the next
# block: a request then caches no block of its own, which would push documents out. The 16
# documents overflow one replica's 8,192 tokens by half, and the ring's split of them fits
# two. The tenants take turns, each asking once in every pass over all of them (in an order
# of their own each pass), as many tenants sharing a deployment do: between two questions of
# one tenant come the fifteen others'. Under affinity a replica sees its own eight documents
# in that time, which fit; under least-loaded, a question that lands on the other replica
# than the last finds its document pushed out there by the sixteen others.
BLOCK_TOKENS, SHARED_BLOCKS = 128, 6
# A conversation's shared prefix: with six turns its last prompt stays within the context.
SYSTEM_WORDS = 160
PREFILL_TOKENS = 2000  # the prompt whose prefill is timed, as token ids
DECODED_TOKENS = 64
METRICS_TOKEN = "bench-kv"
GOALS = [
    Goal("ttft_ratio_off_on", "multi-turn TTFT p50: prefix caching off / on", at_least=2.0),
    Goal("affinity_hit_ratio", "prefix affinity's hit rate / least-loaded's", at_least=1.8),
    Goal("affinity_ttft_p50_ratio", "prefix affinity's TTFT p50 / least-loaded's", at_most=0.8),
]
SHOWN = [
    Figure("parameters", "bench model's parameters"),
    Figure("prefill_ms_per_1k_tokens", "prefill per 1,000 prompt tokens", "ms"),
    Figure("decode_ms_per_token", "decode per token", "ms"),
    Figure("hit_rate_on", "multi-turn hit rate, prefix caching on"),
    Figure("hit_rate_off", "multi-turn hit rate, prefix caching off"),
    Figure("affinity_hit_rate", "hit rate, prefix affinity"),
    Figure("least_loaded_hit_rate", "hit rate, least-loaded"),
    Figure("affinity_owner_share", "affinity: requests sent to their prefix's replica"),
    Figure("engine_hits_agree", "affinity: each engine's own hit count = hits metered to it"),
]
WORDS = ("travel expenses leave policy section rule manager approval budget invoice contract "
         "holiday sick remote office security laptop password review quarter target bonus "
         "training mentor customer support ticket release deploy incident report").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ask(web: str, secret: str, body: dict, path: str = "chat/completions"
        ) -> tuple[float, int, int, float]:
    """(seconds to the first streamed token, prompt tokens, cached prompt tokens, seconds to
    the end)."""
    started = time.perf_counter()
    first = None
    usage = {}
    with httpx.stream("POST", f"{web}/v1/{path}", timeout=300,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        # Events end at "\n" alone: a token's text may hold any other line break (U+2028,
        # NEL), on which httpx's iter_lines, like str.splitlines, would split an event.
        pending = b""
        for received in response.iter_bytes():
            *lines, pending = (pending + received).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter() - started
                usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return (first or 0.0, usage["prompt_tokens"], details.get("cached_tokens") or 0,
            time.perf_counter() - started)


def create(organization: Organization, name: str, *, replicas: int = 1,
           **policy: Any) -> Endpoint:
    return do_create_endpoint(
        organization=organization, actor_role=Role.OWNER, created_by=None, name=name,
        model=ModelSpec.objects.get(slug=MODEL),
        policy=EndpointPolicy(context_length=CONTEXT, concurrency=CONCURRENCY, **policy),
        scaling=EndpointScaling(min_replicas=replicas, max_replicas=replicas))


def wait_ready(endpoint: Endpoint, replicas: int) -> None:
    deadline = time.monotonic() + 600
    while Replica.objects.filter(endpoint=endpoint, state=State.READY).count() < replicas:
        assert time.monotonic() < deadline, Endpoint.objects.get(id=endpoint.id).failure_reason
        app.send_task("endpoints.reconcile", args=[str(endpoint.id)])
        time.sleep(1)


def delete(endpoint: Endpoint) -> None:
    """Delete the endpoint and wait until its engines are gone: an idle CPU engine still takes
    a share of the cores, which the next phase's engines would not have otherwise."""
    do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
    deadline = time.monotonic() + 120
    while Replica.objects.filter(endpoint=endpoint).exclude(state=State.STOPPED).exists():
        assert time.monotonic() < deadline, "the endpoint's engines did not stop"
        app.send_task("endpoints.reconcile", args=[str(endpoint.id)])
        time.sleep(1)


def ready_replicas(endpoint: Endpoint) -> list[Replica]:
    return list(Replica.objects.filter(endpoint=endpoint, state=State.READY).order_by("id"))


def bound_cores(replica: Replica) -> str:
    """The cores the replica's engine threads are bound to, as its ready event names them."""
    ready = replica.events.filter(state=State.READY, message__startswith="ready on port ").first()
    found = re.search(r", cores ([\d,]+)", ready.message) if ready else None
    return found.group(1) if found else "vLLM's own"


def model_costs(web: str, secret: str, name: str) -> dict:
    """Prefill per 1,000 tokens and decode per token, medians of three, on an endpoint with
    prefix caching off: a long prompt's time to its first token, and a short prompt's
    time from its first token to its last."""
    prefills, decodes = [], []
    for attempt in range(3):
        ids = [3 + (n * 7 + attempt) % (demo_model.VOCAB_SIZE - 3) for n in range(PREFILL_TOKENS)]
        ttft, prompt_tokens, _, _ = ask(web, secret, {"model": name, "prompt": ids,
                                                      "max_tokens": 1}, "completions")
        prefills.append(ttft * 1000 / prompt_tokens * 1000)
        ttft, _, _, total = ask(web, secret, {"model": name, "prompt": [5 + attempt] * 16,
                                              "max_tokens": DECODED_TOKENS, "ignore_eos": True},
                                "completions")
        decodes.append((total - ttft) * 1000 / (DECODED_TOKENS - 1))
    return {"prefill_ms_per_1k_tokens": round(statistics.median(prefills), 1),
            "decode_ms_per_token": round(statistics.median(decodes), 2)}


def conversations(web: str, secret: str, name: str, rng: random.Random) -> list[tuple]:
    """Turn by turn, each conversation's whole history and a new question."""
    histories = [[{"role": "system", "content": f"Assistant {n}: " + text(rng, SYSTEM_WORDS)}]
                 for n in range(CONVERSATIONS)]
    measured = []
    for _ in range(TURNS):
        for history in histories:
            history.append({"role": "user", "content": text(rng, 15) + "?"})
            measured.append(ask(web, secret, {"model": name, "messages": history,
                                              "max_tokens": 16}))
            history.append({"role": "assistant", "content": text(rng, 12)})
    return measured


def question(rng: random.Random, number: int) -> dict:
    return {"role": "user", "content": f"Question {number}: " + text(rng, 10) + "?"}


def shared_tokens(tokenizer: Any, document: str, rng: random.Random) -> int:
    """How many prompt tokens two questions about `document` share, as the engine's chat
    template renders them."""
    first, second = (tokenizer.apply_chat_template(
        [{"role": "system", "content": document}, question(rng, number)],
        add_generation_prompt=True, tokenize=True)["input_ids"] for number in (1, 2))
    return next(n for n, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)


def sized_document(tokenizer: Any, tenant: int, rng: random.Random) -> str:
    """A document whose prompts share SHARED_BLOCKS whole blocks and a few tokens more."""
    document = f"Tenant {tenant}'s handbook."
    while shared_tokens(tokenizer, document, rng) < SHARED_BLOCKS * BLOCK_TOKENS:
        document += " " + rng.choice(WORDS)
    return document


def tenants_asking(web: str, secrets: list[str], rng: random.Random) -> list[tuple]:
    """Each tenant's questions about its own document, one question of each tenant per pass
    in a random order, two clients at once."""
    tokenizer = AutoTokenizer.from_pretrained(
        demo_model.build(AgentConfig.from_environ().model_dir / MODEL, demo_model.BUILT_IN[MODEL]))
    documents = [sized_document(tokenizer, n, rng) for n in range(TENANTS)]
    order = [(tenant, number) for number in range(QUESTIONS)
             for tenant in rng.sample(range(TENANTS), TENANTS)]
    measured: list[tuple] = []
    lock = threading.Lock()

    def client(share: list[tuple[int, int]]) -> None:
        for tenant, number in share:
            result = ask(web, secrets[tenant], {"model": "pair", "max_tokens": 8, "messages": [
                {"role": "system", "content": documents[tenant]}, question(rng, number)]})
            with lock:
                measured.append(result)

    clients = [threading.Thread(target=client, args=(order[n::2],)) for n in range(2)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    return measured


class Counters:
    """What the product counts of the pair's routing: each engine's own prefix-cache hits
    (its /metrics), the hits metered for the requests routed to each replica, and the
    gateway's spills (its /metrics). Read before and after each round of affinity."""

    def __init__(self, web: str, endpoint: Endpoint) -> None:
        self.web, self.endpoint = web, endpoint
        self.replicas = ready_replicas(endpoint)
        self.engine_hits = {replica.id: 0 for replica in self.replicas}
        self.metered_hits = {replica.id: 0 for replica in self.replicas}
        self.spills = 0

    def read(self) -> tuple[dict, dict, float]:
        while do_ingest_usage():
            pass
        engine, metered = {}, {}
        for replica in self.replicas:
            with engine_address(replica=replica).client(timeout=60) as client:
                answer = client.get("/metrics")
            engine[replica.id] = metrics.snapshot(answer.text).prefix_hits
            metered[replica.id] = UsageRecord.objects.filter(replica=replica).aggregate(
                hits=Sum("cached_tokens"))["hits"] or 0
        gateway = httpx.get(f"{self.web}/metrics", timeout=60,
                            headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        spills = metrics.totals(gateway.text).get("kvrun_gateway_affinity_spills_total", 0.0)
        return engine, metered, spills

    def add(self, before: tuple[dict, dict, float], after: tuple[dict, dict, float]) -> None:
        for replica in self.replicas:
            self.engine_hits[replica.id] += after[0][replica.id] - before[0][replica.id]
            self.metered_hits[replica.id] += after[1][replica.id] - before[1][replica.id]
        self.spills += int(after[2] - before[2])


def summary(measured: list[tuple]) -> dict:
    ttfts = sorted(ttft for ttft, _, _, _ in measured)
    return {"requests": len(measured),
            "hit_rate": round(sum(c for _, _, c, _ in measured)
                              / sum(p for _, p, _, _ in measured), 4),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
            "ttft_p95_ms": round(ttfts[int(0.95 * (len(ttfts) - 1))] * 1000, 1)}


def main() -> int:
    do_load_catalogs()
    organization = seed.organization("bench kv")
    logs = Path(settings.KVRUN_STATE_DIR) / "bench-logs"
    os.environ["KVRUN_METRICS_TOKEN"] = METRICS_TOKEN  # the web process's /metrics
    children, base = start_processes(
        logs, KVRUN_NODE_CPU_CORES_PER_ENGINE=str(CORES_PER_ENGINE))
    rng = random.Random(SEED)
    try:
        _, inference = seed.key(organization)
        on = create(organization, "turns-on")
        off = create(organization, "turns-off", prefix_caching=False)
        wait_ready(on, 1)
        wait_ready(off, 1)
        cores = sorted(bound_cores(replica) for replica in ready_replicas(on) + ready_replicas(off))
        costs = model_costs(base, inference, "turns-off")
        caching_on = summary(conversations(base, inference, "turns-on", rng))
        caching_off = summary(conversations(base, inference, "turns-off", rng))
        delete(on)
        delete(off)

        pair = create(organization, "pair", replicas=2, cache_isolation="key",
                      prefix_affinity=False)
        wait_ready(pair, 2)
        counters = Counters(base, pair)
        secrets = [seed.key(organization, name=f"tenant {n}")[1] for n in range(TENANTS)]
        # The two routings take turns, each round with fresh documents, so that whatever
        # drifts over the run (the engines' caches filling, the machine's load) weighs on both.
        rounds: dict[bool, list[tuple]] = {False: [], True: []}
        for _ in range(ROUNDS):
            for affine in (False, True):
                do_change_endpoint_policy(endpoint=pair, actor_role=Role.OWNER,
                                          changes={"prefix_affinity": affine})
                time.sleep(settings.KVRUN_GATEWAY_ROUTE_CACHE_SECONDS + 1)  # routes refreshed
                before = counters.read()
                rounds[affine] += tenants_asking(base, secrets, rng)
                if affine:
                    counters.add(before, counters.read())
        least_loaded, affinity = summary(rounds[False]), summary(rounds[True])
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(60)
    result = {
        "model": MODEL, **demo_model.described(demo_model.BUILT_IN[MODEL]), **costs,
        "cores_per_engine": CORES_PER_ENGINE, "engine_cores": cores,
        "context": CONTEXT, "concurrency": CONCURRENCY,
        "kv_tokens_per_replica": CONTEXT * CONCURRENCY,
        "conversations": CONVERSATIONS, "turns": TURNS, "tenants": TENANTS,
        "questions_per_tenant": QUESTIONS, "rounds": ROUNDS,
        "hit_rate_on": caching_on["hit_rate"], "hit_rate_off": caching_off["hit_rate"],
        "ttft_ratio_off_on": round(caching_off["ttft_p50_ms"] / caching_on["ttft_p50_ms"], 3),
        "affinity_hit_rate": affinity["hit_rate"],
        "least_loaded_hit_rate": least_loaded["hit_rate"],
        "affinity_hit_ratio": round(affinity["hit_rate"] / max(least_loaded["hit_rate"], 1e-9),
                                    3),
        "affinity_ttft_p50_ratio": round(affinity["ttft_p50_ms"] / least_loaded["ttft_p50_ms"],
                                         3),
        "affinity_owner_share": round(1 - counters.spills / affinity["requests"], 3),
        "engine_hits": sorted(counters.engine_hits.values()),
        "metered_hits": sorted(counters.metered_hits.values()),
        "engine_hits_agree": counters.engine_hits == counters.metered_hits,
        "caching_on": caching_on, "caching_off": caching_off,
        "least_loaded": least_loaded, "affinity": affinity,
    }
    met = write("kv", result, goals=GOALS, shown=SHOWN)
    report(result)
    return 0 if met else 1


def report(result: dict) -> None:
    print(f"\nKV governance ({MODEL}: {result['parameters']:,} parameters, prefill "
          f"{result['prefill_ms_per_1k_tokens']} ms per 1k tokens, decode "
          f"{result['decode_ms_per_token']} ms per token; CPU engines on cores "
          f"{', '.join(result['engine_cores'])}; {result['kv_tokens_per_replica']:,} KV tokens "
          "per replica)")
    print(f"  {'run':<44}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p95':>10}")
    for label, key in (("prefix caching on, multi-turn", "caching_on"),
                       ("prefix caching off, multi-turn", "caching_off"),
                       ("two replicas, least-loaded", "least_loaded"),
                       ("two replicas, prefix affinity", "affinity")):
        row = result[key]
        print(f"  {label:<44}{row['hit_rate']:>9.1%}{row['ttft_p50_ms']:>8.1f}ms"
              f"{row['ttft_p95_ms']:>8.1f}ms")
    print(f"  affinity: {result['affinity_owner_share']:.1%} of requests to their prefix's "
          f"replica; engines' own hits {result['engine_hits']} vs metered "
          f"{result['metered_hits']}")
    print_goals(result, GOALS)


if __name__ == "__main__":
    sys.exit(main())
