"""Usage records move from the gateways' Redis stream into PostgreSQL exactly once."""

import dataclasses
import time
from datetime import timedelta
from decimal import Decimal
from uuid import uuid4

import pytest

from accounts.models import APIKey, Organization
from billing import usage_stream
from billing.ingestion import do_ingest_usage, do_record_usage
from billing.models import StaleUsageHour, TokenHour, UsageRecord
from billing.rollup import do_roll_up_usage
from billing.usage_stream import UsageReport
from endpoints.models import Endpoint
from kvrun.common.redis import redis_client
from tests.factories import USAGE_STARTED as STARTED
from tests.factories import inference_key, ready_endpoint
from tests.factories import usage_report as record

pytestmark = pytest.mark.usefixtures("usage_stream")


@pytest.fixture
def ready_chat(org: Organization) -> Endpoint:
    return ready_endpoint(org, "chat", [41000])


@pytest.fixture
def key(org: Organization) -> APIKey:
    return inference_key(org)[0]


def append(*reports: UsageReport) -> None:
    for one in reports:
        redis_client().xadd(usage_stream.STREAM, {usage_stream.FIELD: one.encode()})


def test_a_report_carries_every_field_of_a_usage_record_by_its_name() -> None:
    stored = {field.attname for field in UsageRecord._meta.concrete_fields} - {"id", "ingested_at"}

    assert {field.name for field in dataclasses.fields(UsageReport)} == stored


def test_a_report_comes_back_from_the_stream_exactly_as_it_was_sent() -> None:
    sent = UsageReport(
        request_id="req_1", idempotency_key="order-1", organization_id=str(uuid4()),
        endpoint_id=str(uuid4()), replica_id=None, api_key_id=str(uuid4()), operation="completions",
        stream=True, prompt_tokens=7, completion_tokens=4, cached_tokens=3, status_code=499,
        error_code="client_disconnected", client_disconnected=True, started_at=STARTED,
        time_to_first_token_ms=5, duration_ms=12, gateway_overhead_ms=Decimal("0.412"))

    assert UsageReport.decode(sent.encode()) == sent


@pytest.mark.django_db(transaction=True)
def test_it_stores_each_record_and_empties_the_stream(ready_chat: Endpoint, key: APIKey) -> None:
    first = record(ready_chat, key)
    second = record(ready_chat, key, stream=True, time_to_first_token_ms=5)
    append(first, second)

    assert do_ingest_usage() == 2

    stored = UsageRecord.objects.get(request_id=first.request_id)
    assert stored.started_at == STARTED
    assert (stored.prompt_tokens, stored.completion_tokens, stored.duration_ms) == (7, 4, 12)
    assert str(stored.gateway_overhead_ms) == "0.412"
    assert UsageRecord.objects.get(request_id=second.request_id).time_to_first_token_ms == 5
    assert redis_client().xlen(usage_stream.STREAM) == 0
    assert APIKey.objects.get(id=key.id).last_used_at == STARTED
    assert do_ingest_usage() == 0


@pytest.mark.django_db(transaction=True)
def test_a_batch_delivered_twice_is_stored_once(ready_chat: Endpoint, key: APIKey) -> None:
    one = record(ready_chat, key).encode()

    assert do_record_usage(payloads=[one]) == []
    assert do_record_usage(payloads=[one, one]) == []

    assert UsageRecord.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_entries_a_dead_worker_had_read_are_stored_on_the_next_run(
    ready_chat: Endpoint, key: APIKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    append(record(ready_chat, key), record(ready_chat, key))
    do_ingest_usage(max_batches=0)  # creates the consumer group, reads nothing
    client = redis_client()
    # One worker read an entry under this host's name and died before acknowledging it;
    # another host's worker read the second one and died too.
    client.xreadgroup(usage_stream.GROUP, socket.gethostname(), {usage_stream.STREAM: ">"},
                      count=1)
    client.xreadgroup(usage_stream.GROUP, "elsewhere", {usage_stream.STREAM: ">"}, count=1)
    monkeypatch.setattr("billing.ingestion.CLAIM_IDLE_MS", 0)

    assert do_ingest_usage() == 2

    assert UsageRecord.objects.count() == 2
    assert client.xpending(usage_stream.STREAM, usage_stream.GROUP)["pending"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_record_that_cannot_be_stored_goes_to_dead_letters_and_holds_back_nothing(
    ready_chat: Endpoint, key: APIKey
) -> None:
    good = record(ready_chat, key)
    orphan = record(ready_chat, key, endpoint_id=str(uuid4()))  # no such endpoint
    append(good, orphan)
    redis_client().xadd(usage_stream.STREAM, {usage_stream.FIELD: b"not json"})
    redis_client().xadd(usage_stream.STREAM, {usage_stream.FIELD: b'{"request_id": "req_x"}'})

    assert do_ingest_usage() == 4

    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == [good.request_id]
    dead = redis_client().xrange(usage_stream.DEAD_LETTERS)
    assert len(dead) == 3
    assert redis_client().xlen(usage_stream.STREAM) == 0


@pytest.mark.django_db(transaction=True)
def test_last_used_at_never_moves_backwards(ready_chat: Endpoint, key: APIKey) -> None:
    later = STARTED + timedelta(minutes=5)
    APIKey.objects.filter(id=key.id).update(last_used_at=later)
    append(record(ready_chat, key))

    do_ingest_usage()

    assert APIKey.objects.get(id=key.id).last_used_at == later


@pytest.mark.django_db(transaction=True)
def test_a_record_no_column_takes_is_set_aside_and_ingestion_goes_on(ready_chat: Endpoint,
                                                                      key: APIKey) -> None:
    # Before, one such value (DataError) stopped ingestion for every organisation: the batch
    # was never acknowledged and every later run read it again first.
    before = record(ready_chat, key)
    poison = record(ready_chat, key, gateway_overhead_ms=Decimal("10000000000000.000"))
    after = record(ready_chat, key)
    longest = record(ready_chat, key, duration_ms=2**31 - 1,
                     gateway_overhead_ms=Decimal("2147483647.000"))
    append(before, poison, after, longest)

    assert do_ingest_usage() == 4
    append(later := record(ready_chat, key))
    assert do_ingest_usage() == 1

    stored = set(UsageRecord.objects.values_list("request_id", flat=True))
    assert stored == {before.request_id, after.request_id, longest.request_id, later.request_id}
    ((_, dead),) = redis_client().xrange(usage_stream.DEAD_LETTERS)
    assert UsageReport.decode(dead[usage_stream.FIELD]).request_id == poison.request_id
    assert dead[usage_stream.ERROR_FIELD].startswith(b"DataError")
    assert redis_client().xlen(usage_stream.STREAM) == 0


@pytest.mark.django_db(transaction=True)
def test_a_malformed_record_says_why() -> None:
    ((payload, reason),) = do_record_usage(payloads=[b"not a report"])

    assert payload == b"not a report"
    assert reason.startswith("malformed: ")


def trace(report: UsageReport, *, seen_ms: int) -> None:
    """What admission leaves for a request (gateway.limits), as last renewed at `seen_ms`."""
    redis_client().hset(usage_stream.ADMITTED, report.request_id, report.encode())
    redis_client().zadd(usage_stream.ADMITTED_SEEN, {report.request_id: seen_ms})


@pytest.mark.django_db(transaction=True)
def test_a_request_whose_gateway_died_is_stored_as_interrupted(ready_chat: Endpoint,
                                                               key: APIKey) -> None:
    now_ms = time.time_ns() // 1_000_000
    interrupted = record(ready_chat, key, status_code=usage_stream.INTERRUPTED_STATUS,
                         error_code=usage_stream.INTERRUPTED_CODE, prompt_tokens=9,
                         completion_tokens=0)
    running = record(ready_chat, key, status_code=usage_stream.INTERRUPTED_STATUS,
                     error_code=usage_stream.INTERRUPTED_CODE)
    trace(interrupted, seen_ms=now_ms - usage_stream.lease_ms() - 1_000)
    trace(running, seen_ms=now_ms)

    assert do_ingest_usage() == 1

    stored = UsageRecord.objects.get()
    assert stored.request_id == interrupted.request_id
    assert (stored.status_code, stored.error_code, stored.prompt_tokens) == (
        502, "gateway_interrupted", 9)
    # A request whose gateway still renews its trace is left to finish.
    assert redis_client().hkeys(usage_stream.ADMITTED) == [running.request_id.encode()]
    assert redis_client().zrange(usage_stream.ADMITTED_SEEN, 0, -1) == [
        running.request_id.encode()]


@pytest.mark.django_db(transaction=True)
def test_a_request_already_recorded_is_not_recorded_again_as_interrupted(
    ready_chat: Endpoint, key: APIKey
) -> None:
    # Its gateway wrote the record to PostgreSQL while Redis was away, so the trace stayed.
    finished = record(ready_chat, key)
    do_record_usage(payloads=[finished.encode()])
    trace(dataclasses.replace(finished, status_code=502, error_code="gateway_interrupted"),
          seen_ms=time.time_ns() // 1_000_000 - usage_stream.lease_ms() - 1)

    assert do_ingest_usage() == 1

    assert UsageRecord.objects.get().status_code == 200
    assert redis_client().hlen(usage_stream.ADMITTED) == 0


def interrupted(report: UsageReport, completion_tokens: int) -> UsageReport:
    """The trace of `report`'s request as ingestion stores it once its lease ran out."""
    return dataclasses.replace(report, status_code=usage_stream.INTERRUPTED_STATUS,
                               error_code=usage_stream.INTERRUPTED_CODE,
                               completion_tokens=completion_tokens)


def stored(report: UsageReport) -> tuple[int, str, int]:
    row = UsageRecord.objects.get(request_id=report.request_id)
    return row.status_code, row.error_code, row.completion_tokens


def test_a_final_record_replaces_its_request_s_interrupted_one_and_its_hour_is_rolled_up_again(
        ready_chat: Endpoint, key: APIKey) -> None:
    final = record(ready_chat, key, completion_tokens=40)
    do_record_usage(payloads=[interrupted(final, 10).encode()])
    do_roll_up_usage(now=STARTED + timedelta(hours=2))
    assert TokenHour.objects.get(endpoint=ready_chat).completion_tokens == 10

    assert do_record_usage(payloads=[final.encode()]) == []

    assert stored(final) == (200, "", 40)
    assert UsageRecord.objects.count() == 1
    assert StaleUsageHour.objects.filter(endpoint=ready_chat).exists()
    do_roll_up_usage(now=STARTED + timedelta(hours=2))
    assert TokenHour.objects.get(endpoint=ready_chat).completion_tokens == 40


def test_an_interrupted_record_gives_way_only_to_more_of_its_request(
        ready_chat: Endpoint, key: APIKey) -> None:
    final, other = record(ready_chat, key, completion_tokens=40), record(ready_chat, key)
    do_record_usage(payloads=[final.encode(), interrupted(other, 10).encode()])

    # A late trace never replaces a final record; a trace with fewer tokens never replaces
    # one with more; a trace with more does.
    do_record_usage(payloads=[interrupted(final, 10).encode(), interrupted(other, 5).encode()])
    assert (stored(final), stored(other)) == ((200, "", 40), (502, "gateway_interrupted", 10))
    do_record_usage(payloads=[interrupted(other, 30).encode()])
    assert stored(other) == (502, "gateway_interrupted", 30)
