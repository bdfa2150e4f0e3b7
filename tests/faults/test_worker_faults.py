"""Faults in the control worker: killed outright while it moves usage records into
PostgreSQL. Every record must be stored exactly once, and ingestion must go on."""

import signal
import time
from collections.abc import Callable

import pytest

from accounts.models import Organization
from billing import usage_stream
from billing.ingestion import INGEST_LOCK
from billing.models import UsageRecord
from billing.tasks import ingest_usage
from endpoints.models import Endpoint
from kvrun.common.redis import redis_client
from tests.factories import inference_key, usage_report
from tests.helpers import start_worker, stop, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("usage_stream")]

RECORDS = 20_000  # enough that the kill lands mid-ingest on a busy machine too


def test_a_worker_killed_mid_ingest_loses_no_record_and_stores_none_twice(
    stub_endpoint: Endpoint, org: Organization, figures: Callable[..., None]
) -> None:
    key, _ = inference_key(org)
    pipe = redis_client().pipeline(transaction=False)
    for _ in range(RECORDS):  # each report a request of its own
        pipe.xadd(usage_stream.STREAM,
                  {usage_stream.FIELD: usage_report(stub_endpoint, key).encode()})
    pipe.execute()
    worker = start_worker("faults")
    try:
        ingest_usage.apply_async(queue="faults")
        assert wait_until(lambda: UsageRecord.objects.count() >= RECORDS // 10, 60,
                          interval=0.02)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
    finally:
        stop(worker)
    stored_at_kill = UsageRecord.objects.count()
    killed_at = time.monotonic()

    # The worker back, as its supervisor restarts it, and beat's ingest tasks reaching it:
    # nothing in this process ingests. The dead run's lock lapses, its unacknowledged entries
    # are claimed, and the rest follows.
    worker = start_worker("faults")
    try:
        def drained() -> bool:
            ingest_usage.apply_async(queue="faults")
            return (redis_client().xlen(usage_stream.STREAM) == 0
                    and redis_client().xpending(usage_stream.STREAM,
                                                usage_stream.GROUP)["pending"] == 0)

        # Bounded generously: how long the rest takes is the machine's pace (the figure kept
        # below), not what this test is about.
        assert wait_until(drained, 180, interval=1.0), (
            f"left in the stream: {redis_client().xlen(usage_stream.STREAM)}, pending: "
            f"{redis_client().xpending(usage_stream.STREAM, usage_stream.GROUP)}, stored: "
            f"{UsageRecord.objects.count()}, the lock's ttl: "
            f"{redis_client().pttl(INGEST_LOCK)} ms")
    finally:
        stop(worker)

    resumed_after = time.monotonic() - killed_at
    figures(sent=RECORDS, stored_at_kill=stored_at_kill, stored=UsageRecord.objects.count(),
            seconds_until_all_stored=round(resumed_after))
    assert stored_at_kill < RECORDS  # the kill came mid-ingest
    assert UsageRecord.objects.count() == RECORDS
