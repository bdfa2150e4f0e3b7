"""The gateway's own Prometheus metrics, kept in this process (kvrun's /metrics exposes them
beside the engines' figures): its overhead and the time to first token per endpoint,
requests by status, the requests in flight to each replica, the requests held for a cold
start and the requests prefix affinity spilled past their replica. Observing costs about a
microsecond a request.

Each web process counts its own: a scrape of several sums them (`sum by (endpoint, replica)`
of the in-flight gauge; `rate` of the counters, summed). Routing, and so its load bound, is
per process too.
"""

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.directory import Directory
from gateway.exchange import Exchange

OVERHEAD = Histogram(
    "kvrun_gateway_overhead_seconds",
    "The gateway's own time per request: all but waiting on the engine and the client.",
    ["organization", "endpoint"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
TIME_TO_FIRST_TOKEN = Histogram(
    "kvrun_gateway_time_to_first_token_seconds",
    "From the request's arrival to its first token, as the client sees it.",
    ["organization", "endpoint"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
REQUESTS = Counter("kvrun_gateway_requests", "Finished requests by status.",
                   ["organization", "endpoint", "status"])
HELD = Gauge("kvrun_gateway_requests_held",
             "Requests this web process holds for endpoints starting from zero.")
SPILLS = Counter("kvrun_gateway_affinity_spills",
                 "Requests that prefix affinity sent past their prefix's replica, which was at "
                 "its load bound.", ["organization", "endpoint"])


class InFlight:
    """Requests in flight to each replica the gateways of this process know, as they count
    them (one gateway in a web process; tests start several)."""

    def __init__(self) -> None:
        self.directories: set[Directory] = set()

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("kvrun_gateway_replica_requests_in_flight",
                                  "Requests this web process has in flight to the replica.",
                                  labels=["organization", "endpoint", "replica"])
        counts: dict[tuple[str, str, str], int] = {}
        for directory in list(self.directories):
            # An adapter's route shares its endpoint's upstreams and their counts.
            for route in directory.known_routes():
                if route.adapter:
                    continue
                for upstream in route.upstreams:
                    labels = (route.organization_slug, route.name, upstream.replica_id)
                    counts[labels] = counts.get(labels, 0) + upstream.in_flight
        for labels, count in counts.items():
            gauge.add_metric(list(labels), count)
        yield gauge


IN_FLIGHT = InFlight()
REGISTRY.register(IN_FLIGHT)


def observe(exchange: Exchange) -> None:
    """Record a finished request that reached an endpoint."""
    route = exchange.route
    if route is None:
        return
    labels = (route.organization_slug, route.endpoint_name)
    OVERHEAD.labels(*labels).observe(exchange.overhead_ms() / 1000)
    if exchange.ttft_ms is not None:
        TIME_TO_FIRST_TOKEN.labels(*labels).observe(exchange.ttft_ms / 1000)
    REQUESTS.labels(*labels, str(exchange.status)).inc()
