"""The autoscaler's decisions. Each is made from the rows, the engines' samples and the
gateways' activity, and carried out through endpoints' conditional updates, so any number of
workers deciding at once make one change and one event."""

import math
from datetime import datetime, timedelta
from functools import partial
from statistics import fmean
from uuid import UUID

from django.db.models import Max
from django.db.models.functions import Greatest

from endpoints.models import DesiredState, Endpoint, ScalingMetric, State
from endpoints.selectors import unended_replicas
from endpoints.services import do_autoscale_endpoint, do_scale_endpoint_to_zero
from kvrun.common.units import duration_text
from scaling.activity import activity_of, record_in_flight
from scaling.selectors import replica_to_remove, signal_over


def do_autoscale_endpoints(*, now: datetime) -> int:
    """One pass of the autoscaler over every running endpoint: keep a reading of its
    requests in flight, then decide. Returns how many endpoints it changed."""
    do_record_in_flight(now=now)
    return do_scale_idle_endpoints_to_zero(now=now) + do_scale_endpoints_on_signals(now=now)


def do_record_in_flight(*, now: datetime) -> None:
    """Read the requests in flight across the gateways of every running endpoint that scales
    on them (more than one replica allowed), kept for its longest window."""
    windows = dict(Endpoint.objects.filter(deleted_at=None, desired_state=DesiredState.RUNNING,
                                           max_replicas__gt=1,
                                           scaling_metric=ScalingMetric.IN_FLIGHT)
                   .values_list("id", Greatest("scale_up_window_seconds",
                                               "scale_down_window_seconds")))
    activity = activity_of(endpoint_ids=list(windows), now=now)
    record_in_flight(readings={endpoint_id: (seen.in_flight, windows[endpoint_id] + 60)
                               for endpoint_id, seen in activity.items()}, now=now)


def do_scale_endpoints_on_signals(*, now: datetime) -> int:
    """Add replicas to an endpoint whose metric per replica stayed above its target through
    the up window, as many as bring it to the target (at most max_replicas); remove one from
    an endpoint whose load, through the down window, would have stayed at or under the target
    on one replica fewer (never below min_replicas, nor below one: zero is the idle rule's):
    the replica that is least busy (scaling.selectors.replica_to_remove). Only endpoints
    whose replicas are all ready are judged, each direction a window after the last change.
    Returns how many it changed."""
    endpoints = (Endpoint.objects
                 .filter(deleted_at=None, desired_state=DesiredState.RUNNING,
                         desired_replicas__gt=0, max_replicas__gt=1)
                 .exclude(state=State.FAILED)
                 .prefetch_related(unended_replicas()))
    scaled = 0
    for endpoint in endpoints:
        live = list(endpoint.replicas.all())
        if len(live) != endpoint.desired_replicas or any(
                replica.state != State.READY or replica.policy_version != endpoint.policy_version
                for replica in live):
            continue  # starting, stopping or rolling: judged once it has settled
        decision = _decide(endpoint, [replica.id for replica in live], now=now)
        if decision is None:
            continue
        to_replicas, reason = decision
        stopped = None
        if to_replicas < endpoint.desired_replicas:
            stopped, busy = replica_to_remove(
                replicas=live, since=now - timedelta(seconds=endpoint.scale_down_window_seconds))
            reason += (f"; replica {str(stopped.id)[:8]} stops, the one with the fewest "
                       f"requests running or waiting in its engine's last sample "
                       f"({'not read yet' if busy is None else busy}), drained first")
        scaled += do_autoscale_endpoint(
            endpoint_id=endpoint.id, replicas=endpoint.desired_replicas, to_replicas=to_replicas,
            reason=reason, policy_version=endpoint.policy_version,
            stop_replica_id=stopped.id if stopped else None)
    return scaled


def _decide(endpoint: Endpoint, replica_ids: list, *, now: datetime) -> tuple[int, str] | None:
    """The endpoint's new replica count and why, or None to leave it. "Stays above" is judged
    on each third of the window (its mean), so that a reading caught between two requests
    does not reset a load that is there, nor one spike hold a load that has gone."""
    current, target = endpoint.desired_replicas, endpoint.target
    metric = ScalingMetric(endpoint.scaling_metric)
    what = f"{metric.label} per replica"

    def thirds_over(seconds: int) -> list[float] | None:
        if endpoint.last_scaled_at and now - endpoint.last_scaled_at < timedelta(seconds=seconds):
            return None  # a window after the last change
        values = signal_over(endpoint_id=endpoint.id, replica_ids=replica_ids, metric=metric,
                             since=now - timedelta(seconds=seconds), until=now)
        if not values or len(values) < 3:
            return None
        size = len(values) / 3
        return [fmean(values[round(n * size):round((n + 1) * size)]) for n in range(3)]

    up = endpoint.scale_up_window_seconds
    if current < endpoint.max_replicas and (thirds := thirds_over(up)) and min(thirds) > target:
        wanted = min(endpoint.max_replicas,
                     max(current + 1, math.ceil(current * fmean(thirds) / target)))
        return wanted, (
            f"scaling up from {current} to {wanted} replica(s): {what} stayed above its target "
            f"of {target:g} through the last {up} s (each third's mean: {_shown(thirds)}); "
            f"max_replicas is {endpoint.max_replicas}")
    down = endpoint.scale_down_window_seconds
    fits = target * (current - 1) / current
    if current > max(1, endpoint.min_replicas) and (thirds := thirds_over(down)) and (
            max(thirds) <= fits):
        return current - 1, (
            f"scaling down from {current} to {current - 1} replica(s): {what} stayed at or under "
            f"{fits:.1f} through the last {down} s (each third's mean: {_shown(thirds)}), so one "
            f"replica fewer keeps it under the target of {target:g}")
    return None


def _shown(values: list[float]) -> str:
    return ", ".join(f"{value:.1f}" for value in values)


def do_scale_idle_endpoints_to_zero(*, now: datetime) -> int:
    """Scale to zero every endpoint that may (min_replicas 0) and has had no request for its
    idle time, counted from its last request's end or, where none is known, from when its last
    replica became ready; never one with a request in flight. Returns how many it scaled."""
    candidates = list(
        Endpoint.objects.filter(deleted_at=None, desired_state=DesiredState.RUNNING,
                                min_replicas=0, desired_replicas__gt=0)
        .exclude(state=State.FAILED).annotate(last_ready_at=Max("replicas__ready_at")))
    activity = activity_of(endpoint_ids=[endpoint.id for endpoint in candidates], now=now)
    scaled = 0
    for endpoint in candidates:
        seen = activity[endpoint.id]
        since = max((at for at in (seen.last_request_at, endpoint.last_ready_at) if at),
                    default=None)
        if seen.in_flight or since is None:  # busy, or still starting its first replica
            continue
        idle = (now - since).total_seconds()
        wanted = endpoint.scale_to_zero_after_seconds
        if idle < wanted:
            continue
        reason = (f"no request for {duration_text(idle)} and none in flight (its idle time is "
                  f"{duration_text(wanted)}); stopping its {endpoint.desired_replicas} "
                  "replica(s). The next request wakes it.")
        scaled += do_scale_endpoint_to_zero(
            endpoint_id=endpoint.id, replicas=endpoint.desired_replicas, reason=reason,
            still_idle=partial(_still_idle, endpoint.id, since=since, now=now))
    return scaled


def _still_idle(endpoint_id: UUID, *, since: datetime, now: datetime) -> bool:
    """No request in flight at `now`, and none since `since`: read again."""
    seen = activity_of(endpoint_ids=[endpoint_id], now=now)[endpoint_id]
    return not seen.in_flight and (seen.last_request_at is None
                                   or seen.last_request_at <= since)

