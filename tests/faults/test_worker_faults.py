"""Faults in the control worker: killed outright while it moves usage records into
PostgreSQL. Every record must be stored exactly once, and ingestion must go on."""

import signal
import time
from collections.abc import Callable

import pytest

from accounts.models import Organization
from billing import usage_stream
from billing.ingestion import INGEST_LOCK_SECONDS, do_ingest_usage
from billing.models import UsageRecord
from billing.tasks import ingest_usage
from endpoints.models import Endpoint
from kvrun.redis import redis_client
from tests.factories import inference_key, usage_report
from tests.helpers import start_worker, stop, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

RECORDS = 20_000  # enough that the kill lands mid-ingest on a busy machine too


def test_a_worker_killed_mid_ingest_loses_no_record_and_stores_none_twice(
    endpoint: Endpoint, org: Organization, figures: Callable[..., None]
) -> None:
    key, _ = inference_key(org)
    pipe = redis_client().pipeline(transaction=False)
    for _ in range(RECORDS):
        pipe.xadd(usage_stream.STREAM, {usage_stream.FIELD: usage_report(endpoint, key).encode()})
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

    def drained() -> bool:
        # Another run (the control worker's, say) may hold the lock and still be between a
        # batch's commit and its deletion from the stream: wait for the stream itself.
        do_ingest_usage()
        return (redis_client().xlen(usage_stream.STREAM) == 0
                and redis_client().xpending(usage_stream.STREAM,
                                            usage_stream.GROUP)["pending"] == 0)

    assert wait_until(drained, 60, interval=0.5)

    resumed_after = time.monotonic() - killed_at
    figures(sent=RECORDS, stored_at_kill=stored_at_kill, stored=UsageRecord.objects.count(),
            seconds_until_all_stored=round(resumed_after))
    assert stored_at_kill < RECORDS  # the kill came mid-ingest
    assert resumed_after < INGEST_LOCK_SECONDS + 10
    assert UsageRecord.objects.count() == RECORDS
