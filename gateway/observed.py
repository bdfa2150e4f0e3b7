"""The gateway's own Prometheus metrics, kept in this process (kvrun's /metrics exposes them
beside the engines' figures): its overhead and the time to first token per endpoint, and
requests by status. Observing costs about a microsecond a request."""

from prometheus_client import Counter, Histogram

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


def observe(exchange: Exchange) -> None:
    """Record a finished request that reached an endpoint."""
    route = exchange.route
    if route is None:
        return
    labels = (route.organization_slug, route.name)
    OVERHEAD.labels(*labels).observe(exchange.overhead_ms() / 1000)
    if exchange.ttft_ms is not None:
        TIME_TO_FIRST_TOKEN.labels(*labels).observe(exchange.ttft_ms / 1000)
    REQUESTS.labels(*labels, str(exchange.status)).inc()
