"""Where finished requests go: their usage report onto the Redis stream, their limits released.

`add` never waits. One background task writes whatever has gathered within a few
milliseconds as a single pipeline, so a write carries many requests under load and several
even at low concurrency.
If Redis cannot be reached the records go straight to PostgreSQL instead; `close` writes
what is left before the process exits, so a web process that is told to stop loses nothing.
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from redis.asyncio import Redis
from redis.exceptions import RedisError

from billing import usage_stream
from billing.services import do_record_usage
from gateway.limits import Admission

logger = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
# A write waits this long for more records to join it: one pipeline then carries several
# requests even at low concurrency, and its cost stays off the next request's path.
GATHER_SECONDS = 0.005


def _store_directly(payloads: list[bytes]) -> list[bytes]:
    close_old_connections()
    return do_record_usage(payloads=payloads)


class UsageSink:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._records: list[bytes] = []
        self._releases: list[tuple[Admission, int]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.counts = {"queued": 0, "redis": 0, "postgres": 0}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, *, report: usage_stream.UsageReport, admission: Admission, tokens: int) -> None:
        """Queue the request's usage report, and the release of its limits with the `tokens`
        it consumed."""
        self._records.append(report.encode())
        self.counts["queued"] += 1
        self._releases.append((admission, tokens))
        self._wake.set()

    async def close(self, timeout: float = 15.0) -> None:
        """Write everything still buffered; log any record that could not be written."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except TimeoutError:
                pass
        for payload in self._records:
            logger.error("usage record not stored (Redis and PostgreSQL unreachable): %s",
                         payload.decode())
        counts = self.counts
        logger.info("usage sink closed: queued=%d redis=%d postgres=%d unsent=%d",
                    counts["queued"], counts["redis"], counts["postgres"], len(self._records))

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if not self._closing:
                await asyncio.sleep(GATHER_SECONDS)
            self._wake.clear()
            if not await self._flush():
                await asyncio.sleep(RETRY_SECONDS)
                self._wake.set()
            elif self._closing and not self._records and not self._releases:
                return

    async def _flush(self) -> bool:
        """Write one batch; False when it has to be tried again later."""
        records, releases = self._records, self._releases
        self._records, self._releases = [], []
        if not records and not releases:
            return True
        pipe = self._redis.pipeline(transaction=False)
        for admission, tokens in releases:
            admission.release(pipe, tokens=tokens)
        for payload in records:
            pipe.xadd(usage_stream.STREAM, {usage_stream.FIELD: payload})
        try:
            await pipe.execute()
            self.counts["redis"] += len(records)
            return True
        except (RedisError, OSError) as exc:
            # Limit slots expire on their own; the records must not be lost.
            logger.warning("usage stream unreachable (%s); writing %d record(s) to PostgreSQL",
                           exc, len(records))
        if not records:
            return True
        try:
            rejected = await sync_to_async(_store_directly)(records)
        except Exception:
            logger.exception("PostgreSQL refused %d usage record(s); retrying", len(records))
            self._records[:0] = records
            return False
        for payload, reason in rejected:
            logger.error("usage record cannot be stored (%s): %s", reason, payload.decode())
        self.counts["postgres"] += len(records) - len(rejected)
        return True
