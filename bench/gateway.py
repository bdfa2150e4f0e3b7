"""`make bench` target `gateway`: what kvrun's OpenAI-compatible gateway adds to a request.

Side by side in one run, with wrk as the load generator (one thread):
  minimal upstream  bench.minimal_upstream (a raw ASGI app answering at once), direct, through
                    the gateway, and through the floor (bench.floor_forwarder: a bare
                    forwarder with the gateway's server and HTTP client, nothing else):
                    added latency at concurrency 1, non-streamed, streamed, as Anthropic's
                    Messages API (/v1/messages) and as embeddings (/v1/embeddings, to an
                    embedding model's endpoint on a second minimal upstream, with a
                    certificate of its own), and requests per second at concurrency 32,
                    which isolates the gateway's own cost and sets it beside the least any
                    gateway in Python adds here;
  real engine       a vLLM CPU engine serving the demo model, direct and through the gateway:
                    the ratio gateway / direct, and the metered tokens against the engine's own
                    counters.
  held at zero      the minimal upstream's plain c=1 run again, beside HELD_REQUESTS requests
                    held for cold starts of endpoints at zero, spread over HELD_ORGANIZATIONS
                    other organisations: what they cost another tenant's request.
Keys, limits (set high enough not to refuse) and metering are on throughout. At the end the
web process gets SIGTERM, the usage stream is ingested, and the records are counted against
the requests the gateway admitted. Writes bench/results/gateway.json.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import django
import httpx

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")
django.setup()

from django.conf import settings  # noqa: E402
from django.db.models import Sum  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import Organization  # noqa: E402
from bench import seed  # noqa: E402
from bench.record import ROOT, Figure, Goal, print_goals, write  # noqa: E402
from billing.ingestion import do_ingest_usage  # noqa: E402
from billing.models import UsageRecord  # noqa: E402
from endpoints.models import Replica, State  # noqa: E402
from endpoints.services import do_load_catalogs  # noqa: E402
from engine import demo_model, processes, supervisor  # noqa: E402
from engine.metrics import engine_token_totals  # noqa: E402
from engine.sizing import CPU  # noqa: E402
from fleet.certificates import engine_address  # noqa: E402
from kvrun.launcher import uvicorn_args, wait_until_listening  # noqa: E402
from nodes.config import AgentConfig  # noqa: E402

SECONDS = int(os.environ.get("BENCH_SECONDS", "10"))
WRK_SCRIPT = ROOT / "bench" / "wrk_post.lua"
CORES = os.cpu_count() or 1
GOALS = [
    Goal("added_p50_ms", "added p50, minimal upstream, c=1", at_most=1, unit="ms"),
    Goal("added_p99_ms", "added p99, minimal upstream, c=1", at_most=5, unit="ms"),
    Goal("stream_added_p50_ms", "added p50, streamed, c=1", at_most=1, unit="ms"),
    Goal("stream_added_p99_ms", "added p99, streamed, c=1", at_most=5, unit="ms"),
    Goal("records_lost", "usage records lost", at_most=0),
    Goal("held_added_p50_ms", "added p50 beside 200 held requests of 50 organisations, c=1",
         at_most=1, unit="ms"),
    Goal("rps_minimal_upstream", "requests a second through the gateway, c=32",
         at_least=2000, unit="req/s", required=False),
    Goal("added_p50_vs_floor", "added p50 / the floor's, c=1", at_most=1.3),
    Goal("stream_added_p50_vs_floor", "added p50 / the floor's, streamed, c=1", at_most=1.3),
    Goal("added_p99_vs_floor", "added p99 / the floor's, c=1", at_most=1.5),
    Goal("rps_vs_floor", "requests a second / the floor's, c=32", at_least=0.7),
    Goal("messages_added_p50_vs_floor", "added p50 / the floor's, /v1/messages, c=1",
         at_most=1.3),
    Goal("embeddings_added_p50_vs_floor", "added p50 / the floor's, /v1/embeddings, c=1",
         at_most=1.3),
]
SHOWN = [
    Figure("floor_added_p50_ms", "the floor's added p50, c=1", "ms"),
    Figure("floor_added_p99_ms", "the floor's added p99, c=1", "ms"),
    Figure("floor_stream_added_p50_ms", "the floor's added p50, streamed, c=1", "ms"),
    Figure("floor_rps", "requests a second through the floor, c=32", "req/s"),
    Figure("messages_added_p50_ms", "added p50, /v1/messages, c=1", "ms"),
    Figure("floor_messages_added_p50_ms", "the floor's added p50, /v1/messages, c=1", "ms"),
    Figure("embeddings_added_p50_ms", "added p50, /v1/embeddings, c=1", "ms"),
    Figure("floor_embeddings_added_p50_ms", "the floor's added p50, /v1/embeddings, c=1",
           "ms"),
    Figure("rps_minimal_upstream_direct", "requests a second direct, c=32", "req/s"),
    Figure("held_added_p99_ms", "added p99 beside 200 held requests, c=1", "ms"),
    Figure("requests_held_at_the_end", "requests still held when that run ended"),
    Figure("gateway_cpu_share_c32", "share of the cores the gateway used, c=32"),
    Figure("engine_direct_p50_ms", "real engine, 16 tokens, c=1, p50 direct", "ms"),
    Figure("engine_gateway_p50_ms", "real engine, 16 tokens, c=1, p50 through kvrun", "ms"),
    Figure("ratio_vs_direct", "real engine: through kvrun / direct, p50"),
    Figure("stream_ratio_vs_direct", "real engine, streamed: through kvrun / direct, p50"),
    Figure("peak_rss_mb", "peak RSS of the web process", "MB"),
    Figure("requests_admitted", "requests admitted"),
    Figure("usage_records", "usage records stored"),
    Figure("metered_generation_tokens", "generated tokens metered"),
    Figure("engine_generation_tokens", "generated tokens the engine counted"),
]
COMPLETION = {"model": "{name}", "prompt": "Hello, world!", "max_tokens": 16, "ignore_eos": True}
MESSAGE = {"model": "minimal", "max_tokens": 16,
           "messages": [{"role": "user", "content": "Hello, world!"}]}
EMBEDDING = {"model": "embed", "input": "Hello, world!"}
HELD_ORGANIZATIONS, HELD_PER_ORGANIZATION = 50, 4
HELD_REQUESTS = HELD_ORGANIZATIONS * HELD_PER_ORGANIZATION
METRICS_TOKEN = "bench-metrics"


class HeldRequests:
    """Requests to endpoints at zero that never start (no worker places their replica), one
    connection each, held by the gateway until closed."""

    def __init__(self, port: int, secrets: list[str]) -> None:
        self._port, self._secrets = port, secrets
        self._connections: list[socket.socket] = []

    def __enter__(self) -> "HeldRequests":
        body = json.dumps({"model": "sleepy", "prompt": "Hello"}).encode()
        for secret in self._secrets:
            for _ in range(HELD_PER_ORGANIZATION):
                connection = socket.create_connection(("127.0.0.1", self._port))
                connection.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                self._connections.append(connection)
        deadline = time.monotonic() + 60
        while held(self._port) < HELD_REQUESTS:
            assert time.monotonic() < deadline, f"only {held(self._port)} requests held"
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        for connection in self._connections:
            connection.close()


def held(port: int) -> int:
    """What the web process's gauge says it holds."""
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics",
                        headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    found = re.search(r"^kvrun_gateway_requests_held (\S+)$", metrics, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def serve(app: str, port: int, log: Path, env: dict[str, str] | None = None,
          args: tuple[str, ...] = ()) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, *uvicorn_args(app, port=port), *args], cwd=ROOT,
                               env={**os.environ, **(env or {})}, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, preexec_fn=processes.dying_with_parent)
    wait_until_listening(process, port)
    return process


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, body: dict, key: str, *, connections: int, seconds: int = SECONDS,
        watch: int | None = None) -> dict:
    """One wrk run; adds its own and the watched process's share of all cores."""
    env = {**os.environ, "WRK_BODY": json.dumps(body), "WRK_KEY": key}
    watched_before = cpu_seconds(watch) if watch else 0.0
    process = subprocess.Popen(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "30s",
         "-s", str(WRK_SCRIPT), url], env=env, stdout=subprocess.PIPE, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    assert status == 0, output
    result = json.loads(output.strip().splitlines()[-1])
    wall = result["duration_us"] / 1e6
    result["rps"] = result["requests"] / wall
    result["wrk_cpu_share"] = (usage.ru_utime + usage.ru_stime) / (wall * CORES)
    if watch:
        result["watched_cpu_share"] = (cpu_seconds(watch) - watched_before) / (wall * CORES)
    errors = sum(result[name] for name in ("connect_errors", "write_errors", "status_errors",
                                           "timeouts"))
    assert errors == 0, f"wrk saw errors against {url}: {result}"
    return result


def body_for(name: str, *, stream: bool) -> dict:
    body = {**COMPLETION, "model": name}
    if stream:
        body["stream"] = True
    return body


def main() -> int:
    do_load_catalogs()
    logs = Path(settings.KVRUN_STATE_DIR) / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    organization = seed.organization("bench")
    Organization.objects.filter(id=organization.id).update(max_concurrent_requests=10_000)
    # Limits on, set high enough never to refuse: their cost is part of what is measured.
    _, secret = seed.key(organization, requests_per_minute=10**9, tokens_per_minute=10**9)

    upstream_port, engine_port, web_port, floor_port, embed_port = (
        processes.free_port() for _ in range(5))
    # Both upstreams serve TLS, as every engine an agent starts does: the gateway's cost of
    # reaching them is part of what is measured, and so are their own on the direct runs.
    minimal_replica = seed.ready_endpoint(organization, "minimal", [upstream_port]
                                          ).replicas.get()
    minimal_key, minimal_certificate = seed.certify(minimal_replica, logs / "minimal-tls")
    embed_replica = seed.ready_endpoint(organization, "embed", [embed_port],
                                        model="kvrun-demo-embed").replicas.get()
    embed_key, embed_certificate = seed.certify(embed_replica, logs / "embed-tls")
    engine_endpoint = seed.ready_endpoint(organization, "engine", [engine_port])
    model_dir = str(demo_model.build(AgentConfig.from_environ().model_dir / "kvrun-demo-tiny"))
    engine_replica = engine_endpoint.replicas.get()
    engine_tls_dir = logs / "engine-tls"
    key_file, certificate_file = seed.certify(engine_replica, engine_tls_dir)
    address = engine_address(replica=Replica.objects.get(id=engine_replica.id))
    spec = supervisor.EngineSpec(model_dir=model_dir, served_model_name="engine",
                                 port=engine_port, max_model_len=2048, max_num_seqs=8,
                                 device=CPU, api_key=address.api_key,
                                 cache_dir=str(engine_tls_dir), ssl_keyfile=str(key_file),
                                 ssl_certfile=str(certificate_file))
    engine = supervisor.start(spec, logs / "gateway-engine.log")
    upstream = serve("bench.minimal_upstream:app", upstream_port, logs / "minimal-upstream.log",
                     args=("--ssl-keyfile", str(minimal_key),
                           "--ssl-certfile", str(minimal_certificate)))
    embed_upstream = serve("bench.minimal_upstream:app", embed_port,
                           logs / "minimal-embed-upstream.log",
                           args=("--ssl-keyfile", str(embed_key),
                                 "--ssl-certfile", str(embed_certificate)))
    floor = serve("bench.floor_forwarder:app", floor_port, logs / "floor-forwarder.log",
                  {"FLOOR_UPSTREAM": f"https://127.0.0.1:{upstream_port}"})
    web_log = logs / "gateway-web.log"
    held_secrets = []
    for number in range(HELD_ORGANIZATIONS):
        tenant = seed.organization(f"held-{number}")
        seed.ready_endpoint(tenant, "sleepy", [], state=State.IDLE, min_replicas=0,
                            desired_replicas=0)
        held_secrets.append(seed.key(tenant)[1])
    web = serve("kvrun.asgi:application", web_port, web_log,
                {"DEBUG": "0", "SECURE_SSL_REDIRECT": "0", "LOG_LEVEL": "INFO",
                 "KVRUN_METRICS_TOKEN": METRICS_TOKEN, "KVRUN_GATEWAY_HOLD_SECONDS": "600"})
    gateway = f"http://127.0.0.1:{web_port}/v1/completions"
    through_floor = f"http://127.0.0.1:{floor_port}/v1/completions"
    direct_minimal = f"https://127.0.0.1:{upstream_port}/v1/completions"
    runs: dict[str, dict] = {}
    try:
        supervisor.wait_ready(address=address, served_model_name="engine",
                              alive=lambda: engine.poll() is None, timeout=300)
        for name in ("minimal", "engine"):  # the gateway learns the key and the routes
            runs[f"warm_up_{name}"] = wrk(gateway, body_for(name, stream=False), secret,
                                          connections=1, seconds=2)
        runs["warm_up_floor"] = wrk(through_floor, body_for("minimal", stream=False), "",
                                    connections=1, seconds=2)
        for label, stream in (("plain", False), ("stream", True)):
            body = body_for("minimal", stream=stream)
            runs[f"minimal_direct_{label}_c1"] = wrk(direct_minimal, body, "", connections=1)
            runs[f"minimal_floor_{label}_c1"] = wrk(through_floor, body, "", connections=1)
            runs[f"minimal_gateway_{label}_c1"] = wrk(gateway, body, secret, connections=1,
                                                      watch=web.pid)
        for through, url, key in (("direct", direct_minimal, ""), ("floor", through_floor, ""),
                                  ("gateway", gateway, secret)):
            runs[f"minimal_{through}_messages_c1"] = wrk(
                url.replace("/v1/completions", "/v1/messages"), MESSAGE, key, connections=1)
            runs[f"minimal_{through}_embeddings_c1"] = wrk(
                url.replace("/v1/completions", "/v1/embeddings"), EMBEDDING, key,
                connections=1)
        body = body_for("minimal", stream=False)
        with HeldRequests(web_port, held_secrets):
            runs["minimal_gateway_plain_c1_beside_held"] = wrk(gateway, body, secret,
                                                               connections=1)
            still_held = held(web_port)
        runs["minimal_direct_plain_c32"] = wrk(direct_minimal, body, "", connections=32)
        runs["minimal_floor_plain_c32"] = wrk(through_floor, body, "", connections=32)
        runs["minimal_gateway_plain_c32"] = wrk(gateway, body, secret, connections=32,
                                                watch=web.pid)
        def engine_totals() -> dict[str, float]:
            with address.client(timeout=30) as client:
                return engine_token_totals(client.get("/metrics").text)

        # Metered tokens against the engine's own counters, over the gateway's runs alone.
        counted_from = timezone.now()
        before = engine_totals()
        for label, stream in (("plain", False), ("stream", True)):
            runs[f"engine_gateway_{label}_c1"] = wrk(gateway, body_for("engine", stream=stream),
                                                     secret, connections=1)
        time.sleep(1)  # the last cut-off request has been aborted
        grew = {name: value - before[name] for name, value in engine_totals().items()}
        for label, stream in (("plain", False), ("stream", True)):
            runs[f"engine_direct_{label}_c1"] = wrk(
                f"{address.base_url}/v1/completions", body_for("engine", stream=stream),
                address.api_key, connections=1)
        peak_rss_mb = peak_rss(web.pid) / 1024
    finally:
        web.send_signal(signal.SIGTERM)
        web.wait(60)
        for upstream_process in (upstream, embed_upstream):
            upstream_process.terminate()
            upstream_process.wait(30)
        floor.terminate()
        floor.wait(30)
        processes.stop_group(engine.pid, grace=15)
        engine.wait(30)

    while do_ingest_usage():
        pass
    metered = UsageRecord.objects.filter(
        endpoint=engine_endpoint, started_at__gte=counted_from).aggregate(
        prompt=Sum("prompt_tokens"), generation=Sum("completion_tokens"))
    completed = sum(run["requests"] for name, run in runs.items() if "gateway" in name
                    or name in ("warm_up_minimal", "warm_up_engine"))
    result = summarise(runs, peak_rss_mb=peak_rss_mb, completed=completed, still_held=still_held,
                       admitted=admitted_by_gateway(web_log.read_text()),
                       records=UsageRecord.objects.count(), metered=metered, engine_grew=grew)
    met = write("gateway", result, goals=GOALS, shown=SHOWN)
    report(result)
    return 0 if met else 1


def peak_rss(pid: int) -> int:
    """VmHWM in KiB: the most resident memory the process ever had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def admitted_by_gateway(log: str) -> int:
    """What the web process itself counted, from the line its usage sink logs on shutdown."""
    match = re.search(r"usage sink closed: queued=(\d+)", log)
    assert match, "the web process did not log its usage sink's shutdown:\n" + log[-2000:]
    return int(match.group(1))


def ms(us: float) -> float:
    return round(us / 1000, 3)


def summarise(runs: dict[str, dict], *, peak_rss_mb: float, completed: int, still_held: int,
              admitted: int, records: int, metered: dict, engine_grew: dict) -> dict:
    def added(label: str, pct: str, through: str = "gateway") -> float:
        return ms(runs[f"minimal_{through}_{label}_c1"][pct]
                  - runs[f"minimal_direct_{label}_c1"][pct])

    def versus(ours: float, floor: float) -> float:
        return round(ours / floor, 2) if floor > 0 else float("inf")

    gateway_c32 = runs["minimal_gateway_plain_c32"]
    return {
        "seconds_per_run": SECONDS,
        "added_p50_ms": added("plain", "p50_us"),
        "added_p99_ms": added("plain", "p99_us"),
        "stream_added_p50_ms": added("stream", "p50_us"),
        "stream_added_p99_ms": added("stream", "p99_us"),
        "held_added_p50_ms": ms(runs["minimal_gateway_plain_c1_beside_held"]["p50_us"]
                                - runs["minimal_gateway_plain_c1"]["p50_us"]),
        "held_added_p99_ms": ms(runs["minimal_gateway_plain_c1_beside_held"]["p99_us"]
                                - runs["minimal_gateway_plain_c1"]["p99_us"]),
        "requests_held_at_the_end": still_held,
        "floor_added_p50_ms": added("plain", "p50_us", "floor"),
        "floor_added_p99_ms": added("plain", "p99_us", "floor"),
        "floor_stream_added_p50_ms": added("stream", "p50_us", "floor"),
        "floor_rps": round(runs["minimal_floor_plain_c32"]["rps"]),
        "added_p50_vs_floor": versus(added("plain", "p50_us"), added("plain", "p50_us", "floor")),
        "stream_added_p50_vs_floor": versus(added("stream", "p50_us"),
                                            added("stream", "p50_us", "floor")),
        "added_p99_vs_floor": versus(added("plain", "p99_us"), added("plain", "p99_us", "floor")),
        "rps_vs_floor": round(gateway_c32["rps"] / runs["minimal_floor_plain_c32"]["rps"], 3),
        "messages_added_p50_ms": added("messages", "p50_us"),
        "floor_messages_added_p50_ms": added("messages", "p50_us", "floor"),
        "messages_added_p50_vs_floor": versus(added("messages", "p50_us"),
                                              added("messages", "p50_us", "floor")),
        "embeddings_added_p50_ms": added("embeddings", "p50_us"),
        "floor_embeddings_added_p50_ms": added("embeddings", "p50_us", "floor"),
        "embeddings_added_p50_vs_floor": versus(added("embeddings", "p50_us"),
                                                added("embeddings", "p50_us", "floor")),
        "rps_minimal_upstream": round(gateway_c32["rps"]),
        "rps_minimal_upstream_direct": round(runs["minimal_direct_plain_c32"]["rps"]),
        "gateway_cpu_share_c32": round(gateway_c32["watched_cpu_share"], 3),
        "wrk_cpu_share_c32": round(gateway_c32["wrk_cpu_share"], 3),
        "ratio_vs_direct": round(runs["engine_gateway_plain_c1"]["p50_us"]
                                 / runs["engine_direct_plain_c1"]["p50_us"], 3),
        "stream_ratio_vs_direct": round(runs["engine_gateway_stream_c1"]["p50_us"]
                                        / runs["engine_direct_stream_c1"]["p50_us"], 3),
        "engine_direct_p50_ms": ms(runs["engine_direct_plain_c1"]["p50_us"]),
        "engine_gateway_p50_ms": ms(runs["engine_gateway_plain_c1"]["p50_us"]),
        "peak_rss_mb": round(peak_rss_mb, 1),
        "requests_completed": completed,
        "requests_admitted": admitted,
        "usage_records": records,
        "records_lost": max(0, admitted - records),
        "metered_prompt_tokens": metered["prompt"] or 0,
        "metered_generation_tokens": metered["generation"] or 0,
        "engine_prompt_tokens": int(engine_grew["prompt"]),
        "engine_generation_tokens": int(engine_grew["generation"]),
        "runs": {name: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items()}
                 for name, run in runs.items()},
    }


def report(result: dict) -> None:
    runs = result["runs"]
    print(f"\ngateway (wrk, 1 thread, {result['seconds_per_run']} s per run; "
          f"latencies in ms)")
    print(f"  {'':<36}{'direct p50':>11}{'gateway p50':>12}{'added p50':>10}{'added p99':>10}")
    for label in ("plain", "stream"):
        direct, floor = runs[f"minimal_direct_{label}_c1"], runs[f"minimal_floor_{label}_c1"]
        prefix = "stream_" if label == "stream" else ""
        print(f"  {'the floor, ' + label + ', c=1':<36}{ms(direct['p50_us']):>11.3f}"
              f"{ms(floor['p50_us']):>12.3f}{result['floor_' + prefix + 'added_p50_ms']:>10.3f}"
              + (f"{result['floor_added_p99_ms']:>10.3f}" if label == "plain" else ""))
    for label in ("plain", "stream"):
        direct, through = runs[f"minimal_direct_{label}_c1"], runs[f"minimal_gateway_{label}_c1"]
        prefix = "stream_" if label == "stream" else ""
        print(f"  {'minimal upstream, ' + label + ', c=1':<36}{ms(direct['p50_us']):>11.3f}"
              f"{ms(through['p50_us']):>12.3f}{result[prefix + 'added_p50_ms']:>10.3f}"
              f"{result[prefix + 'added_p99_ms']:>10.3f}   (goal p50 ≤ 1, p99 ≤ 5)")
    for path in ("messages", "embeddings"):
        direct, floor = runs[f"minimal_direct_{path}_c1"], runs[f"minimal_floor_{path}_c1"]
        through = runs[f"minimal_gateway_{path}_c1"]
        print(f"  {'/v1/' + path + ', c=1 (floor, then kvrun)':<36}{ms(direct['p50_us']):>11.3f}"
              f"{ms(floor['p50_us']):>12.3f}{result[f'floor_{path}_added_p50_ms']:>10.3f}")
        print(f"  {'':<36}{'':>11}{ms(through['p50_us']):>12.3f}"
              f"{result[f'{path}_added_p50_ms']:>10.3f}   "
              f"({result[f'{path}_added_p50_vs_floor']} × the floor's; goal ≤ 1.3)")
    beside = runs["minimal_gateway_plain_c1_beside_held"]
    print(f"  {'plain, beside 200 held (+ vs above)':<36}{'':>11}{ms(beside['p50_us']):>12.3f}"
          f"{result['held_added_p50_ms']:>10.3f}{result['held_added_p99_ms']:>10.3f}   "
          f"(goal p50 ≤ 1; {result['requests_held_at_the_end']} of {HELD_REQUESTS} held "
          "throughout, from 50 organisations)")
    print(f"  {'minimal upstream, c=32, req/s':<36}{result['rps_minimal_upstream_direct']:>11,}"
          f"{result['rps_minimal_upstream']:>12,}   (goal ≥ 2,000; gateway used "
          f"{result['gateway_cpu_share_c32']:.0%} of the cores, wrk "
          f"{result['wrk_cpu_share_c32']:.0%}; the floor {result['floor_rps']:,})")
    print(f"  against the floor: added p50 {result['added_p50_vs_floor']} ×, streamed "
          f"{result['stream_added_p50_vs_floor']} × (goal ≤ 1.3), p99 "
          f"{result['added_p99_vs_floor']} × (goal ≤ 1.5), requests a second "
          f"{result['rps_vs_floor']:.0%} (goal ≥ 70%)")
    for label in ("plain", "stream"):
        direct, through = runs[f"engine_direct_{label}_c1"], runs[f"engine_gateway_{label}_c1"]
        ratio = result["ratio_vs_direct" if label == "plain" else "stream_ratio_vs_direct"]
        print(f"  {'vLLM engine, ' + label + ', 16 tokens, c=1':<36}{ms(direct['p50_us']):>11.3f}"
              f"{ms(through['p50_us']):>12.3f}   ratio {ratio:.3f}")
    print(f"  peak RSS of the web process: {result['peak_rss_mb']:.0f} MB")
    print(f"  usage records: {result['usage_records']:,} for {result['requests_admitted']:,} "
          f"requests admitted ({result['requests_completed']:,} completed by wrk); "
          f"lost: {result['records_lost']}")
    print(f"  tokens metered / engine counted: prompt {result['metered_prompt_tokens']:,} / "
          f"{result['engine_prompt_tokens']:,}, generation "
          f"{result['metered_generation_tokens']:,} / {result['engine_generation_tokens']:,}")
    print_goals(result, GOALS)


if __name__ == "__main__":
    sys.exit(main())
