"""`make bench` target `provision`: a bare vLLM start against create → ready through kvrun.

Side by side in one run, alternating, on the demo model and the CPU engine:
  bare   the same vLLM command kvrun builds, timed from spawn to /health + /v1/models;
  kvrun  do_create_endpoint → control worker → the node's long poll → node agent → engine
         → `ready` in Postgres.
Both start the engine in its sandbox, as kvrun always does; what the sandbox itself adds to
a start is measured apart, a Python started plain and sandboxed. Reports kvrun's overhead
and the ratio, and the sizing error against the KV capacity the engine logged. On this
2-core machine one engine start varies by several seconds from run to run, more than kvrun
adds, so the overhead is also measured inside each kvrun round: the time
from create to `ready` less that same engine's own spawn-to-serving time (from the replica's
`loading` and `ready` events). Writes bench/results/provision.json.
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")
django.setup()

from django.conf import settings  # noqa: E402

from accounts.models import Role  # noqa: E402
from bench import seed  # noqa: E402
from bench.record import ROOT, Figure, Goal, print_goals, write  # noqa: E402
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Replica, State  # noqa: E402
from endpoints.planning import plan  # noqa: E402
from endpoints.policies import EndpointPolicy  # noqa: E402
from endpoints.services import do_create_endpoint, do_delete_endpoint, do_load_catalogs  # noqa: E402
from engine import demo_model, processes, sandbox, supervisor  # noqa: E402
from engine.sizing import CPU  # noqa: E402
from engine.tls import EngineAddress  # noqa: E402
from fleet.enrolment import do_create_join_token  # noqa: E402
from kvrun.celery import app  # noqa: E402
from kvrun.launcher import uvicorn_args, wait_until_listening  # noqa: E402
from nodes.config import AgentConfig, agent_environment  # noqa: E402

GOALS = [
    Goal("overhead_s", "kvrun's own time to ready, in-run", below=2, unit="s"),
    Goal("ratio", "kvrun create to ready / bare vLLM start", below=1.1),
    Goal("sizing_error_pct", "KV tokens: sizing against what vLLM logged", at_most=0,
         unit="%"),
    Goal("sandbox_start_s", "what an engine's sandbox adds to its start", below=0.5, unit="s"),
]
SHOWN = [
    Figure("bare_start_s", "bare vLLM start to ready, median", "s"),
    Figure("kvrun_create_to_ready_s", "kvrun create to ready, median", "s"),
    Figure("kv_tokens_logged", "KV tokens vLLM logged"),
    Figure("kv_tokens_predicted", "KV tokens kvrun sized"),
    Figure("assign_latency_ms_p50", "placed to its node agent starting it, p50", "ms"),
    Figure("assign_latency_ms_p99", "placed to its node agent starting it, p99", "ms"),
]
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


CONTEXT_LENGTH, CONCURRENCY = 2048, 4


def demo_plan() -> dict:
    """kvrun's sizing of the benchmarks' endpoint (the demo model on the CPU): the KV pool
    its engine is given and the tokens that pool holds."""
    return plan(model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
                context_length=CONTEXT_LENGTH, concurrency=CONCURRENCY, kv_cache_dtype="auto",
                gpu_type=GPUType.objects.get(slug=CPU)).summary


def bare_start(model_dir: str, log: Path, *, kv_cache_bytes: int) -> float:
    """The same vLLM command kvrun builds for the endpoint, KV pool included, from spawn to
    serving."""
    spec = supervisor.EngineSpec(model_dir=model_dir, served_model_name="bare",
                                 port=processes.free_port(), max_model_len=CONTEXT_LENGTH,
                                 max_num_seqs=CONCURRENCY, device=CPU, api_key="bench",
                                 cpu_kv_cache_bytes=kv_cache_bytes)
    started = time.monotonic()
    process = supervisor.start(spec, log)
    try:
        supervisor.wait_ready(address=EngineAddress(host=spec.host, port=spec.port,
                                                    api_key="bench"),
                              served_model_name="bare",
                              alive=lambda: process.poll() is None, timeout=300)
        return time.monotonic() - started
    finally:
        processes.stop_group(process.pid, grace=15)
        process.wait()


SANDBOX_ROUNDS = 10


def sandbox_start_s(model_dir: str) -> float:
    """What the sandbox adds to starting a process: a Python that exits at once, started
    plain and in an engine's sandbox, alternating; the difference of the medians."""
    plain, boxed = [], []
    argv = [sys.executable, "-c", "pass"]
    for _ in range(SANDBOX_ROUNDS):
        for command, times in ((argv, plain), (sandbox.command(
                argv, owner="bench", replica="bench", model_dir=model_dir), boxed)):
            started = time.monotonic()
            subprocess.run(command, check=True)
            times.append(time.monotonic() - started)
    return statistics.median(boxed) - statistics.median(plain)


def kvrun_start(organization: object, model: ModelSpec, name: str
                ) -> tuple[float, float, int, float]:
    """(create → ready seconds, of which the engine's own start, KV tokens logged, and the
    assignment's latency: from the replica's placement (`starting`) to its node agent
    starting the engine (`loading`), through the node channel's long poll, in ms)."""
    started = time.monotonic()
    endpoint = do_create_endpoint(
        organization=organization, actor_role=Role.OWNER, created_by=None, name=name, model=model,
        policy=EndpointPolicy(context_length=CONTEXT_LENGTH, concurrency=CONCURRENCY))
    while Endpoint.objects.filter(id=endpoint.id).values_list("state", flat=True).get() not in (
            State.READY, State.FAILED):
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    replica = Replica.objects.filter(endpoint=endpoint, state=State.READY).first()
    assert replica is not None, Endpoint.objects.get(id=endpoint.id).failure_reason
    placed = replica.events.get(state=State.STARTING).at
    spawned = replica.events.get(state=State.LOADING).at
    served = replica.events.get(state=State.READY).at
    engine_own = (served - spawned).total_seconds()
    delete_and_settle(endpoint)
    return (elapsed, engine_own, replica.kv_cache_tokens,
            (spawned - placed).total_seconds() * 1000)


def delete_and_settle(endpoint: Endpoint) -> None:
    """Delete the endpoint and wait until every replica of it has stopped."""
    do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
    while Replica.objects.filter(endpoint=endpoint).exclude(state=State.STOPPED).exists():
        app.send_task("endpoints.reconcile", args=[str(endpoint.id)])
        time.sleep(0.5)


def start_processes(logs: Path, **node_env: str) -> tuple[list[subprocess.Popen], str]:
    """The web process (gateway, dashboard and node channel) as `make run` starts it, a
    control worker and a CPU node agent (its settings in `node_env`) enrolled with a join
    token, once all three serve. Returns them, and the web's base URL."""
    port = processes.free_port()
    base = f"http://127.0.0.1:{port}"
    web = subprocess.Popen([sys.executable, *uvicorn_args("kvrun.asgi:application", port=port)],
                           cwd=ROOT, env=os.environ.copy(),
                           preexec_fn=processes.dying_with_parent)
    children = [web]
    wait_until_listening(web, port)
    _, token = do_create_join_token(node_name="bench-node")
    AgentConfig.from_environ().credential_file("bench-node").unlink(missing_ok=True)  # anew
    children.append(subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "kvrun", "worker", "-Q", "control", "-n",
         "bench-control@%h", "--pool", "solo", "--loglevel", "WARNING"], cwd=ROOT,
        env=os.environ.copy(), preexec_fn=processes.dying_with_parent))
    children.append(subprocess.Popen(
        [sys.executable, "-m", "nodes", "--name", "bench-node"], cwd=ROOT,
        env=agent_environment(os.environ, KVRUN_NODE_GPUS="none",
                              KVRUN_ENGINE_LOG_DIR=str(logs), KVRUN_CONTROL_PLANE_URL=base,
                              KVRUN_JOIN_TOKEN=token, **node_env),
        stdout=subprocess.DEVNULL, preexec_fn=processes.dying_with_parent))
    deadline = time.monotonic() + 90
    while not (app.control.ping(timeout=1.0) and Node.objects.filter(name="bench-node").exists()):
        assert time.monotonic() < deadline, "worker or node agent did not start"
    time.sleep(2)  # the worker consuming, the agent polling its work
    return children, base


def main() -> int:
    do_load_catalogs()
    model = ModelSpec.objects.get(slug="kvrun-demo-tiny")
    model_dir = str(demo_model.build(AgentConfig.from_environ().model_dir / model.slug))
    logs = Path(settings.KVRUN_STATE_DIR) / "bench-logs"
    organization = seed.organization("bench")
    sized = demo_plan()
    children, _ = start_processes(logs)
    bare, through, engine_own, capacities, assigned = [], [], [], [], []
    try:
        for round_number in range(ROUNDS):
            bare.append(bare_start(model_dir, logs / f"bare-{round_number}.log",
                                   kv_cache_bytes=sized["cpu_kv_cache_bytes"]))
            elapsed, own, capacity, assign_ms = kvrun_start(organization, model,
                                                            f"bench-{round_number}")
            through.append(elapsed)
            engine_own.append(own)
            capacities.append(capacity)
            assigned.append(assign_ms)
            print(f"round {round_number + 1}: bare {bare[-1]:.2f} s, kvrun {elapsed:.2f} s "
                  f"(engine itself {own:.2f} s)", flush=True)
    finally:
        for process in reversed(children):
            process.terminate()
            process.wait(30)
    predicted = sized["kv_cache_tokens"]
    logged = int(statistics.median(capacities))
    result = {
        "rounds": ROUNDS,
        "bare_start_s": round(statistics.median(bare), 3),
        "kvrun_create_to_ready_s": round(statistics.median(through), 3),
        "overhead_s": round(statistics.median(
            t - e for t, e in zip(through, engine_own, strict=True)), 3),
        "overhead_vs_bare_median_s": round(statistics.median(through)
                                           - statistics.median(bare), 3),
        "ratio": round(statistics.median(through) / statistics.median(bare), 3),
        "sandbox_start_s": round(sandbox_start_s(model_dir), 3),
        # Of ROUNDS starts: the 99th percentile of so few is their largest.
        "assign_latency_ms_p50": round(statistics.median(assigned), 1),
        "assign_latency_ms_p99": round(sorted(assigned)[
            min(len(assigned) - 1, int(0.99 * len(assigned)))], 1),
        "kv_tokens_logged": logged,
        "kv_tokens_predicted": predicted,
        "sizing_error_pct": round(abs(predicted - logged) / logged * 100, 4),
        "bare_runs_s": [round(x, 3) for x in bare],
        "kvrun_runs_s": [round(x, 3) for x in through],
        "kvrun_engine_own_s": [round(x, 3) for x in engine_own],
    }
    met = write("provision", result, goals=GOALS, shown=SHOWN)
    print("\nprovision (demo model, CPU engine, median of "
          f"{ROUNDS} alternating rounds)")
    print(f"  {'bare vLLM start → ready':<34}{result['bare_start_s']:>9.2f} s")
    print(f"  {'kvrun create → ready':<34}{result['kvrun_create_to_ready_s']:>9.2f} s")
    print(f"  {'kvrun overhead, in-run':<34}{result['overhead_s']:>9.2f} s")
    print(f"  {'difference of medians':<34}{result['overhead_vs_bare_median_s']:>9.2f} s")
    print(f"  {'ratio':<34}{result['ratio']:>9.3f}")
    print(f"  {'KV tokens logged / predicted':<34}{logged:>9,} / {predicted:,}")
    print(f"  {'sizing error':<34}{result['sizing_error_pct']:>9.4f} %")
    print(f"  {'the sandbox, added to a start':<34}{result['sandbox_start_s']:>9.3f} s")
    print(f"  {'placed → agent starts it, p50/p99':<34}{result['assign_latency_ms_p50']:>9.1f}"
          f" / {result['assign_latency_ms_p99']:.1f} ms")
    print_goals(result, GOALS)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
