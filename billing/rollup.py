"""Hourly rollups of the billing ledger, in UTC hours: tokens per endpoint and API key from
usage records (TokenHour), device-seconds per endpoint, GPU type and phase from replica
intervals (GPUHour).

Both rewrite whole hours from the ledger, so a run repeated gives the same lines, and both
only touch hours with new activity. Token hours are marked stale by the ingester in the
transaction that stores their records (StaleUsageHour). GPU hours are rewritten from an hour
before the latest line on: that covers every interval still open, and intervals closed late
(a lost node's replicas close at its last heartbeat, up to a few minutes back); an hour is
settled an hour after the latest line has moved past it.

Stale hours are taken in batches, each in a transaction of its own that deletes their marks
and rewrites their lines: a rollup stopped between two batches (a timeout, a worker killed)
leaves every hour either wholly rolled up or still marked, and an ingest that marks an hour
waits at most for the one batch that holds it. Each transaction's statements together run
under a timeout (KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS); a batch that runs past it is rolled
back, the reason is kept in RollupState, and later runs take half as many hours a batch.

Every statement's cost is bounded whatever the planner's statistics say, because the tables
they read are written in bulk exactly when a rollup has most to do (the first run after an
upgrade, a backlog ingested, an outage), before autovacuum has analyzed them: statistics
then may claim that a table holds a row or two when it holds hundreds of thousands (it was
vacuumed nearly empty, after the last rollup took every mark), and a join planned on that
claim is quadratic. So no statement joins a ledger table on the planner's choice:
- the take walks the (hour, endpoint) key's index from where the last batch stopped, LIMIT a
  batch: an index scan of one batch whatever the estimates, since the alternative is to read
  and sort the whole table, whose size the planner takes from the file, not from statistics;
- rows are deleted by `id = ANY(ARRAY(subquery))`: the array is built once, and each id is
  found through the primary key;
- records and old lines are read by LATERAL subqueries kept apart by OFFSET 0, each an index
  range (an hour, or an endpoint's hour): as many index scans as hours, never a join the
  planner could turn around;
- the only joins are between this batch's temporary tables, created in its transaction and
  never vacuumed, whose sizes the planner therefore takes from their files.
"""

import logging
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.db.models import F
from django.db.models.functions import Least
from django.utils import timezone
from psycopg.errors import QueryCanceled

from billing.models import MAX_ROLLUP_BATCH_HOURS, MIN_ROLLUP_BATCH_HOURS, RollupState

logger = logging.getLogger(__name__)

# Held by each batch's transaction and by the GPU rollup's: a finalisation that holds it
# (lock_rollups) sees every hour either as a batch left it or as it was before the batch.
ROLLUP_LOCK = zlib.crc32(b"kvrun.billing.rollup")
GPU_SETTLE = timedelta(hours=1)
# Where a GPU type's first price version starts: before anything kvrun can have billed.
FIRST_PRICE_FROM = datetime(2000, 1, 1, tzinfo=UTC)
# Before every (hour, endpoint) key: where the first batch starts.
FIRST_KEY = (datetime.min.replace(tzinfo=UTC), "00000000-0000-0000-0000-000000000000")


@dataclass(frozen=True)
class Rollup:
    token_hours: int  # endpoint-hours rewritten
    gpu_hours: int  # lines written
    token_seconds: float  # how long each part took
    gpu_seconds: float
    batches: int  # transactions that rewrote token hours
    complete: bool  # False when a batch ran past the timeout or another run took over


def do_roll_up_usage(*, now: datetime | None = None) -> Rollup | None:
    """Bring TokenHour and GPUHour up to date with the ledger as of `now`.

    Stale token hours are taken in batches of RollupState.batch_hours, each committed on its
    own; then the GPU hours are rewritten in one transaction. Open intervals count until
    `now` (by default, now), so the current hour's lines grow from run to run. Lines are
    stamped with the database's time once their transaction holds the rollup lock, so a
    finalised invoice sees every line stamped before it (lock_rollups).
    Returns None, doing nothing, when another run or a finalisation holds the lock at the
    start: the totals are the same. A later batch that finds it held, or any that runs past
    the timeout, ends the token part there (`complete` is False), and the GPU hours are
    rewritten all the same; the hours it did not take stay marked for the next run.
    """
    state, _ = RollupState.objects.get_or_create(id=1)
    clock = time.perf_counter()
    tokens = _roll_up_tokens(batch=state.batch_hours)
    if tokens.locked_out and tokens.batches == 0:
        return None
    tokens_done = time.perf_counter()
    gpu_hours = _roll_up_gpu_time(now or timezone.now())
    if tokens.room_for_more:
        RollupState.objects.filter(id=1, batch_hours__lt=MAX_ROLLUP_BATCH_HOURS).update(
            batch_hours=Least(F("batch_hours") * 2, MAX_ROLLUP_BATCH_HOURS))
    return Rollup(token_hours=tokens.hours, gpu_hours=gpu_hours or 0,
                  token_seconds=tokens_done - clock,
                  gpu_seconds=time.perf_counter() - tokens_done, batches=tokens.batches,
                  complete=not (tokens.locked_out or tokens.timed_out) and gpu_hours is not None)


def lock_rollups() -> datetime:
    """Wait for a running rollup transaction, then keep rollups out until the current
    transaction ends. Returns the time then, as rollups stamp their lines: by the database's
    clock, the one clock every worker shares."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ROLLUP_LOCK])
        return _database_time(cursor)


class _Cursor(Protocol):
    """What these statements need of a cursor: Django's, or a _Deadline around one."""

    def execute(self, sql: str, params: Any = None) -> Any: ...

    def fetchone(self) -> Any: ...

    @property
    def rowcount(self) -> int: ...


def _database_time(cursor: _Cursor) -> datetime:
    cursor.execute("SELECT clock_timestamp()")
    return cursor.fetchone()[0]


def mark_stale_hours(*, records: Iterable[tuple[object, datetime]]) -> None:
    """Mark the hours of (endpoint id, started_at) records for the next token rollup. Call it
    in the transaction that stores them. An hour already marked keeps its mark's time (how
    long it has waited, the rollup's lag) but is locked all the same: the rollup skips it
    until this transaction ends, and the upsert waits for a batch that is rewriting the hour,
    so records it could not see are rolled up by the next one. In key order, so that two
    ingests lock their hours in one order."""
    hours = sorted({(hour_of(started_at), endpoint_id) for endpoint_id, started_at in records})
    if not hours:
        return
    starts, endpoint_ids = zip(*hours, strict=True)
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO billing_staleusagehour (endpoint_id, hour, marked_at)
            SELECT endpoint_id, hour, statement_timestamp()
            FROM unnest(%s::uuid[], %s::timestamptz[]) AS marked(endpoint_id, hour)
            ON CONFLICT (endpoint_id, hour)
            DO UPDATE SET marked_at = billing_staleusagehour.marked_at""",
                       [list(endpoint_ids), list(starts)])


def hour_of(moment: datetime) -> datetime:
    """The start of the UTC hour that `moment` falls in."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class _TokenRollup:
    hours: int
    batches: int
    locked_out: bool = False  # a batch found the lock held
    timed_out: bool = False  # a batch ran past the timeout
    room_for_more: bool = False  # a full batch took under a quarter of the timeout


def _roll_up_tokens(*, batch: int) -> _TokenRollup:
    """Take and rewrite stale hours, a batch at a time, until none is left after the last
    key taken, the lock is found held, or a batch runs past the timeout."""
    after, hours, batches, room = FIRST_KEY, 0, 0, False
    timeout = settings.KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS
    while True:
        started = time.perf_counter()
        try:
            with transaction.atomic(), connection.cursor() as plain:
                cursor = _Deadline(plain, seconds=timeout)
                if not _take_lock(cursor):
                    return _TokenRollup(hours, batches, locked_out=True, room_for_more=room)
                taken, after = _roll_up_token_batch(cursor, after=after, batch=batch)
        except OperationalError as exc:
            if not isinstance(exc.__cause__, QueryCanceled):
                raise
            smaller = max(MIN_ROLLUP_BATCH_HOURS, batch // 2)
            advice = (f"the next runs take batches of {smaller:,}" if smaller < batch else
                      "batches are already at their smallest: one hour's records take longer "
                      "than that, or something holds a lock on its lines; raise "
                      "KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS or end what holds the lock")
            _record_timeout(f"A batch of up to {batch:,} stale hours ran past the timeout and "
                            f"was rolled back ({str(exc).strip()}); {advice}.",
                            batch_hours=smaller)
            return _TokenRollup(hours, batches, timed_out=True)
        room = room or (taken == batch and time.perf_counter() - started < timeout / 4)
        if taken:
            hours, batches = hours + taken, batches + 1
        if taken < batch:
            return _TokenRollup(hours, batches, room_for_more=room)


class _Deadline:
    """A cursor whose statements run under one timeout together: each is given what is left
    of it, so that a transaction, and whoever waits on its locks, waits at most that long."""

    def __init__(self, cursor: _Cursor, *, seconds: float) -> None:
        self._cursor = cursor
        self._deadline = time.monotonic() + seconds

    def execute(self, sql: str, params: Any = None) -> None:
        left_ms = max(1, round((self._deadline - time.monotonic()) * 1000))
        self._cursor.execute(f"SET LOCAL statement_timeout = {left_ms:d}")
        self._cursor.execute(sql, params)

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount


def _take_lock(cursor: _Deadline) -> bool:
    """The rollup lock for this transaction, and memory enough to aggregate a batch's
    records in one hash."""
    cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [ROLLUP_LOCK])
    if not cursor.fetchone()[0]:
        return False
    cursor.execute("SET LOCAL work_mem = '256MB'")
    return True


def _record_timeout(reason: str, *, batch_hours: int | None = None) -> None:
    """Log and keep why a rollup transaction was rolled back, and the batch size from now."""
    timeout = settings.KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS
    reason = f"{reason} (timeout: {timeout:g} s a transaction)"
    logger.error("billing rollup: %s", reason)
    changes = {"timed_out_at": timezone.now(), "timeout_reason": reason}
    if batch_hours is not None:
        changes["batch_hours"] = batch_hours
    RollupState.objects.filter(id=1).update(**changes)


# The next batch of marks after key (%(hour)s, %(endpoint)s), taken (deleted) into `stale`.
# Marks an ingest holds are skipped: they wait for the next run.
TAKE = """
    WITH taken AS (
        DELETE FROM billing_staleusagehour WHERE id = ANY(ARRAY(
            SELECT id FROM billing_staleusagehour
            WHERE (hour, endpoint_id) > (%(hour)s::timestamptz, %(endpoint)s::uuid)
            ORDER BY hour, endpoint_id
            LIMIT %(batch)s
            FOR UPDATE SKIP LOCKED))
        RETURNING endpoint_id, hour)
    INSERT INTO stale SELECT endpoint_id, hour FROM taken"""
# Each hour of the batch is read whole, by time, where more than half of the endpoints it has
# lines for are stale in it (a first run has no lines; the current hour is stale for nearly
# every endpoint with records in it), and otherwise endpoint by endpoint: a few late records
# must not cost a whole hour's. Lines count endpoints without statistics, by the hour's index.
HOURS = """
    INSERT INTO stale_hour (hour, stale, lined)
    SELECT hour, count(*), (SELECT count(DISTINCT endpoint_id) FROM billing_tokenhour
                            WHERE hour = stale.hour)
    FROM stale GROUP BY hour"""
# The batch's records, grouped into lines, in the columns of billing_tokenhour; lines of a
# whole hour include endpoints that are not stale, dropped when they are written. `date_bin`
# from a UTC midnight gives the UTC hour as `date_trunc('hour', started_at, 'UTC')` does, by
# arithmetic alone: a third faster over a million records.
LINES = """
    INSERT INTO fresh_line
    SELECT date_bin('1 hour', record.started_at, '2000-01-01 00:00+00'),
           record.organization_id, record.endpoint_id, record.api_key_id, count(*),
           sum(record.prompt_tokens), sum(record.completion_tokens), sum(record.cached_tokens),
           record.adapter
    FROM (
        SELECT record.* FROM stale_hour CROSS JOIN LATERAL (
            SELECT * FROM billing_usagerecord
            WHERE started_at >= stale_hour.hour
              AND started_at < stale_hour.hour + interval '1 hour'
            OFFSET 0) AS record
        WHERE stale_hour.stale * 2 > stale_hour.lined
        UNION ALL
        SELECT record.* FROM stale JOIN stale_hour USING (hour) CROSS JOIN LATERAL (
            SELECT * FROM billing_usagerecord
            WHERE endpoint_id = stale.endpoint_id
              AND started_at >= stale.hour AND started_at < stale.hour + interval '1 hour'
            OFFSET 0) AS record
        WHERE stale_hour.stale * 2 <= stale_hour.lined
    ) AS record
    GROUP BY 1, 2, 3, 4, record.adapter"""


def _roll_up_token_batch(cursor: _Cursor, *, after: tuple, batch: int
                         ) -> tuple[int, tuple]:
    """Take the next `batch` stale hours after key `after` and rewrite their lines. Returns
    how many it took and the last key taken."""
    # Dropped at the end, not only at commit: a rollup inside an outer transaction (a test's)
    # runs its batches as savepoints of that one transaction. A batch that fails is rolled
    # back, and its tables with it.
    cursor.execute("""
        CREATE TEMPORARY TABLE stale (endpoint_id uuid, hour timestamptz) ON COMMIT DROP;
        CREATE TEMPORARY TABLE stale_hour (hour timestamptz, stale bigint, lined bigint)
            ON COMMIT DROP;
        CREATE TEMPORARY TABLE fresh_line (hour timestamptz, organization_id uuid,
            endpoint_id uuid, api_key_id uuid, requests bigint, prompt_tokens bigint,
            completion_tokens bigint, cached_tokens bigint, adapter varchar(63))
            ON COMMIT DROP""")
    taken = _rewrite_token_hours(cursor, after=after, batch=batch)
    cursor.execute("DROP TABLE stale, stale_hour, fresh_line")
    return taken


def _rewrite_token_hours(cursor: _Cursor, *, after: tuple, batch: int) -> tuple[int, tuple]:
    """The batch in the temporary tables. Every join is between tables of this batch, or a
    LATERAL lookup through an index."""
    stamp = _database_time(cursor)
    cursor.execute(TAKE, {"hour": after[0], "endpoint": after[1], "batch": batch})
    taken = cursor.rowcount
    if not taken:
        return 0, after
    cursor.execute("ANALYZE stale")
    cursor.execute("SELECT hour, endpoint_id FROM stale ORDER BY hour DESC, endpoint_id DESC "
                   "LIMIT 1")
    last = cursor.fetchone()
    cursor.execute(HOURS)
    cursor.execute("ANALYZE stale_hour")
    cursor.execute("""
        DELETE FROM billing_tokenhour WHERE id = ANY(ARRAY(
            SELECT line.id FROM stale JOIN stale_hour USING (hour) CROSS JOIN LATERAL (
                SELECT id FROM billing_tokenhour
                WHERE endpoint_id = stale.endpoint_id AND hour = stale.hour
                OFFSET 0) AS line
            WHERE stale_hour.lined > 0))""")
    cursor.execute(LINES)
    # In key order: each index of the lines is then written at a few places at a time.
    cursor.execute("""
        INSERT INTO billing_tokenhour (hour, organization_id, endpoint_id, api_key_id, requests,
                                       prompt_tokens, completion_tokens, cached_tokens,
                                       adapter, rolled_up_at)
        SELECT line.*, %s FROM fresh_line line JOIN stale USING (endpoint_id, hour)
        ORDER BY line.hour, line.endpoint_id""", [stamp])
    return taken, last


def _roll_up_gpu_time(now: datetime) -> int | None:
    """Rewrite the GPU hours from an hour before the latest line on, in one transaction;
    None when the lock is held or the statement timeout passed (rolled back, logged)."""
    try:
        with transaction.atomic(), connection.cursor() as plain:
            cursor = _Deadline(plain, seconds=settings.KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS)
            if not _take_lock(cursor):
                return None
            do_write_down_list_prices()
            return _rewrite_gpu_hours(cursor, now=now, stamp=_database_time(cursor))
    except OperationalError as exc:
        if not isinstance(exc.__cause__, QueryCanceled):
            raise
        _record_timeout(f"The GPU-hour rollup ran past the statement timeout and was rolled "
                        f"back ({str(exc).strip()}); the next run tries again.")
        return None


def _rewrite_gpu_hours(cursor: _Cursor, *, now: datetime, stamp: datetime) -> int:
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
                   span.price_region_id, span.own_node, span.phase, hour,
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
        INSERT INTO billing_gpuhour (hour, organization_id, endpoint_id, gpu_type_id,
                                     price_region_id, own_node, phase, gpu_seconds,
                                     rolled_up_at)
        SELECT hour, organization_id, endpoint_id, gpu_type_id, price_region_id, own_node,
               phase, sum(gpu_seconds), %(started)s
        FROM piece
        GROUP BY hour, organization_id, endpoint_id, gpu_type_id, price_region_id, own_node,
                 phase
        HAVING sum(gpu_seconds) > 0
        ORDER BY hour, endpoint_id""", {"now": now, "since": since, "started": stamp})
    return cursor.rowcount


def do_write_down_list_prices() -> None:
    """Give every GPU type without a general price version its catalog list price as its
    first one, from FIRST_PRICE_FROM: every rollup, finalisation and operator's new price
    does, so that a later catalog change cannot reprice an hour already run. (Regional and
    own-node prices have no list price: they exist once an operator sets them.)"""
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO billing_gpuprice (gpu_type_id, region_id, own_nodes, hourly_price_usd,
                                          effective_from, created_at)
            SELECT id, NULL, false, hourly_price_usd, %s, now() FROM endpoints_gputype gpu
            WHERE NOT EXISTS (SELECT 1 FROM billing_gpuprice
                              WHERE gpu_type_id = gpu.id AND region_id IS NULL
                                AND NOT own_nodes)
            ON CONFLICT DO NOTHING""", [FIRST_PRICE_FROM])


def do_quote_prices_in_effect(*, now: datetime) -> int:
    """Make the prices that sizing, the wizard and the endpoints quote the versions in
    effect at `now`: each GPU type's general and own-node price, each region's own price
    (endpoints.RegionalPrice), and each live endpoint's price per replica (its own nodes'
    where it requires them, else its region's, else the general one): what is quoted is what
    is billed, an operator's new version included. Returns how many endpoints were
    repriced."""
    in_effect = """
        SELECT DISTINCT ON (gpu_type_id, region_id, own_nodes) gpu_type_id, region_id,
               own_nodes, hourly_price_usd
        FROM billing_gpuprice WHERE effective_from <= %(now)s
        ORDER BY gpu_type_id, region_id, own_nodes, effective_from DESC"""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"""
            UPDATE endpoints_gputype gpu
            SET hourly_price_usd = coalesce(general.hourly_price_usd, gpu.hourly_price_usd),
                own_node_price_usd = coalesce(own.hourly_price_usd, 0)
            FROM endpoints_gputype same
            LEFT JOIN ({in_effect}) general ON general.gpu_type_id = same.id
                 AND general.region_id IS NULL AND NOT general.own_nodes
            LEFT JOIN ({in_effect}) own ON own.gpu_type_id = same.id AND own.own_nodes
            WHERE gpu.id = same.id
              AND (gpu.hourly_price_usd, gpu.own_node_price_usd)
                  IS DISTINCT FROM (coalesce(general.hourly_price_usd, gpu.hourly_price_usd),
                                    coalesce(own.hourly_price_usd, 0))""", {"now": now})
        cursor.execute(f"""
            INSERT INTO endpoints_regionalprice (region_id, gpu_type_id, hourly_price_usd)
            SELECT region_id, gpu_type_id, hourly_price_usd FROM ({in_effect}) version
            WHERE region_id IS NOT NULL
            ON CONFLICT (region_id, gpu_type_id) DO UPDATE
            SET hourly_price_usd = excluded.hourly_price_usd
            WHERE endpoints_regionalprice.hourly_price_usd <> excluded.hourly_price_usd""",
                       {"now": now})
        cursor.execute("""
            UPDATE endpoints_endpoint endpoint
            SET hourly_price_usd = quoted.price * endpoint.gpu_count
            FROM (SELECT endpoint.id,
                         CASE WHEN endpoint.own_nodes_only THEN gpu.own_node_price_usd
                              ELSE coalesce(regional.hourly_price_usd, gpu.hourly_price_usd)
                         END AS price
                  FROM endpoints_endpoint endpoint
                  JOIN endpoints_gputype gpu ON gpu.id = endpoint.gpu_type_id
                  LEFT JOIN endpoints_regionalprice regional
                       ON regional.region_id = endpoint.region_id
                      AND regional.gpu_type_id = endpoint.gpu_type_id
                  WHERE endpoint.deleted_at IS NULL) quoted
            WHERE endpoint.id = quoted.id
              AND endpoint.hourly_price_usd <> quoted.price * endpoint.gpu_count""")
        return cursor.rowcount
