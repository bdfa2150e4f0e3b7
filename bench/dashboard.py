"""`make bench` target `dashboard`: every dashboard page and list API against a small and a
large organisation, side by side in one run.

  small  10 endpoints and 1,000 usage records
  large  1,000 endpoints and 1,000,000 usage records (a tenth in the last hour; one hot
         endpoint with 10,000 of them, the one whose page is measured)

Each page is requested in process (Django's test client: server time, no network) 2 times
to warm up, then REPEATS times; the median is reported with the number of SQL queries, which
must be the same for both organisations (nothing per row). Goal: every page ≤ 100 ms for the
large organisation. Writes bench/results/dashboard.json.
"""

import os
import statistics
import sys
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")
django.setup()

from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import Organization, Scope, User  # noqa: E402
from bench import seed  # noqa: E402
from bench.record import Figure, Goal, print_goals, write  # noqa: E402
from endpoints.models import Endpoint, EndpointEvent, GPUType, ModelSpec, Replica, State  # noqa: E402
from endpoints.services import do_load_catalogs  # noqa: E402
from engine.devices import HostResources  # noqa: E402
from fleet.reports import do_register_node  # noqa: E402

REPEATS = int(os.environ.get("BENCH_REPEATS", "15"))
GOALS = [
    Goal("pages_whose_queries_grow", "pages whose queries grow with the organisation's rows",
         at_most=0),
    Goal("max_page_ms", "slowest page, large organisation, median server time", at_most=100,
         unit="ms", required=False),
]
SHOWN = [Figure("max_queries", "most queries a page makes")]
SIZES = {"small": (10, 1_000), "large": (1_000, 1_000_000)}
HOT_RECORDS = 10_000


def populate(label: str, endpoints: int, records: int, owner: User) -> Organization:
    organization = seed.organization(f"bench {label}", owned_by=owner)
    model = ModelSpec.objects.get(slug="kvrun-demo-tiny")
    cpu = GPUType.objects.get(slug="cpu")
    node = do_register_node(name="bench-cpu", resources=HostResources(
        devices=[], cpu_count=2, memory_bytes=24 * 2**30))
    now = timezone.now()
    rows = Endpoint.objects.bulk_create([
        Endpoint(organization=organization, name=f"e{n:04d}", model=model, context_length=2048,
                 concurrency=8, gpu_type=cpu, gpu_count=1, hourly_price_usd="0.1",
                 state=State.READY, sizing={"explanation": "bench"}) for n in range(endpoints)])
    replicas = Replica.objects.bulk_create([
        Replica(endpoint=endpoint, node=node, state=State.READY, port=20000 + n,
                created_at=now, ready_at=now, log_tail="engine log line\n" * 40)
        for n, endpoint in enumerate(rows)])
    EndpointEvent.objects.bulk_create([
        EndpointEvent(endpoint=endpoint, replica=replica, state=state, message=f"{state} (bench)")
        for endpoint, replica in zip(rows, replicas, strict=True)
        for state in (State.PENDING, State.SCHEDULING, State.STARTING, State.LOADING,
                      State.READY)])
    with connection.cursor() as cursor:
        # In SQL: a million rows through the ORM would take longer than the whole benchmark.
        cursor.execute("""
            INSERT INTO billing_usagerecord (request_id, idempotency_key, organization_id,
                endpoint_id, operation, stream, prompt_tokens, completion_tokens, cached_tokens,
                status_code, error_code, client_disconnected, started_at,
                time_to_first_token_ms, duration_ms, gateway_overhead_ms, adapter, ingested_at)
            SELECT %(label)s || '-' || g, '', %(organization)s,
                   CASE WHEN g <= %(hot)s THEN (%(ids)s::uuid[])[1]
                        ELSE (%(ids)s::uuid[])[1 + g %% %(count)s] END,
                   'chat.completions', true, 100 + g %% 400, 50 + g %% 200, 0,
                   CASE WHEN g %% 50 = 0 THEN 500 ELSE 200 END, '', false,
                   now() - CASE WHEN g <= %(hot)s OR g %% 10 = 0
                                THEN (g %% 3600) * interval '1 second'
                                ELSE (g %% 2592000) * interval '1 second' END,
                   20 + g %% 300, 500 + g %% 2000, 0.300, '', now()
            FROM generate_series(1, %(records)s) AS g
        """, {"label": label, "organization": organization.id, "ids": [e.id for e in rows],
              "count": len(rows), "records": records, "hot": min(HOT_RECORDS, records // 10)})
        cursor.execute("ANALYZE billing_usagerecord")
    return organization


def pages(organization: Organization, hot: str, last_page: int) -> dict[str, tuple]:
    """name → (method, path, data)."""
    org = f"/orgs/{organization.slug}"
    api = f"/api/v1/organizations/{organization.slug}"
    sizing = {"model": "kvrun-demo-tiny", "context_length": "2048", "concurrency": "8",
              "kv_cache_dtype": "auto", "prefix_caching": "on"}
    return {
        "endpoints list": ("get", f"{org}/", None),
        "endpoints list, last page": ("get", f"{org}/?page={last_page}", None),
        "create wizard": ("get", f"{org}/endpoints/new/", None),
        "live sizing": ("post", f"{org}/endpoints/new/sizing/", sizing),
        "endpoint page": ("get", f"{org}/endpoints/{hot}/", None),
        "endpoint status (2 s poll)": ("get", f"{org}/endpoints/{hot}/status/", None),
        "endpoint charts' data": ("get", f"{org}/endpoints/{hot}/usage/", None),
        "playground": ("get", f"{org}/endpoints/{hot}/playground/", None),
        "API keys": ("get", f"{org}/keys/", None),
        "members": ("get", f"{org}/members/", None),
        "API: endpoints": ("api", f"{api}/endpoints/", None),
        "API: endpoint events": ("api", f"{api}/endpoints/{hot}/events/", None),
        "API: api keys": ("api", f"{api}/api-keys/", None),
        "API: members": ("api", f"{api}/members/", None),
        "API: invites": ("api", f"{api}/invites/", None),
        "API: organisations": ("api", "/api/v1/organizations/", None),
        "API: models": ("api", "/api/v1/models/", None),
        "API: GPU types": ("api", "/api/v1/gpu-types/", None),
        "console: usage records": ("get", "/admin/billing/usagerecord/", None),
        "console: endpoints": ("get", "/admin/endpoints/endpoint/", None),
    }


def measure(client: Client, method: str, path: str, data: dict | None,
            secret: str) -> tuple[float, int]:
    def once() -> tuple[float, int, int]:
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            if method == "post":
                response = client.post(path, data)
            elif method == "api":
                response = client.get(path, HTTP_AUTHORIZATION=f"Bearer {secret}")
            else:
                response = client.get(path)
            elapsed = (time.perf_counter() - started) * 1000
        return elapsed, len(queries), response.status_code

    for _ in range(2):
        _, _, status = once()
        assert status == 200, f"{path} answered {status}"
    runs = [once() for _ in range(REPEATS)]
    return statistics.median(run[0] for run in runs), max(run[1] for run in runs)


def main() -> int:
    do_load_catalogs()
    owner = User.objects.create_superuser(email="bench@example.com", password=None)
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(owner)
    figures: dict[str, dict[str, dict]] = {}
    for label, (endpoints, records) in SIZES.items():
        started = time.monotonic()
        organization = populate(label, endpoints, records, owner)
        print(f"seeded {label}: {endpoints:,} endpoints, {records:,} usage records "
              f"in {time.monotonic() - started:.0f} s", flush=True)
        _, secret = seed.key(organization, scope=Scope.MANAGE)
        for name, (method, path, data) in pages(organization, "e0000",
                                                last_page=max(1, endpoints // 50)).items():
            median, queries = measure(client, method, path, data, secret)
            figures.setdefault(name, {})[label] = {"ms": round(median, 2), "queries": queries}
    result = summarise(figures)
    met = write("dashboard", result, goals=GOALS, shown=SHOWN)
    report(result)
    return 0 if met else 1


def summarise(figures: dict[str, dict[str, dict]]) -> dict:
    rows = {name: {**sizes, "ratio": round(sizes["large"]["ms"] / sizes["small"]["ms"], 2)}
            for name, sizes in figures.items()}
    return {
        "repeats": REPEATS,
        "large": {"endpoints": SIZES["large"][0], "usage_records": SIZES["large"][1]},
        "small": {"endpoints": SIZES["small"][0], "usage_records": SIZES["small"][1]},
        "max_page_ms": max(row["large"]["ms"] for row in rows.values()),
        "max_queries": max(row["large"]["queries"] for row in rows.values()),
        "queries_grow": [name for name, row in rows.items()
                         if row["large"]["queries"] > row["small"]["queries"]],
        "pages_whose_queries_grow": sum(row["large"]["queries"] > row["small"]["queries"]
                                        for row in rows.values()),
        "pages": rows,
    }


def report(result: dict) -> None:
    print(f"\ndashboard (median of {result['repeats']} requests, server time; small = "
          f"{result['small']['endpoints']:,} endpoints / {result['small']['usage_records']:,} "
          f"records, large = {result['large']['endpoints']:,} / "
          f"{result['large']['usage_records']:,})")
    print(f"  {'page':<30}{'small ms':>10}{'large ms':>10}{'ratio':>8}{'queries':>9}")
    for name, row in result["pages"].items():
        small, large = row["small"]["queries"], row["large"]["queries"]
        queries = f"{large}" if large == small else f"{small}→{large}"
        print(f"  {name:<30}{row['small']['ms']:>10.1f}{row['large']['ms']:>10.1f}"
              f"{row['ratio']:>8.2f}{queries:>9}")
    print(f"  most queries {result['max_queries']}; queries that grow with rows: "
          f"{', '.join(result['queries_grow']) or 'none'}")
    print_goals(result, GOALS)


if __name__ == "__main__":
    sys.exit(main())
