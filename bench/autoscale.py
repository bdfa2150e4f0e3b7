"""`make bench` target `autoscale`: a request to an endpoint scaled to zero against a bare
vLLM start, through the whole product (gateway → worker → node agent → engine).

Side by side in each round, on the demo model and the CPU engine:
  bare   the same vLLM command kvrun builds, spawn → serving (as the provision target times it);
  cold   the endpoint idled to zero (the autoscaler on the worker), then 4 requests at once,
         2 streamed and 2 not: the first streamed token's time from sending, the ETA the
         gateway gave in its first progress comment against the time the request waited.
Goals: cold first token ≤ bare start + 1 s, ETA within ±25 %, no request failed. The first
round's ETA comes from the endpoint's own first start. Writes bench/results/autoscale.json.
"""

import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402

from accounts.models import Role  # noqa: E402
from bench import seed  # noqa: E402
from bench.provision import CONCURRENCY, CONTEXT_LENGTH, bare_start, start_processes  # noqa: E402
from bench.record import Figure, Goal, print_goals, write  # noqa: E402
from endpoints.models import Endpoint, ModelSpec, Replica, State  # noqa: E402
from endpoints.policies import EndpointPolicy, EndpointScaling  # noqa: E402
from endpoints.services import do_create_endpoint, do_load_catalogs  # noqa: E402
from engine import demo_model  # noqa: E402
from kvrun.celery import app  # noqa: E402
from nodes.config import AgentConfig  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
IDLE_SECONDS = 2
GOALS = [
    Goal("cold_over_bare_s", "request at zero to first token, less a bare vLLM start",
         at_most=1.0, unit="s"),
    Goal("eta_error_pct", "ETA error, median", at_most=25.0, unit="%"),
    Goal("requests_failed", "requests failed", at_most=0),
]
SHOWN = [
    Figure("bare_start_s", "bare vLLM start to serving, median", "s"),
    Figure("cold_first_token_s", "request at zero to its first token, median", "s"),
    Figure("kvrun_added_in_round_s", "of which kvrun, within each round", "s"),
    Figure("eta_error_worst_pct", "ETA error, worst", "%"),
    Figure("requests_sent", "requests sent"),
]
ETA = re.compile(r"ready in about (\d+) s")


def at_zero(endpoint: Endpoint) -> None:
    deadline = time.monotonic() + 180
    while not (Endpoint.objects.filter(id=endpoint.id, state=State.IDLE).exists()
               and not Replica.objects.filter(endpoint=endpoint).exclude(
                   state=State.STOPPED).exists()):
        assert time.monotonic() < deadline, "the endpoint did not scale to zero"
        app.send_task("scaling.autoscale")
        app.send_task("endpoints.reconcile", args=[str(endpoint.id)])
        time.sleep(1)


def cold_burst(web: str, secret: str) -> dict:
    """Four requests at once to the endpoint at zero; what the first stream saw."""

    def send(n: int) -> dict:
        body = {"model": "sleepy", "prompt": f"Wake up, {n}.", "max_tokens": 4,
                "stream": n < 2}
        sent = time.perf_counter()
        seen: dict = {"status": None, "first_token_s": None, "eta_s": None, "waited_s": None}
        with httpx.stream("POST", f"{web}/v1/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {secret}"}) as response:
            seen["status"] = response.status_code
            for line in response.iter_lines():
                if (found := ETA.search(line)) and seen["eta_s"] is None:
                    seen["eta_s"] = int(found.group(1))
                if line.startswith(": kvrun: ready after "):
                    seen["waited_s"] = float(line.split()[-2])
                if line.startswith("data: {") and seen["first_token_s"] is None:
                    seen["first_token_s"] = time.perf_counter() - sent
            if not body["stream"]:
                seen["waited_s"] = int(response.headers.get("x-kvrun-cold-start-ms", 0)) / 1000
        return seen

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(send, range(4)))
    streamed = outcomes[0]
    return {"first_token_s": streamed["first_token_s"], "eta_s": streamed["eta_s"],
            "waited_s": streamed["waited_s"],
            "failed": sum(outcome["status"] != 200 for outcome in outcomes)}


def woken_engine_seconds(endpoint: Endpoint) -> float:
    """How long the engine of the replica the burst woke took itself, from spawn to serving
    (its replica's `loading` and `ready` events): the part of the wait that is vLLM's."""
    replica = (Replica.objects.filter(endpoint=endpoint, state=State.READY)
               .order_by("-created_at").first())
    assert replica is not None, "the burst woke no replica"
    return (replica.events.get(state=State.READY).at
            - replica.events.get(state=State.LOADING).at).total_seconds()


def main() -> int:
    do_load_catalogs()
    settings.KVRUN_SCALE_TO_ZERO_MIN_SECONDS = IDLE_SECONDS  # this process creates it
    model = ModelSpec.objects.get(slug="kvrun-demo-tiny")
    model_dir = str(demo_model.build(AgentConfig.from_environ().model_dir / model.slug))
    organization = seed.organization("bench autoscale")
    logs = Path(settings.KVRUN_STATE_DIR) / "bench-logs"
    children, base = start_processes(logs)
    bare, rounds = [], []
    try:
        _, secret = seed.key(organization)
        endpoint = do_create_endpoint(
            organization=organization, actor_role=Role.OWNER, created_by=None, name="sleepy",
            model=model,
            policy=EndpointPolicy(context_length=CONTEXT_LENGTH, concurrency=CONCURRENCY),
            scaling=EndpointScaling(min_replicas=0, scale_to_zero_after_seconds=IDLE_SECONDS))
        for number in range(ROUNDS):
            at_zero(endpoint)
            bare.append(bare_start(model_dir, logs / f"autoscale-bare-{number}.log",
                                   kv_cache_bytes=endpoint.sizing["cpu_kv_cache_bytes"]))
            rounds.append(cold_burst(base, secret))
            rounds[-1]["engine_own_s"] = woken_engine_seconds(endpoint)
            print(f"round {number + 1}: bare start {bare[-1]:.2f} s, cold first token "
                  f"{rounds[-1]['first_token_s']:.2f} s, ETA {rounds[-1]['eta_s']} s for a "
                  f"wait of {rounds[-1]['waited_s']:.2f} s", flush=True)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(60)
    errors = [abs(r["eta_s"] - r["waited_s"]) / r["waited_s"] * 100 for r in rounds]
    result = {
        "rounds": ROUNDS,
        "bare_start_s": round(statistics.median(bare), 3),
        "cold_first_token_s": round(statistics.median(r["first_token_s"] for r in rounds), 3),
        # Within each round, the first token less that round's own engine start: what kvrun
        # adds (wake, placement, the hold's polling, routing), free of one start's variance.
        "kvrun_added_in_round_s": round(statistics.median(
            r["first_token_s"] - r["engine_own_s"] for r in rounds), 3),
        "eta_error_pct": round(statistics.median(errors), 1),
        "eta_error_worst_pct": round(max(errors), 1),
        "requests_failed": sum(r["failed"] for r in rounds),
        "requests_sent": 4 * ROUNDS,
        "bare_runs_s": [round(x, 3) for x in bare],
        "cold_runs": rounds,
    }
    result["cold_over_bare_s"] = round(result["cold_first_token_s"] - result["bare_start_s"], 3)
    met = write("autoscale", result, goals=GOALS, shown=SHOWN)
    print(f"\nscale to zero (demo model, CPU engine, median of {ROUNDS} rounds)")
    print(f"  {'bare vLLM start → serving':<38}{result['bare_start_s']:>8.2f} s")
    print(f"  {'request at zero → first token':<38}{result['cold_first_token_s']:>8.2f} s")
    print(f"  {'of which kvrun, within each round':<38}"
          f"{result['kvrun_added_in_round_s']:>8.2f} s   (first token less that engine's own "
          "start)")
    print(f"  {'ETA error, median (worst)':<38}{result['eta_error_pct']:>7.1f} %   "
          f"({result['eta_error_worst_pct']:.1f} %)")
    print(f"  {'requests failed':<38}{result['requests_failed']:>8} of "
          f"{result['requests_sent']}")
    print_goals(result, GOALS)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
