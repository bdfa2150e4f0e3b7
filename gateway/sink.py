"""Where requests go once admitted: their leases renewed while they run, and at their end
their usage report onto the Redis stream, their trace cleared and their limits released.

`track` and `add` never wait. One background task writes whatever has gathered within a few
milliseconds as a single transaction, so a write carries many requests under load and
several even at low concurrency; every few seconds it also renews the requests still
running (their in-flight slots, and their traces with the usage so far), so that what a
process killed outright held is freed, and recorded, by others (billing.usage_stream).
If Redis cannot be reached the records go straight to PostgreSQL instead; `close` writes
what is left before the process exits, so a web process that is told to stop loses nothing.

What a client is about to receive reaches Redis first (`write_ahead`): a request's trace is
written before an event would put its client more than KVRUN_GATEWAY_TRACE_LAG_TOKENS
completion tokens ahead of it, and before the last of its answer, a whole answer included.
Such a write does not wait for the gathering and carries traces alone (one command each):
it starts at once with whatever waits, and those that arrive meanwhile go together in the
next. So a process killed at any moment leaves a ledger that bills every token its clients
received, less at most that many of a stream cut in mid-answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from billing import usage_stream
from billing.ingestion import do_record_usage
from gateway.exchange import Exchange
from gateway.limits import Admission

logger = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
def _store_directly(payloads: list[bytes]) -> list[tuple[bytes, str]]:
    close_old_connections()
    return do_record_usage(payloads=payloads)


class UsageSink:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._records: list[tuple[str, bytes]] = []  # request id, encoded report
        self._releases: list[tuple[Admission, int, int]] = []  # tokens used, when it ended
        self._running: dict[str, Exchange] = {}
        self._tracing: dict[str, Exchange] = {}  # traces to write with the next write
        self._written: asyncio.Future[None] | None = None  # the awaited traces' write
        self._reachable = True  # the last write reached Redis
        self._gathering = False  # something waits for the gathered write at _flush_at
        self._flush_at = 0.0  # monotonic
        self._renew_at = 0.0
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.counts = {"queued": 0, "redis": 0, "postgres": 0}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def track(self, exchange: Exchange) -> None:
        """Keep the admitted request's lease and trace renewed until it is `add`ed."""
        self._running[exchange.request_id] = exchange

    def add(self, exchange: Exchange) -> None:
        """Queue the finished request's usage report, the clearing of its trace, and the
        release of its limits with the tokens it consumed."""
        assert exchange.admission is not None
        self._running.pop(exchange.request_id, None)
        self._tracing.pop(exchange.request_id, None)
        self._records.append((exchange.request_id, exchange.report().encode()))
        self.counts["queued"] += 1
        self._releases.append((exchange.admission,
                               exchange.prompt_tokens + exchange.completion_tokens,
                               time.time_ns() // 1_000_000))
        self._gather()

    async def write_ahead(self, exchange: Exchange, *, last: bool) -> None:
        """Return once the running request's trace in Redis holds what its client is about
        to receive: all of its usage so far when this is the `last` of its answer, else all
        but at most KVRUN_GATEWAY_TRACE_LAG_TOKENS of its completion tokens. Half-way to
        that lag the trace joins the next gathered write, without waiting: a stream slower
        than the gathering waits only at its end. At once while Redis is unreachable
        (records then go to PostgreSQL, and traces are written again when it returns), or
        once the sink has closed. The wait is the write's: Redis's own timeout
        (KVRUN_REDIS_TIMEOUT_SECONDS) bounds it, and a write that times out marks Redis
        unreachable. A shorter wait of its own would send untraced tokens whenever the
        gateway is starved of CPU for longer than it."""
        traced, now = exchange.traced, exchange.traced_usage()
        behind, lag = now[1] - traced[1], settings.KVRUN_GATEWAY_TRACE_LAG_TOKENS
        if now == traced or exchange.request_id not in self._running:
            return
        if not last and behind <= lag:
            if behind > lag // 2 and exchange.request_id not in self._tracing:
                self._tracing[exchange.request_id] = exchange
                self._gather()
            return
        self._tracing[exchange.request_id] = exchange
        if not self._reachable or self._task is None or self._task.done():
            self._gather()
            return
        if self._written is None:
            self._written = asyncio.get_running_loop().create_future()
        written = self._written
        self._wake.set()
        # Shared by every waiter of the write: one that is cancelled must not cancel it.
        await asyncio.shield(written)

    def _gather(self) -> None:
        """Have what is queued written once the first of it has waited a few milliseconds
        for more to join it."""
        if not self._gathering:
            self._gathering = True
            self._flush_at = time.monotonic() + settings.KVRUN_GATEWAY_GATHER_SECONDS
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
        for _, payload in self._records:
            logger.error("usage record not stored (Redis and PostgreSQL unreachable): %s",
                         payload.decode())
        counts = self.counts
        logger.info("usage sink closed: queued=%d redis=%d postgres=%d unsent=%d",
                    counts["queued"], counts["redis"], counts["postgres"], len(self._records))

    async def _run(self) -> None:
        try:
            while not await self._turn():
                pass
        finally:
            if self._written is not None and not self._written.done():
                self._written.set_result(None)  # nobody waits on a sink that has stopped

    async def _turn(self) -> bool:
        """Wait for work, then do what is due; True once closing has written everything. An
        unexpected error is logged and the turn tried again: the sink must outlive it."""
        try:
            now = time.monotonic()
            pending = self._records or self._releases or self._tracing
            due = min(self._flush_at if pending else float("inf"),
                      self._renew_at if self._running else float("inf"),
                      now + usage_stream.renew_seconds())
            if not self._closing and self._written is None and due > now:
                try:
                    async with asyncio.timeout(due - now):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self._wake.clear()
            if self._written is not None:
                await self._write_awaited_traces()
            now = time.monotonic()
            pending = self._records or self._releases or self._tracing
            renewing = bool(self._running) and now >= self._renew_at
            if not (self._closing or renewing or (pending and now >= self._flush_at)):
                return False
            if not await self._flush():
                await asyncio.sleep(RETRY_SECONDS)
                return False
            return self._closing and not self._records and not self._releases
        except Exception:
            logger.exception("the usage sink failed a turn; trying again")
            await asyncio.sleep(RETRY_SECONDS)
            return False

    async def _write_awaited_traces(self) -> None:
        """Write the traces queued so far, at once and alone (no transaction: each is whole
        by itself), and release who waits for them."""
        written, self._written = self._written, None
        tracing, self._tracing = self._tracing, {}
        self._gathering = bool(self._records or self._releases)
        try:
            if not tracing:  # a write just before took them
                return
            pipe = self._redis.pipeline(transaction=False)
            traced = self._trace(pipe, tracing.values(), renewed=False)
            await pipe.execute()
            self._reachable = True
            for exchange, usage in traced:
                exchange.traced = usage
        except (RedisError, OSError) as exc:
            self._reachable = False
            logger.warning("usage traces unreachable (%s); %d not written", exc, len(tracing))
        finally:
            assert written is not None
            written.set_result(None)

    async def _flush(self) -> bool:
        """Write one batch; False when it has to be tried again later."""
        records, releases, tracing = self._records, self._releases, self._tracing
        self._records, self._releases, self._tracing = [], [], {}
        self._gathering = False
        renewing = bool(self._running) and time.monotonic() >= self._renew_at
        if not records and not releases and not renewing and not tracing:
            return True
        pipe = self._redis.pipeline(transaction=True)
        for admission, tokens, ended_ms in releases:
            admission.release(pipe, tokens=tokens, now_ms=ended_ms)
        for request_id, payload in records:
            pipe.xadd(usage_stream.STREAM, {usage_stream.FIELD: payload})
            pipe.hdel(usage_stream.ADMITTED, request_id)
            pipe.zrem(usage_stream.ADMITTED_SEEN, request_id)
        traced = self._renew(pipe) if renewing else self._trace(pipe, tracing.values())
        try:
            await pipe.execute()
            self.counts["redis"] += len(records)
            self._reachable = True
            for exchange, usage in traced:
                exchange.traced = usage
            return True
        except (RedisError, OSError) as exc:
            self._reachable = False
            # Limit slots and running Idempotency-Keys are leases that expire on their own;
            # the records must not be lost.
            logger.warning("usage stream unreachable (%s); writing %d record(s) to PostgreSQL",
                           exc, len(records))
        if not records:
            return True
        payloads = [payload for _, payload in records]
        try:
            rejected = await sync_to_async(_store_directly)(payloads)
        except Exception:
            logger.exception("PostgreSQL refused %d usage record(s); retrying", len(records))
            self._records[:0] = records
            return False
        for payload, reason in rejected:
            logger.error("usage record cannot be stored (%s): %s", reason, payload.decode())
        self.counts["postgres"] += len(records) - len(rejected)
        return True

    def _renew(self, pipe: Pipeline) -> list[tuple[Exchange, tuple[int, int, int]]]:
        """Queue the renewal of every running request: its in-flight lease, and its trace
        with the usage so far. A trace that was taken for interrupted (its lease ran out
        while Redis was away) is traced again: the ledger keeps one record per request."""
        self._renew_at = time.monotonic() + usage_stream.renew_seconds()
        now_ms = time.time_ns() // 1_000_000
        for exchange in self._running.values():
            assert exchange.admission is not None
            exchange.admission.renew(pipe, now_ms=now_ms)
            if exchange.idempotency is not None:
                exchange.idempotency.renew(pipe)
        return self._trace(pipe, self._running.values(), now_ms=now_ms)

    def _trace(self, pipe: Pipeline, exchanges: Iterable[Exchange], *, now_ms: int | None = None,
               renewed: bool = True) -> list[tuple[Exchange, tuple[int, int, int]]]:
        """Queue the traces of these running requests with their usage so far, and when
        `renewed`, the time their gateway last vouched for them; returns what each will hold
        once written. A trace written between renewals is listed among the vouched-for only
        when its admission could not list it (Redis was unreachable then): ingestion finds
        traces through that list."""
        now_ms = now_ms or time.time_ns() // 1_000_000
        traced = []
        for exchange in exchanges:
            assert exchange.admission is not None
            traced.append((exchange, exchange.traced_usage()))
            pipe.hset(usage_stream.ADMITTED, exchange.request_id,
                      exchange.interrupted_report().encode())
            if renewed or not exchange.admission.endpoint_id:
                pipe.zadd(usage_stream.ADMITTED_SEEN, {exchange.request_id: now_ms})
        return traced
