"""`make bench` target `kv`: what kvrun's KV governance gives, through the whole product
(gateway → node agent → real vLLM engines), on the demo model.

  prefix caching  multi-turn conversations whose turns share a growing prefix, sent to an
                  endpoint with prefix caching on and to one with it off: hit rate (cached
                  over prompt tokens, as metered) and TTFT p50 of each, and the ratio off/on.
  routing         tenants (one API key each, caches kept apart per key), each with its own
                  long document, asking questions in random order against one endpoint of two
                  replicas: routed least-loaded, then by prefix affinity (a routing change,
                  no restart), taking turns for three rounds each, every round with fresh
                  documents. Hit rate and TTFT p50/p95.

Each engine's KV pool is its policy's budget (the concurrency at the context), so the
tenants' documents together overflow one replica's cache: the regime where routing decides
what stays cached. TTFT is the client's time to the first streamed token. The same script runs
unchanged on a GPU host (there the pools are as large as the devices allow). Goals: affinity's
hit rate at least 1.8 × least-loaded's, and its TTFT p50 lower. Writes bench/results/kv.json.
"""

import os
import random
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

from accounts.models import Organization, Role  # noqa: E402
from bench import seed  # noqa: E402
from bench.provision import start_processes, start_web  # noqa: E402
from bench.record import Figure, Goal, print_goals, write  # noqa: E402
from endpoints.models import Endpoint, ModelSpec, Replica, State  # noqa: E402
from endpoints.policies import EndpointPolicy, EndpointScaling  # noqa: E402
from endpoints.services import (  # noqa: E402
    do_change_endpoint_policy,
    do_create_endpoint,
    do_delete_endpoint,
    do_load_catalogs,
)
from kvrun.celery import app  # noqa: E402

SEED = 20261204
CONTEXT, CONCURRENCY = 2048, 4  # a KV budget of 8,192 tokens per replica
CONVERSATIONS, TURNS = 4, 6
TENANTS, QUESTIONS = 12, 4
ROUNDS = 3  # of each routing, taking turns
DOCUMENT_WORDS = 200  # about 1,100 tokens of the demo tokenizer: 12 of them overflow 8,192
GOALS = [
    Goal("affinity_hit_ratio", "prefix affinity's hit rate / least-loaded's", at_least=1.8),
    Goal("affinity_ttft_p50_ratio", "prefix affinity's TTFT p50 / least-loaded's", below=1.0),
]
SHOWN = [
    Figure("hit_rate_on", "multi-turn hit rate, prefix caching on"),
    Figure("hit_rate_off", "multi-turn hit rate, prefix caching off"),
    Figure("ttft_ratio_off_on", "multi-turn TTFT p50: caching off / on"),
    Figure("affinity_hit_rate", "hit rate, prefix affinity"),
    Figure("least_loaded_hit_rate", "hit rate, least-loaded"),
]
WORDS = ("travel expenses leave policy section rule manager approval budget invoice contract "
         "holiday sick remote office security laptop password review quarter target bonus "
         "training mentor customer support ticket release deploy incident report").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ask(web: str, secret: str, body: dict) -> tuple[float, int, int]:
    """(seconds to the first streamed token, prompt tokens, cached prompt tokens)."""
    started = time.perf_counter()
    first = None
    usage = {}
    with httpx.stream("POST", f"{web}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return first or 0.0, usage["prompt_tokens"], details.get("cached_tokens") or 0


def create(organization: Organization, name: str, *, replicas: int = 1,
           **policy: Any) -> Endpoint:
    return do_create_endpoint(
        organization=organization, actor_role=Role.OWNER, created_by=None, name=name,
        model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
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


def conversations(web: str, secret: str, name: str, rng: random.Random) -> list[tuple]:
    """Turn by turn, each conversation's whole history and a new question."""
    histories = [[{"role": "system", "content": f"Assistant {n}: " + text(rng, 120)}]
                 for n in range(CONVERSATIONS)]
    measured = []
    for _ in range(TURNS):
        for history in histories:
            history.append({"role": "user", "content": text(rng, 15) + "?"})
            measured.append(ask(web, secret, {"model": name, "messages": history,
                                              "max_tokens": 16}))
            history.append({"role": "assistant", "content": text(rng, 12)})
    return measured


def tenants_asking(web: str, secrets: list[str], rng: random.Random) -> list[tuple]:
    """Each tenant's questions about its own document, in random order, two clients at once."""
    documents = [f"Tenant {n}'s handbook. " + text(rng, DOCUMENT_WORDS) for n in range(TENANTS)]
    order = [(tenant, question) for tenant in range(TENANTS) for question in range(QUESTIONS)]
    rng.shuffle(order)
    measured: list[tuple] = []
    lock = threading.Lock()

    def client(share: list[tuple[int, int]]) -> None:
        for tenant, question in share:
            result = ask(web, secrets[tenant], {"model": "pair", "max_tokens": 8, "messages": [
                {"role": "system", "content": documents[tenant]},
                {"role": "user", "content": f"Question {question}: " + text(rng, 10) + "?"}]})
            with lock:
                measured.append(result)

    clients = [threading.Thread(target=client, args=(order[n::2],)) for n in range(2)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    return measured


def summary(measured: list[tuple]) -> dict:
    ttfts = sorted(ttft for ttft, _, _ in measured)
    return {"requests": len(measured),
            "hit_rate": round(sum(c for _, _, c in measured) / sum(p for _, p, _ in measured), 4),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
            "ttft_p95_ms": round(ttfts[int(0.95 * (len(ttfts) - 1))] * 1000, 1)}


def main() -> int:
    do_load_catalogs()
    organization = seed.organization("bench kv")
    logs = Path(settings.KVRUN_STATE_DIR) / "bench-logs"
    children = start_processes(logs)
    rng = random.Random(SEED)
    try:
        base = start_web(children)
        _, inference = seed.key(organization)
        on = create(organization, "turns-on")
        off = create(organization, "turns-off", prefix_caching=False)
        wait_ready(on, 1)
        wait_ready(off, 1)
        caching_on = summary(conversations(base, inference, "turns-on", rng))
        caching_off = summary(conversations(base, inference, "turns-off", rng))
        delete(on)
        delete(off)

        pair = create(organization, "pair", replicas=2, cache_isolation="key",
                      prefix_affinity=False)
        wait_ready(pair, 2)
        secrets = [seed.key(organization, name=f"tenant {n}")[1] for n in range(TENANTS)]
        # The two routings take turns, each round with fresh documents, so that whatever
        # drifts over the run (the engines' caches filling, the machine's load) weighs on both.
        rounds: dict[bool, list[tuple]] = {False: [], True: []}
        for _ in range(ROUNDS):
            for affine in (False, True):
                do_change_endpoint_policy(endpoint=pair, actor_role=Role.OWNER,
                                          changes={"prefix_affinity": affine})
                time.sleep(settings.KVRUN_GATEWAY_ROUTE_CACHE_SECONDS + 1)  # routes refreshed
                rounds[affine] += tenants_asking(base, secrets, rng)
        least_loaded, affinity = summary(rounds[False]), summary(rounds[True])
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(60)
    result = {
        "model": "kvrun-demo-tiny", "context": CONTEXT, "concurrency": CONCURRENCY,
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
        "caching_on": caching_on, "caching_off": caching_off,
        "least_loaded": least_loaded, "affinity": affinity,
    }
    met = write("kv", result, goals=GOALS, shown=SHOWN)
    report(result)
    return 0 if met else 1


def report(result: dict) -> None:
    print(f"\nKV governance (demo model, CPU engines, {result['kv_tokens_per_replica']:,} KV "
          "tokens per replica)")
    print(f"  {'run':<44}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p95':>10}")
    for label, key in (("prefix caching on, multi-turn", "caching_on"),
                       ("prefix caching off, multi-turn", "caching_off"),
                       ("two replicas, least-loaded", "least_loaded"),
                       ("two replicas, prefix affinity", "affinity")):
        row = result[key]
        print(f"  {label:<44}{row['hit_rate']:>9.1%}{row['ttft_p50_ms']:>8.1f}ms"
              f"{row['ttft_p95_ms']:>8.1f}ms")
    print(f"  TTFT p50 off/on {result['ttft_ratio_off_on']:.2f}")
    print_goals(result, GOALS)


if __name__ == "__main__":
    sys.exit(main())
