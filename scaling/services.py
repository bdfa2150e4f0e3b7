"""The autoscaler's decisions. Each is made from the rows and the gateways' activity, and
carried out through endpoints' conditional updates, so any number of workers deciding at once
make one change and one event."""

from datetime import datetime, timedelta

from django.db.models import Max

from endpoints.models import DesiredState, Endpoint, State
from endpoints.services import do_scale_endpoint_to_zero
from scaling.activity import activity_of


def do_scale_idle_endpoints_to_zero(*, now: datetime) -> int:
    """Scale to zero every endpoint that may (min_replicas 0) and has had no request for its
    idle time, counted from its last request or, where none is known, from when its last
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
        idle = now - since
        wanted = timedelta(seconds=endpoint.scale_to_zero_after_seconds)
        if idle < wanted:
            continue
        reason = (f"no request for {_duration(idle)} and none in flight (its idle time is "
                  f"{_duration(wanted)}); stopping its {endpoint.desired_replicas} "
                  "replica(s). The next request wakes it.")
        scaled += do_scale_endpoint_to_zero(endpoint_id=endpoint.id,
                                            replicas=endpoint.desired_replicas, reason=reason)
    return scaled


def _duration(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"
