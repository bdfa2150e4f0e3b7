"""kvrun's own Prometheus exposition, at /metrics: what this process keeps (the gateway's
latency histograms and request counts, Python's own), per-endpoint and per-replica figures
from the engines' latest samples, how far usage ingestion lags behind the gateways, and how
far the billing rollup lags behind the ledger.

Engine counters are exposed per replica, as the engines keep them, so that `rate()` sees a
restart as a reset of one series; gauges are summed (requests) or maxed (cache usage) per
endpoint. A replica not sampled for FRESH is left out.
"""

import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import timedelta

from django.db import connection
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.exceptions import RedisError

from billing.selectors import rollup_lag
from billing.usage_stream import STREAM
from kvrun.common.redis import redis_client

FRESH = timedelta(minutes=2)
COUNTERS = {"prefix_queries": "prefix_cache_queries", "prefix_hits": "prefix_cache_hits",
            "external_queries": "tier_cache_queries", "external_hits": "tier_cache_hits",
            "preemptions": "preemptions", "prompt_tokens": "prompt_tokens",
            "generation_tokens": "generation_tokens", "requests": "requests"}
LATEST = f"""
    SELECT DISTINCT ON (sample.replica_id) organization.slug, endpoint.name,
           sample.replica_id::text, sample.kv_cache_usage, sample.running, sample.waiting,
           {", ".join(f"sample.{column}" for column in COUNTERS)}
    FROM telemetry_enginesample sample
    JOIN endpoints_endpoint endpoint ON endpoint.id = sample.endpoint_id
    JOIN accounts_organization organization ON organization.id = endpoint.organization_id
    WHERE sample.resolution_seconds = 0 AND sample.at >= now() - %s
      AND endpoint.deleted_at IS NULL
    ORDER BY sample.replica_id, sample.at DESC"""


class EngineCollector:
    def collect(self) -> Iterator[Metric]:
        with connection.cursor() as cursor:
            cursor.execute(LATEST, [FRESH])
            rows = cursor.fetchall()
        endpoint_labels = ["organization", "endpoint"]
        usage = GaugeMetricFamily("kvrun_endpoint_kv_cache_usage_ratio",
                                  "The fullest replica's share of KV cache blocks in use.",
                                  labels=endpoint_labels)
        running = GaugeMetricFamily("kvrun_endpoint_requests_running",
                                    "Requests the endpoint's engines run now.",
                                    labels=endpoint_labels)
        waiting = GaugeMetricFamily("kvrun_endpoint_requests_waiting",
                                    "Requests waiting in the endpoint's engines.",
                                    labels=endpoint_labels)
        replicas = GaugeMetricFamily("kvrun_endpoint_replicas_sampled",
                                     "Replicas with a recent engine sample.",
                                     labels=endpoint_labels)
        counters = {column: CounterMetricFamily(
            f"kvrun_replica_{name}", f"The engine's {name.replace('_', ' ')}, since it started.",
            labels=[*endpoint_labels, "replica"]) for column, name in COUNTERS.items()}
        by_endpoint: dict[tuple[str, str], list] = defaultdict(list)
        for organization, endpoint, replica, kv_usage, run, wait, *values in rows:
            by_endpoint[(organization, endpoint)].append((kv_usage, run, wait))
            for column, value in zip(COUNTERS, values, strict=True):
                if value is not None:
                    counters[column].add_metric([organization, endpoint, replica], value)
        for labels, states in by_endpoint.items():
            usage.add_metric(list(labels), max(state[0] for state in states))
            running.add_metric(list(labels), sum(state[1] for state in states))
            waiting.add_metric(list(labels), sum(state[2] for state in states))
            replicas.add_metric(list(labels), len(states))
        yield from (usage, running, waiting, replicas, *counters.values())
        yield from _ingestion()
        yield from _rollup()


def _ingestion() -> Iterator[Metric]:
    """The usage stream's backlog: the gateways' records the worker has not stored yet."""
    try:
        client = redis_client()
        length = client.xlen(STREAM)
        oldest = client.xrange(STREAM, count=1)
    except RedisError:
        return
    lag = 0.0
    if oldest:
        milliseconds = int(oldest[0][0].decode().split("-")[0])
        lag = max(0.0, time.time() - milliseconds / 1000)
    yield GaugeMetricFamily("kvrun_usage_stream_length",
                            "Usage records waiting in Redis for the worker.", value=length)
    yield GaugeMetricFamily("kvrun_usage_ingestion_lag_seconds",
                            "How long the oldest waiting usage record has waited.", value=lag)


def _rollup() -> Iterator[Metric]:
    """The token rollup's backlog: endpoint-hours whose records are not in the hourly lines."""
    lag = rollup_lag()
    yield GaugeMetricFamily("kvrun_billing_stale_hours",
                            "Endpoint-hours with usage records not yet rolled up.",
                            value=lag.stale_hours)
    yield GaugeMetricFamily("kvrun_billing_rollup_lag_seconds",
                            "How long the longest-waiting stale hour has waited for the "
                            "rollup.", value=lag.lag_seconds())
    yield GaugeMetricFamily("kvrun_billing_oldest_stale_hour_timestamp_seconds",
                            "The start of the earliest stale hour (Unix time); 0 when none.",
                            value=lag.oldest_hour.timestamp() if lag.oldest_hour else 0)
    yield GaugeMetricFamily("kvrun_billing_rollup_batch_hours",
                            "Stale hours the rollup takes a batch (halved after a timeout).",
                            value=lag.batch_hours)


def exposition() -> bytes:
    """This process's metrics, then the database's and Redis's."""
    database = CollectorRegistry(auto_describe=False)
    database.register(EngineCollector())
    return generate_latest(REGISTRY) + generate_latest(database)
