"""Hourly rollups of the billing ledger, in UTC hours: tokens per endpoint and API key from
usage records (TokenHour), device-seconds per endpoint, GPU type and phase from replica
intervals (GPUHour).

Both rewrite whole hours from the ledger, so a run repeated gives the same lines, and both
only touch hours with new activity. Token hours are marked stale by the ingester in the
transaction that stores their records (StaleUsageHour). GPU hours are rewritten from an hour
before the latest line on: that covers every interval still open, and intervals closed late
(a lost node's replicas close at its last heartbeat, up to a few minutes back); an hour is
settled an hour after the latest line has moved past it.
"""

import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from billing.models import StaleUsageHour

# One run at a time across workers; another that finds it held leaves the work to it.
ROLLUP_LOCK = zlib.crc32(b"kvrun.billing.rollup")
GPU_SETTLE = timedelta(hours=1)
# Where a GPU type's first price version starts: before anything kvrun can have billed.
FIRST_PRICE_FROM = datetime(2000, 1, 1, tzinfo=UTC)
# An index range scan per stale hour costs about as much as reading this many records in one
# pass (measured on the embedded PostgreSQL: 40 µs against 0.35 µs a row).
RECORDS_PER_INDEXED_HOUR = 100


@dataclass(frozen=True)
class Rollup:
    token_hours: int  # endpoint-hours rewritten
    gpu_hours: int  # lines written
    token_seconds: float  # how long each part took
    gpu_seconds: float


def do_roll_up_usage(*, now: datetime | None = None) -> Rollup | None:
    """Bring TokenHour and GPUHour up to date with the ledger as of `now`, in one transaction.

    Open intervals count until `now` (by default, now), so the current hour's lines grow from
    run to run. Lines written are stamped with the database's time once the lock is held, so
    a finalised invoice sees every line stamped before it (lock_rollups).
    Returns None, doing nothing, when another run or a finalisation holds the lock: the totals
    are the same.
    """
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [ROLLUP_LOCK])
        if not cursor.fetchone()[0]:
            return None
        # A first run, or one after a long stop, aggregates millions of rows: in memory.
        cursor.execute("SET LOCAL work_mem = '256MB'")
        started = _database_time(cursor)
        do_write_down_list_prices()
        clock = time.perf_counter()
        token_hours = _roll_up_tokens(cursor, started)
        tokens_done = time.perf_counter()
        gpu_hours = _roll_up_gpu_time(cursor, now or timezone.now(), started)
        return Rollup(token_hours=token_hours, gpu_hours=gpu_hours,
                      token_seconds=tokens_done - clock,
                      gpu_seconds=time.perf_counter() - tokens_done)


def lock_rollups() -> datetime:
    """Wait for a running rollup, then keep rollups out until the current transaction ends.
    Returns the time then, as rollups stamp their lines: by the database's clock, the one
    clock every worker shares."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ROLLUP_LOCK])
        return _database_time(cursor)


def _database_time(cursor: object) -> datetime:
    cursor.execute("SELECT clock_timestamp()")
    return cursor.fetchone()[0]


def mark_stale_hours(*, records: Iterable[tuple[object, datetime]]) -> None:
    """Mark the hours of (endpoint id, started_at) records for the next token rollup. Call it
    in the transaction that stores them: the upsert waits for a rollup that is rewriting the
    hour, so records it could not see are rolled up by the next one."""
    hours = sorted({(endpoint_id, hour_of(started_at))
                    for endpoint_id, started_at in records})
    StaleUsageHour.objects.bulk_create(
        [StaleUsageHour(endpoint_id=endpoint_id, hour=hour, marked_at=timezone.now())
         for endpoint_id, hour in hours],
        update_conflicts=True, unique_fields=["endpoint", "hour"], update_fields=["marked_at"])


def hour_of(moment: datetime) -> datetime:
    """The start of the UTC hour that `moment` falls in."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


# The lines of the stale hours, in the columns of billing_tokenhour. `date_bin` from a UTC
# midnight gives the UTC hour as `date_trunc('hour', started_at, 'UTC')` does, by arithmetic
# alone: a third faster over a million records.
LINE_COLUMNS = """record.organization_id, record.endpoint_id, record.api_key_id, count(*),
    sum(record.prompt_tokens), sum(record.completion_tokens), sum(record.cached_tokens)"""
# Every record is grouped into its line, and the lines of stale hours are kept: one pass over
# the records, and a join of lines with hours rather than of each record.
HASHED_LINES = f"""
    SELECT line.* FROM (
        SELECT date_bin('1 hour', started_at, '2000-01-01 00:00+00') AS hour, {LINE_COLUMNS}
        FROM billing_usagerecord AS record GROUP BY 1, 2, 3, 4
    ) AS line
    WHERE (line.endpoint_id, line.hour) IN (SELECT endpoint_id, hour FROM stale)"""
# Each stale hour's records by a range of the (endpoint, started_at) index. OFFSET 0 keeps
# PostgreSQL from flattening the subquery into a join it would plan itself.
INDEXED_LINES = f"""
    SELECT stale.hour, {LINE_COLUMNS}
    FROM stale CROSS JOIN LATERAL (
        SELECT * FROM billing_usagerecord
        WHERE endpoint_id = stale.endpoint_id
          AND started_at >= stale.hour AND started_at < stale.hour + interval '1 hour'
        OFFSET 0
    ) AS record
    GROUP BY 1, 2, 3, 4"""


def _roll_up_tokens(cursor: object, started: datetime) -> int:
    # The stale hours move into a table of this transaction, never through Python: a first
    # run takes tens of thousands. Hours whose marks an ingest still holds wait for the next.
    cursor.execute("CREATE TEMPORARY TABLE stale (endpoint_id uuid, hour timestamptz) "
                   "ON COMMIT DROP")
    cursor.execute("""
        WITH taken AS (
            DELETE FROM billing_staleusagehour WHERE id IN (
                SELECT id FROM billing_staleusagehour FOR UPDATE SKIP LOCKED)
            RETURNING endpoint_id, hour)
        INSERT INTO stale SELECT endpoint_id, hour FROM taken""")
    stale = cursor.rowcount
    cursor.execute("ANALYZE stale")
    cursor.execute("""
        DELETE FROM billing_tokenhour line USING stale
        WHERE line.endpoint_id = stale.endpoint_id AND line.hour = stale.hour""")
    # Many stale hours (a first run, a backlog) are best rolled up in one pass over the
    # records; a few, each by its own range of the index, so that the work stays that of the
    # new activity. Both shapes are written out: PostgreSQL's estimates for a join on a time
    # range pick the wrong one either way.
    cursor.execute("SELECT reltuples FROM pg_class WHERE oid = 'billing_usagerecord'::regclass")
    hashed = stale * RECORDS_PER_INDEXED_HOUR > cursor.fetchone()[0]
    cursor.execute(f"""
        INSERT INTO billing_tokenhour (hour, organization_id, endpoint_id, api_key_id, requests,
                                       prompt_tokens, completion_tokens, cached_tokens,
                                       rolled_up_at)
        SELECT line.*, %s FROM ({HASHED_LINES if hashed else INDEXED_LINES}) AS line""",
                   [started])
    cursor.execute("DROP TABLE stale")  # a second run in one transaction makes its own
    return stale


def _roll_up_gpu_time(cursor: object, now: datetime, started: datetime) -> int:
    cursor.execute("SELECT max(hour) FROM billing_gpuhour")
    latest = cursor.fetchone()[0]
    since = (min(latest, now) - GPU_SETTLE if latest is not None
             else datetime.min.replace(tzinfo=UTC))
    since = hour_of(since)
    cursor.execute("DELETE FROM billing_gpuhour WHERE hour >= %s", [since])
    # Each interval, cut at `now`, is split at every hour boundary it crosses; the seconds of
    # its pieces add up to its whole length exactly (microseconds, numeric arithmetic).
    cursor.execute("""
        WITH piece AS (
            SELECT span.organization_id, span.endpoint_id, span.gpu_type_id,
                   span.phase, hour,
                   extract(epoch FROM least(span.ended, hour + interval '1 hour')
                                      - greatest(span.started_at, hour))
                   * span.gpu_count AS gpu_seconds
            FROM (SELECT *, least(coalesce(ended_at, %(now)s), %(now)s) AS ended
                  FROM endpoints_replicainterval
                  WHERE (ended_at IS NULL OR ended_at > %(since)s) AND started_at < %(now)s
                 ) AS span
            CROSS JOIN LATERAL generate_series(
                date_trunc('hour', greatest(span.started_at, %(since)s), 'UTC'),
                span.ended, interval '1 hour') AS hour
        )
        INSERT INTO billing_gpuhour (hour, organization_id, endpoint_id, gpu_type_id, phase,
                                     gpu_seconds, rolled_up_at)
        SELECT hour, organization_id, endpoint_id, gpu_type_id, phase, sum(gpu_seconds),
               %(started)s
        FROM piece
        GROUP BY hour, organization_id, endpoint_id, gpu_type_id, phase
        HAVING sum(gpu_seconds) > 0""", {"now": now, "since": since, "started": started})
    return cursor.rowcount


def do_write_down_list_prices() -> None:
    """Give every GPU type without a price version its catalog list price as its first
    version, from FIRST_PRICE_FROM: every rollup, finalisation and operator's new price does,
    so that a later catalog change cannot reprice an hour already run."""
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO billing_gpuprice (gpu_type_id, hourly_price_usd, effective_from,
                                          created_at)
            SELECT id, hourly_price_usd, %s, now() FROM endpoints_gputype gpu
            WHERE NOT EXISTS (SELECT 1 FROM billing_gpuprice WHERE gpu_type_id = gpu.id)
            ON CONFLICT DO NOTHING""", [FIRST_PRICE_FROM])


def do_quote_prices_in_effect(*, now: datetime) -> int:
    """Make each GPU type's list price, which sizing, the wizard and the endpoints quote, the
    price version in effect at `now`, and each live endpoint's price per replica follow it:
    what is quoted is what is billed, an operator's new version included. Returns how many
    endpoints were repriced."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("""
            UPDATE endpoints_gputype gpu SET hourly_price_usd = version.hourly_price_usd
            FROM (SELECT DISTINCT ON (gpu_type_id) gpu_type_id, hourly_price_usd
                  FROM billing_gpuprice WHERE effective_from <= %s
                  ORDER BY gpu_type_id, effective_from DESC) version
            WHERE gpu.id = version.gpu_type_id
              AND gpu.hourly_price_usd <> version.hourly_price_usd""", [now])
        cursor.execute("""
            UPDATE endpoints_endpoint endpoint
            SET hourly_price_usd = gpu.hourly_price_usd * endpoint.gpu_count
            FROM endpoints_gputype gpu
            WHERE gpu.id = endpoint.gpu_type_id AND endpoint.deleted_at IS NULL
              AND endpoint.hourly_price_usd <> gpu.hourly_price_usd * endpoint.gpu_count""")
        return cursor.rowcount
