"""GPU time and tokens rolled up into hourly lines: exact to the microsecond, split at every
hour, unchanged by a transition, record or run delivered twice."""

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.db import connection, transaction
from django.db.models import Sum
from django.test.utils import CaptureQueriesContext

from accounts.models import Organization
from billing.models import GPUHour, StaleUsageHour, TokenHour, UsageRecord
from billing.rollup import do_roll_up_usage
from billing.services import do_record_usage
from endpoints.lifecycle import do_transition_replica
from endpoints.models import Node, NodeState, Replica, State
from endpoints.reconciler import reconcile_endpoint
from tests.billing.helpers import demo_endpoint, run_replica
from tests.factories import inference_key, usage_report
from tests.helpers import at_once

T0 = datetime(2026, 1, 31, 23, 30, tzinfo=UTC)  # half an hour before a month ends


def seconds_by_phase(**filters: object) -> dict[str, Decimal]:
    return dict(GPUHour.objects.filter(**filters).values("phase")
                .annotate(total=Sum("gpu_seconds")).values_list("phase", "total"))


@pytest.fixture
def replica(cpu_node: Node, org: Organization) -> Replica:
    with time_machine.travel(T0 - timedelta(minutes=1), tick=False):
        endpoint = demo_endpoint(org)
        return Replica.objects.create(endpoint=endpoint)


def test_a_replica_is_billed_every_second_of_each_phase_that_held_its_devices(
        replica: Replica, cpu_node: Node) -> None:
    run_replica(replica, cpu_node, [
        (T0, State.SCHEDULING), (T0 + timedelta(seconds=1), State.STARTING),
        (T0 + timedelta(seconds=12.5), State.LOADING), (T0 + timedelta(seconds=40), State.READY),
        (T0 + timedelta(hours=2, seconds=40), State.STOPPING),
        (T0 + timedelta(hours=2, seconds=47.25), State.STOPPED),
    ])

    intervals = list(replica.intervals.values_list("phase", "started_at", "ended_at"))
    assert [phase for phase, *_ in intervals] == ["starting", "loading", "ready", "stopping"]
    assert intervals[0][1] == T0 and intervals[-1][2] == T0 + timedelta(hours=2, seconds=47.25)
    assert do_roll_up_usage(now=T0 + timedelta(hours=3)) is not None
    assert seconds_by_phase() == {"starting": Decimal("12.5"), "loading": Decimal("27.5"),
                                  "ready": Decimal("7200"), "stopping": Decimal("7.25")}
    line = GPUHour.objects.first()
    assert (line.organization_id, line.endpoint_id, line.gpu_type.slug) == (
        replica.endpoint.organization_id, replica.endpoint_id, "cpu")


def test_a_span_across_midnight_at_a_month_s_end_lands_in_both_months(
        replica: Replica, cpu_node: Node) -> None:
    run_replica(replica, cpu_node, [
        (T0, State.SCHEDULING), (T0, State.STARTING), (T0, State.LOADING), (T0, State.READY),
        (T0 + timedelta(hours=1, minutes=15, microseconds=500_001), State.FAILED),
    ])
    do_roll_up_usage(now=T0 + timedelta(hours=2))

    assert seconds_by_phase(hour__lt=datetime(2026, 2, 1, tzinfo=UTC)) == {
        "ready": Decimal("1800")}
    assert seconds_by_phase(hour__gte=datetime(2026, 2, 1, tzinfo=UTC)) == {
        "ready": Decimal("2700.500001")}
    assert list(GPUHour.objects.order_by("hour").values_list("hour", flat=True)) == [
        datetime(2026, 1, 31, 23, tzinfo=UTC), datetime(2026, 2, 1, 0, tzinfo=UTC)]


def test_a_transition_delivered_twice_records_one_interval(replica: Replica,
                                                           cpu_node: Node) -> None:
    run_replica(replica, cpu_node, [(T0, State.SCHEDULING), (T0, State.STARTING)])
    with time_machine.travel(T0 + timedelta(seconds=5), tick=False):
        delivered = [do_transition_replica(replica_id=replica.id, from_states=[State.STARTING],
                                           to_state=State.LOADING, message="loading")
                     for _ in range(2)]

    assert delivered == [True, False]
    assert list(replica.intervals.values_list("phase", "ended_at")) == [
        ("starting", T0 + timedelta(seconds=5)), ("loading", None)]


def test_a_replica_of_a_lost_node_is_billed_until_the_node_s_last_heartbeat(
        replica: Replica, cpu_node: Node) -> None:
    run_replica(replica, cpu_node, [(T0, State.SCHEDULING), (T0, State.STARTING),
                                    (T0, State.LOADING), (T0, State.READY)])
    last_heartbeat = T0 + timedelta(minutes=10)
    Node.objects.filter(id=cpu_node.id).update(state=NodeState.LOST,
                                               last_heartbeat_at=last_heartbeat)
    with time_machine.travel(last_heartbeat + timedelta(minutes=2), tick=False):
        reconcile_endpoint(endpoint_id=replica.endpoint_id)

    assert Replica.objects.get(id=replica.id).state == State.STOPPED
    assert list(replica.intervals.values_list("phase", "ended_at")) == [
        ("starting", T0), ("loading", T0), ("ready", last_heartbeat)]


def test_the_current_hour_grows_until_the_replica_stops_and_settled_hours_stay(
        replica: Replica, cpu_node: Node) -> None:
    run_replica(replica, cpu_node, [(T0, State.SCHEDULING)])
    do_roll_up_usage(now=T0 + timedelta(minutes=10))
    assert seconds_by_phase() == {"starting": Decimal("600")}

    run_replica(replica, cpu_node, [(T0 + timedelta(hours=5), State.FAILED)])
    do_roll_up_usage(now=T0 + timedelta(hours=5, minutes=1))
    assert seconds_by_phase() == {"starting": Decimal(5 * 3600)}
    assert GPUHour.objects.count() == 6  # 23:30–00:00, four whole hours, 04:00–04:30


@pytest.mark.django_db(transaction=True)
def test_the_rollup_run_twice_or_by_two_workers_at_once_gives_the_same_totals(
        cpu_node: Node, org: Organization) -> None:
    endpoint = demo_endpoint(org)
    replica = Replica.objects.create(endpoint=endpoint)
    run_replica(replica, cpu_node, [(T0, State.SCHEDULING), (T0 + timedelta(hours=3), State.FAILED)])
    key, _ = inference_key(org)
    do_record_usage(payloads=[
        usage_report(endpoint, key, started_at=T0 + timedelta(minutes=minute),
                     prompt_tokens=minute, completion_tokens=1).encode()
        for minute in range(0, 150, 7)])
    now = T0 + timedelta(hours=4)

    def totals() -> tuple[object, ...]:
        return (tuple(GPUHour.objects.order_by("hour").values_list("hour", "gpu_seconds")),
                tuple(TokenHour.objects.order_by("hour").values_list(
                    "hour", "requests", "prompt_tokens", "completion_tokens")))

    runs = at_once(*[lambda: do_roll_up_usage(now=now)] * 2)
    concurrent = totals()
    do_roll_up_usage(now=now)

    assert len(runs) == 2 and any(runs)
    assert concurrent == totals()
    assert sum(seconds for _, seconds in concurrent[0]) == 3 * 3600
    assert [hour[1:] for hour in concurrent[1]] == [(5, 70, 5), (8, 476, 8), (9, 1071, 9)]
    assert not StaleUsageHour.objects.exists()


def test_records_of_an_hour_already_rolled_up_are_added_to_it(
        replica: Replica, org: Organization) -> None:
    key, _ = inference_key(org)
    endpoint = replica.endpoint
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=T0).encode()])
    do_roll_up_usage(now=T0 + timedelta(hours=1))
    late = usage_report(endpoint, key, started_at=T0 + timedelta(minutes=20), prompt_tokens=100)
    do_record_usage(payloads=[late.encode(), late.encode()])  # delivered twice
    do_roll_up_usage(now=T0 + timedelta(hours=2))

    line = TokenHour.objects.get()
    assert (line.hour, line.api_key_id, line.requests, line.prompt_tokens,
            line.completion_tokens) == (datetime(2026, 1, 31, 23, tzinfo=UTC), key.id, 2, 107, 8)
    assert UsageRecord.objects.count() == 2


@pytest.mark.parametrize(("shape", "records_per_indexed_hour", "marker"),
                         [("one pass", 10**12, "date_bin"), ("by index", 0, "LATERAL")])
def test_either_shape_of_the_token_rollup_writes_the_lines_of_the_records(
        replica: Replica, org: Organization, monkeypatch: pytest.MonkeyPatch, shape: str,
        records_per_indexed_hour: int, marker: str) -> None:
    first, second = inference_key(org)[0], inference_key(org)[0]
    endpoint = replica.endpoint
    hour = datetime(2026, 1, 31, 23, tzinfo=UTC)
    moments = {first: [hour - timedelta(microseconds=1), hour, hour + timedelta(minutes=59)],
               second: [hour + timedelta(minutes=59, seconds=59, microseconds=999_999),
                        hour + timedelta(hours=1)]}
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=moment).encode()
                              for key, keyed in moments.items() for moment in keyed])
    with connection.cursor() as cursor:  # so that reltuples counts the records
        cursor.execute("ANALYZE billing_usagerecord")
    monkeypatch.setattr("billing.rollup.RECORDS_PER_INDEXED_HOUR", records_per_indexed_hour)

    with CaptureQueriesContext(connection) as queries:
        do_roll_up_usage(now=hour + timedelta(hours=2))

    assert any(marker in query["sql"] and "billing_tokenhour" in query["sql"]
               for query in queries), f"the {shape} shape did not run"
    lines = set(TokenHour.objects.values_list("hour", "api_key_id", "requests",
                                              "prompt_tokens"))
    assert lines == {(hour - timedelta(hours=1), first.id, 1, 7), (hour, first.id, 2, 14),
                     (hour, second.id, 1, 7), (hour + timedelta(hours=1), second.id, 1, 7)}


@pytest.mark.django_db(transaction=True)
def test_records_stored_while_a_rollup_runs_are_rolled_up_by_the_next(
        cpu_node: Node, org: Organization) -> None:
    endpoint = demo_endpoint(org)
    Replica.objects.create(endpoint=endpoint)
    key, _ = inference_key(org)
    stored, go_on = threading.Event(), threading.Event()

    def ingest_held_open() -> None:
        # An ingest whose transaction has written its records and marked their hour, and
        # has not committed yet.
        try:
            with transaction.atomic():
                do_record_usage(payloads=[usage_report(endpoint, key, started_at=T0).encode()])
                stored.set()
                go_on.wait(30)
        finally:
            connection.close()

    ingest = threading.Thread(target=ingest_held_open)
    ingest.start()
    assert stored.wait(10)
    first = do_roll_up_usage(now=T0 + timedelta(hours=1))
    go_on.set()
    ingest.join(30)
    second = do_roll_up_usage(now=T0 + timedelta(hours=1))

    assert first.token_hours == 0 and second.token_hours == 1
    assert TokenHour.objects.get().requests == 1


def test_a_transition_on_a_host_whose_clock_is_behind_never_ends_an_interval_before_it_began(
        replica: Replica, cpu_node: Node) -> None:
    run_replica(replica, cpu_node, [(T0, State.SCHEDULING)])
    run_replica(replica, cpu_node, [(T0 - timedelta(seconds=5), State.STARTING),
                                    (T0 - timedelta(seconds=4), State.LOADING)])

    assert list(replica.intervals.order_by("id").values_list(
        "phase", "started_at", "ended_at")) == [("starting", T0, T0),
                                                ("loading", T0 - timedelta(seconds=4), None)]
