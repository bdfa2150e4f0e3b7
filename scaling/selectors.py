"""The autoscaler's signal: an endpoint's metric per ready replica over a window, from the
engines' samples (telemetry), one value per scrape period."""

import math
from collections import defaultdict
from datetime import datetime
from uuid import UUID

from django.conf import settings

from endpoints.models import ScalingMetric
from telemetry.models import EngineSample


def signal_over(*, endpoint_id: UUID, replica_ids: list[UUID], metric: str, since: datetime,
                until: datetime) -> list[float] | None:
    """The metric per replica in each scrape period from `since` to `until`: the mean over
    the replicas of each one's mean in the period (KV usage in %). A replica not read in a
    period counts with its last value. None when the samples do not
    cover the window (a replica not read since its start, an agent gone quiet): no decision
    is made on part of one."""
    scrape = settings.KVRUN_ENGINE_SCRAPE_SECONDS
    periods = math.floor((until - since).total_seconds() / scrape)
    samples = (EngineSample.objects
               .filter(endpoint_id=endpoint_id, replica_id__in=replica_ids, at__gte=since,
                       at__lte=until, resolution_seconds=0)
               .values_list("at", "replica_id", "running", "waiting", "kv_cache_usage"))
    read: dict[UUID, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for at, replica_id, running, waiting, usage in samples:
        value = {ScalingMetric.IN_FLIGHT: running + waiting, ScalingMetric.WAITING: waiting,
                 ScalingMetric.KV_CACHE_USAGE: usage * 100}[metric]
        read[replica_id][min(periods - 1, int((at - since).total_seconds() // scrape))].append(
            value)
    # Each replica read in the window's first two periods and its last two.
    if periods < 2 or any(
            not {0, 1} & set(read[replica_id]) or not {periods - 2, periods - 1} & set(
                read[replica_id]) for replica_id in replica_ids):
        return None
    values = []
    last = {replica_id: _mean(read[replica_id][min(read[replica_id])])
            for replica_id in replica_ids}
    for period in range(periods):
        for replica_id in replica_ids:
            if period in read[replica_id]:
                last[replica_id] = _mean(read[replica_id][period])
        values.append(sum(last.values()) / len(replica_ids))
    return values


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
