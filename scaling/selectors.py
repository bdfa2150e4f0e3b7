"""What the autoscaler reads. Its signal: an endpoint's metric per ready replica over a
window. Requests in flight are the gateways' (scaling.activity), as the autoscaler read them at
each pass; waiting requests and KV cache usage are the engines' (telemetry), one value per
scrape period. And on scaling down, which replica to stop."""

import math
from collections import defaultdict
from datetime import datetime, timedelta
from statistics import fmean
from uuid import UUID

from django.conf import settings

from endpoints.models import Replica, ScalingMetric
from scaling.activity import in_flight_readings
from telemetry.models import EngineSample


def signal_over(*, endpoint_id: UUID, replica_ids: list[UUID], metric: str, since: datetime,
                until: datetime) -> list[float] | None:
    """The metric per replica over the window from `since` to `until`, oldest first. None
    when the readings do not cover the window (an autoscaler or an agent gone quiet, a
    replica not read since its start): no decision is made on part of one."""
    if metric == ScalingMetric.IN_FLIGHT:
        return _in_flight_over(endpoint_id=endpoint_id, replicas=len(replica_ids), since=since,
                               until=until)
    return _engine_metric_over(endpoint_id=endpoint_id, replica_ids=replica_ids, metric=metric,
                               since=since, until=until)


def _in_flight_over(*, endpoint_id: UUID, replicas: int, since: datetime, until: datetime
                    ) -> list[float] | None:
    """The gateways' requests in flight per replica at each autoscaler pass."""
    readings = in_flight_readings(endpoint_id=endpoint_id, since=since, until=until)
    gap = timedelta(seconds=3 * settings.KVRUN_AUTOSCALE_SECONDS)
    times = [since, *(at for at, _ in readings), until]
    if not readings or any(later - earlier > gap
                           for earlier, later in zip(times, times[1:], strict=False)):
        return None
    return [in_flight / replicas for _, in_flight in readings]


def _engine_metric_over(*, endpoint_id: UUID, replica_ids: list[UUID], metric: str,
                        since: datetime, until: datetime) -> list[float] | None:
    """Each scrape period's mean over the replicas of each one's mean in the period (KV
    usage in %); a replica not read in a period counts with its last value."""
    scrape = settings.KVRUN_ENGINE_SCRAPE_SECONDS
    periods = math.floor((until - since).total_seconds() / scrape)
    samples = (EngineSample.objects
               .filter(endpoint_id=endpoint_id, replica_id__in=replica_ids, at__gte=since,
                       at__lte=until, resolution_seconds=0)
               .values_list("at", "replica_id", "waiting", "kv_cache_usage"))
    read: dict[UUID, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for at, replica_id, waiting, usage in samples:
        value = waiting if metric == ScalingMetric.WAITING else usage * 100
        read[replica_id][min(periods - 1, int((at - since).total_seconds() // scrape))].append(
            value)
    # Each replica read in the window's first two periods and its last two.
    if periods < 2 or any(
            not {0, 1} & set(read[replica_id]) or not {periods - 2, periods - 1} & set(
                read[replica_id]) for replica_id in replica_ids):
        return None
    values = []
    last = {replica_id: fmean(read[replica_id][min(read[replica_id])])
            for replica_id in replica_ids}
    for period in range(periods):
        for replica_id in replica_ids:
            if period in read[replica_id]:
                last[replica_id] = fmean(read[replica_id][period])
        values.append(sum(last.values()) / len(replica_ids))
    return values


def replica_to_remove(*, replicas: list[Replica], since: datetime
                      ) -> tuple[Replica, int | None]:
    """Of an endpoint's ready replicas, the one to stop when it scales down, and its requests
    running or waiting (None if its engine was not read since `since`): the fewest in its
    engine's last sample, since it drains soonest and cuts least; among equals the newest,
    whose cache has had the least time to warm. A replica not read since comes last."""
    busy = {replica_id: running + waiting for replica_id, running, waiting in (
        EngineSample.objects
        .filter(replica_id__in=[replica.id for replica in replicas], resolution_seconds=0,
                at__gte=since)
        .order_by("replica_id", "-at").distinct("replica_id")
        .values_list("replica_id", "running", "waiting"))}
    chosen = min(replicas, key=lambda replica: (
        replica.id not in busy, busy.get(replica.id, 0), -replica.created_at.timestamp()))
    return chosen, busy.get(chosen.id)
