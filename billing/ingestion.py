"""Usage records into the ledger: from the gateways' Redis stream, or directly from a gateway
while Redis is away."""

import logging
import socket
import time
from collections.abc import Iterable
from datetime import datetime
from typing import cast
from uuid import UUID

from django.db import DataError, IntegrityError, transaction
from django.utils import timezone
from redis import Redis
from redis.exceptions import LockNotOwnedError, ResponseError
from redis.lock import Lock

from accounts.services import do_touch_api_key
from billing import usage_stream
from billing.models import UsageRecord
from billing.rollup import mark_stale_hours
from kvrun.common.redis import redis_client

logger = logging.getLogger(__name__)

INGEST_LOCK = "kvrun:usage:ingest-lock"
# Held while a run lasts, renewed after every batch: a worker killed mid-run holds up
# ingestion for at most this long.
INGEST_LOCK_SECONDS = 15
# An entry another consumer read but did not acknowledge for this long is taken over.
CLAIM_IDLE_MS = 60_000


def do_record_usage(*, payloads: Iterable[bytes]) -> list[tuple[bytes, str]]:
    """Insert usage records as gateways encode them (usage_stream.UsageReport). A request
    already recorded is skipped (unique request_id), so a batch may be delivered any number
    of times; but for a request recorded as interrupted (usage_stream.INTERRUPTED_CODE: its
    gateway stopped renewing its trace), which its own later record replaces when that one is
    final, or interrupted with more tokens (its gateway was cut off from Redis for longer
    than the lease, not dead). A replaced record's hour is rolled up again.

    Returns the payloads that cannot be stored, each with why: malformed, naming rows that do
    not exist, or holding a value no column takes. Every other record is committed when this
    returns. A database that cannot be reached raises (OperationalError), and then nothing
    is rejected: the batch is for later.
    """
    rows, rejected = [], []
    for payload in payloads:
        try:
            rows.append((payload, usage_stream.UsageReport.decode(payload).as_row()))
        except (ValueError, KeyError, TypeError, ArithmeticError) as exc:
            rejected.append((payload, f"malformed: {exc}"))
    stored = []
    try:
        with transaction.atomic():
            _insert([row for _, row in rows])
        stored = rows
    except (IntegrityError, DataError):
        # One bad row must not hold back the others: store them one by one.
        for payload, row in rows:
            try:
                with transaction.atomic():
                    _insert([row])
                stored.append((payload, row))
            except (IntegrityError, DataError) as exc:
                rejected.append((payload, f"{exc.__class__.__name__}: {exc}".strip()))
    _touch_keys(row for _, row in stored)
    return rejected


def _insert(rows: list[UsageRecord]) -> None:
    UsageRecord.objects.bulk_create(rows, ignore_conflicts=True)
    _replace_interrupted(rows)
    mark_stale_hours(records=((row.endpoint_id, row.started_at) for row in rows))


# Every column a gateway reports; the row's id stays.
_REPORTED = [field.attname for field in UsageRecord._meta.concrete_fields
             if field.name not in ("id", "request_id", "ingested_at")]


def _replace_interrupted(rows: list[UsageRecord]) -> None:
    """The one change the ledger takes: a record stored as interrupted is provisional, the
    usage its trace held when its gateway last renewed it. A conditional update, so that of
    two deliveries at once, the one with more of the request wins."""
    interrupted = set(UsageRecord.objects.filter(
        request_id__in=[row.request_id for row in rows],
        error_code=usage_stream.INTERRUPTED_CODE).values_list("request_id", flat=True))
    for row in rows:
        if row.request_id not in interrupted:
            continue
        replaceable = UsageRecord.objects.filter(request_id=row.request_id,
                                                 error_code=usage_stream.INTERRUPTED_CODE)
        if row.error_code == usage_stream.INTERRUPTED_CODE:
            replaceable = replaceable.filter(completion_tokens__lt=row.completion_tokens)
        # Ingested now: a month invoiced since shows it behind its adjustment line.
        if replaceable.update(**{name: getattr(row, name) for name in _REPORTED},
                              ingested_at=timezone.now()):
            logger.info("usage record %s, stored as interrupted, replaced by its gateway's",
                        row.request_id)


def _touch_keys(records: Iterable[UsageRecord]) -> None:
    """Keys' last_used_at comes from their usage, so the gateway writes nothing per request."""
    latest: dict[UUID, datetime] = {}
    for record in records:
        if record.api_key_id and (record.api_key_id not in latest
                                  or record.started_at > latest[record.api_key_id]):
            latest[record.api_key_id] = record.started_at
    for key_id, used_at in latest.items():
        do_touch_api_key(key_id=key_id, used_at=used_at)


def do_ingest_usage(*, batch: int = 1000, max_batches: int = 100) -> int:
    """Move usage records from the gateways' Redis stream into PostgreSQL, then store the
    traces of requests whose gateway died under them as interrupted requests.

    An entry is acknowledged and deleted only after its row is committed; entries a dead
    worker had read are taken over after CLAIM_IDLE_MS. A trace is removed only after its
    row is committed, and one not renewed for a lease (usage_stream.lease_ms) is taken for a dead
    gateway's. Records that cannot be stored go to the dead-letter stream with the reason
    logged. One run at a time (a Redis lock); returns how many entries and traces were
    handled.
    """
    redis = redis_client()
    lock = redis.lock(INGEST_LOCK, timeout=INGEST_LOCK_SECONDS, blocking=False)
    if not lock.acquire():
        return 0
    try:
        _ensure_group(redis)
        consumer = socket.gethostname()
        handled = 0
        for _ in range(max_batches):
            entries = _next_entries(redis, consumer, batch)
            if not entries:
                break
            ids = [entry_id for entry_id, _ in entries]
            payloads = [fields.get(usage_stream.FIELD, b"") for _, fields in entries]
            _store(redis, payloads)
            # Both or neither: a run killed between the two left entries acknowledged but
            # never deleted, which no consumer reads again and the stream kept for ever.
            done = redis.pipeline(transaction=True)
            done.xack(usage_stream.STREAM, usage_stream.GROUP, *ids)
            done.xdel(usage_stream.STREAM, *ids)
            done.execute()
            handled += len(ids)
            lock.extend(INGEST_LOCK_SECONDS, replace_ttl=True)
        return handled + _store_interrupted(redis, lock, batch=batch,
                                            now_ms=time.time_ns() // 1_000_000)
    finally:
        try:
            lock.release()
        except LockNotOwnedError:
            logger.warning("the usage ingest lock lapsed during a run")


def _store(redis: Redis, payloads: list[bytes]) -> None:
    """Commit the records; the ones that cannot be stored go to the dead letters."""
    for payload, reason in do_record_usage(payloads=payloads):
        logger.error("usage record cannot be stored (%s); kept in %s: %r", reason,
                     usage_stream.DEAD_LETTERS, payload[:300])
        redis.xadd(usage_stream.DEAD_LETTERS, {usage_stream.FIELD: payload,
                                               usage_stream.ERROR_FIELD: reason[:500]})


def _store_interrupted(redis: Redis, lock: Lock, *, batch: int, now_ms: int) -> int:
    """Store, as interrupted, the requests whose gateway stopped renewing their trace."""
    handled = 0
    while request_ids := cast(list[bytes], redis.zrangebyscore(
            usage_stream.ADMITTED_SEEN, "-inf", now_ms - usage_stream.lease_ms(), start=0,
            num=batch)):
        payloads = [payload for payload in cast(list[bytes | None], redis.hmget(
                    usage_stream.ADMITTED, request_ids)) if payload is not None]
        _store(redis, payloads)
        logger.warning("%d request(s) interrupted by the death of their gateway recorded",
                       len(payloads))
        pipe = redis.pipeline()
        pipe.hdel(usage_stream.ADMITTED, *request_ids)
        pipe.zrem(usage_stream.ADMITTED_SEEN, *request_ids)
        pipe.execute()
        handled += len(request_ids)
        lock.extend(INGEST_LOCK_SECONDS, replace_ttl=True)
    return handled


def _ensure_group(redis: Redis) -> None:
    try:
        redis.xgroup_create(usage_stream.STREAM, usage_stream.GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _next_entries(redis: Redis, consumer: str, count: int) -> list[tuple[bytes, dict]]:
    """This consumer's own unacknowledged entries first (a run that died), then entries other
    consumers left idle, then new ones."""
    for start in ("0", None, ">"):
        if start is None:
            _, entries, *_ = redis.xautoclaim(usage_stream.STREAM, usage_stream.GROUP, consumer,
                                              min_idle_time=CLAIM_IDLE_MS, start_id="0-0",
                                              count=count)
        else:
            reply = cast(list, redis.xreadgroup(usage_stream.GROUP, consumer,
                                                {usage_stream.STREAM: start}, count=count))
            entries = reply[0][1] if reply else []
        empty = [entry_id for entry_id, fields in entries if not fields]
        if empty:  # deleted before they were acknowledged: nothing left to store
            redis.xack(usage_stream.STREAM, usage_stream.GROUP, *empty)
        entries = [(entry_id, fields) for entry_id, fields in entries if fields]
        if entries:
            return entries
    return []
