"""Which endpoints are being asked for, across every web process.

The gateway's admission script (gateway.limits) writes it in Redis with the request's other
holds, in the same round trip; the autoscaler reads it. Per endpoint: a sorted set of its
requests in flight (request id → last renewal, ms), where a slot not renewed for a lease
belongs to a web process that died and no longer counts, and the time of its last request
(set when it is let in, and again when it ends).
The autoscaler keeps what it read of the requests in flight at each pass, for as long as its
longest window, so that a decision rests on the whole window, not one reading.
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from uuid import UUID

from django.conf import settings

from kvrun.common.redis import redis_client

# The last request's time outlives any idle time a user sets; an endpoint deleted leaves its
# keys to expire.
LAST_REQUEST_TTL_MS = 30 * 24 * 3600 * 1000


def in_flight_name(endpoint_id: object) -> str:
    return f"kvrun:endpoint:{endpoint_id}:inflight"


def last_request_name(endpoint_id: object) -> str:
    return f"kvrun:endpoint:{endpoint_id}:last"


def readings_name(endpoint_id: object) -> str:
    return f"kvrun:endpoint:{endpoint_id}:readings"


@dataclass(frozen=True)
class Activity:
    in_flight: int
    last_request_at: datetime | None


def activity_of(*, endpoint_ids: list[UUID], now: datetime) -> dict[UUID, Activity]:
    """Each endpoint's requests in flight now and its last request's time, in one round trip."""
    now_ms = int(now.timestamp() * 1000)
    oldest = now_ms - int(settings.KVRUN_GATEWAY_LEASE_SECONDS * 1000)
    with redis_client().pipeline(transaction=False) as pipe:
        for endpoint_id in endpoint_ids:
            pipe.zcount(in_flight_name(endpoint_id), oldest, "+inf")
            pipe.get(last_request_name(endpoint_id))
        answers = pipe.execute()
    found = {}
    for index, endpoint_id in enumerate(endpoint_ids):
        in_flight, last = answers[2 * index], answers[2 * index + 1]
        found[endpoint_id] = Activity(
            in_flight=int(in_flight),
            last_request_at=datetime.fromtimestamp(int(last) / 1000, UTC) if last else None)
    return found


def record_in_flight(*, readings: dict[UUID, tuple[int, int]], now: datetime) -> None:
    """Keep each endpoint's requests in flight now (endpoint → (in flight, seconds to keep))
    as a reading, dropping those older than it keeps; several autoscalers at once each add
    theirs, which say the same."""
    now_ms = int(now.timestamp() * 1000)
    with redis_client().pipeline(transaction=False) as pipe:
        for endpoint_id, (in_flight, kept_seconds) in readings.items():
            name = readings_name(endpoint_id)
            pipe.zadd(name, {f"{now_ms}:{in_flight}": now_ms})
            pipe.zremrangebyscore(name, "-inf", now_ms - kept_seconds * 1000)
            pipe.pexpire(name, kept_seconds * 1000)
        pipe.execute()


def in_flight_readings(*, endpoint_id: UUID, since: datetime, until: datetime
                       ) -> list[tuple[datetime, int]]:
    """The readings kept between `since` and `until`, oldest first: (when, in flight)."""
    found = redis_client().zrangebyscore(readings_name(endpoint_id),
                                         int(since.timestamp() * 1000),
                                         int(until.timestamp() * 1000))
    readings = []
    for member in found:
        at, count = member.decode().split(":")
        readings.append((datetime.fromtimestamp(int(at) / 1000, UTC), int(count)))
    return readings
