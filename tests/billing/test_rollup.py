"""GPU time and tokens rolled up into hourly lines: exact to the microsecond, split at every
hour, unchanged by a transition, record or run delivered twice."""

import math
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.db import connection, transaction
from django.db.models import Sum

from accounts.models import APIKey, Organization
from billing.ingestion import do_record_usage
from billing.models import (
    MAX_ROLLUP_BATCH_HOURS,
    GPUHour,
    RollupState,
    StaleUsageHour,
    TokenHour,
    UsageRecord,
)
from billing.rollup import FIRST_KEY, TAKE, do_roll_up_usage, hour_of
from endpoints.lifecycle import do_transition_replica
from endpoints.models import Endpoint, Node, NodeState, Replica, State
from endpoints.reconciler import reconcile_endpoint
from tests.billing.helpers import run_replica
from tests.factories import demo_endpoint, inference_key, usage_report
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
    run_replica(replica, cpu_node,
                [(T0, State.SCHEDULING), (T0 + timedelta(hours=3), State.FAILED)])
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


def line_of(endpoint: Endpoint, hour: datetime) -> tuple:
    line = TokenHour.objects.get(endpoint=endpoint, hour=hour)
    return line.requests, line.prompt_tokens, line.rolled_up_at


@pytest.fixture
def key(org: Organization) -> APIKey:
    return inference_key(org)[0]


@pytest.fixture
def three_endpoints(cpu_node: Node, org: Organization, key: APIKey) -> list[Endpoint]:
    """Three endpoints of one organisation, each with one record in the hour from T0 - 30
    minutes, rolled up."""
    endpoints = [demo_endpoint(org, name=name) for name in ("a", "b", "c")]
    for endpoint in endpoints:
        Replica.objects.create(endpoint=endpoint)
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=T0).encode()
                              for endpoint in endpoints])
    do_roll_up_usage(now=T0 + timedelta(minutes=20))
    return endpoints


def test_a_late_record_in_an_hour_others_have_rolled_up_is_added_and_theirs_stay(
        three_endpoints: list[Endpoint], key: APIKey) -> None:
    # One of three endpoints stale in the hour: read endpoint by endpoint.
    first, *others = three_endpoints
    hour = hour_of(T0)
    before = [line_of(endpoint, hour) for endpoint in others]
    do_record_usage(payloads=[usage_report(first, key, started_at=moment,
                                           prompt_tokens=100).encode()
                              for moment in (hour, hour + timedelta(minutes=59, seconds=59,
                                                                    microseconds=999_999),
                                             hour + timedelta(hours=1))])
    do_roll_up_usage(now=T0 + timedelta(hours=2))

    assert line_of(first, hour)[:2] == (3, 207)
    assert line_of(first, hour + timedelta(hours=1))[:2] == (1, 100)
    assert [line_of(endpoint, hour) for endpoint in others] == before


def test_an_hour_stale_for_most_endpoints_is_rewritten_and_the_others_stay(
        three_endpoints: list[Endpoint], key: APIKey) -> None:
    # Two of three endpoints stale in the hour: the hour is read whole, by time.
    *stale, kept = three_endpoints
    hour = hour_of(T0)
    before = line_of(kept, hour)
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=moment).encode()
                              for endpoint in stale
                              for moment in (hour - timedelta(microseconds=1), hour)])
    do_roll_up_usage(now=T0 + timedelta(hours=2))

    assert [line_of(endpoint, hour)[:2] for endpoint in stale] == [(2, 14), (2, 14)]
    assert [line_of(endpoint, hour - timedelta(hours=1))[:2] for endpoint in stale] == [
        (1, 7), (1, 7)]
    assert line_of(kept, hour) == before
    assert not StaleUsageHour.objects.exists()


def test_an_hour_marked_again_keeps_the_time_it_went_stale(
        replica: Replica, org: Organization) -> None:
    key, _ = inference_key(org)
    do_record_usage(payloads=[usage_report(replica.endpoint, key, started_at=T0).encode()])
    marked = StaleUsageHour.objects.get().marked_at
    do_record_usage(payloads=[usage_report(replica.endpoint, key, started_at=T0).encode()])

    assert StaleUsageHour.objects.get().marked_at == marked


def mark_hours(endpoint: Endpoint, count: int, *, start: datetime) -> None:
    """`count` stale hours of the endpoint from `start`, in SQL, as a backlog leaves them."""
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO billing_staleusagehour (endpoint_id, hour, marked_at)
            SELECT %s, %s + g * interval '1 hour', now() FROM generate_series(0, %s - 1) g
            ON CONFLICT DO NOTHING""", [endpoint.id, start, count])


def take_plan() -> str:
    """How PostgreSQL would take the first batch now."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("CREATE TEMPORARY TABLE stale (endpoint_id uuid, hour timestamptz)")
        cursor.execute("EXPLAIN " + TAKE, {"hour": FIRST_KEY[0], "endpoint": FIRST_KEY[1],
                                           "batch": MAX_ROLLUP_BATCH_HOURS})
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return plan


BACKLOG = 150_000
BACKLOG_START = datetime(2009, 1, 1, tzinfo=UTC)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("statistics", ["none", "vacuumed nearly empty", "analyzed"])
def test_a_backlog_of_150000_stale_hours_is_taken_in_bounded_time_whatever_the_statistics(
        cpu_node: Node, org: Organization, settings: object, statistics: str) -> None:
    """The first rollup after a burst of stale hours, before autovacuum has analyzed them.
    "vacuumed nearly empty" is what a rollup that took every mark leaves once autovacuum has
    vacuumed and not yet analyzed: the statistics say the table holds a row or two, and a
    take planned on that claim as a join (the rollup before batches) ran for hours."""
    endpoint = demo_endpoint(org)
    Replica.objects.create(endpoint=endpoint)
    key, _ = inference_key(org)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE billing_staleusagehour SET (autovacuum_enabled = false)")
    try:
        if statistics == "vacuumed nearly empty":
            mark_hours(endpoint, BACKLOG, start=BACKLOG_START - timedelta(hours=BACKLOG))
            last = StaleUsageHour.objects.latest("id").id
            StaleUsageHour.objects.exclude(id=last).delete()
            with connection.cursor() as cursor:
                cursor.execute("VACUUM billing_staleusagehour")
        mark_hours(endpoint, BACKLOG, start=BACKLOG_START)
        if statistics == "analyzed":
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE billing_staleusagehour")
        stale = StaleUsageHour.objects.count()
        late = BACKLOG_START + timedelta(hours=BACKLOG - 1, minutes=30)
        do_record_usage(payloads=[usage_report(endpoint, key, started_at=moment).encode()
                                  for moment in (BACKLOG_START, late, late)])
        plan = take_plan()
        settings.KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS = 5
        with connection.cursor() as cursor:
            # A rollup that set no timeout of its own would meet this one.
            cursor.execute("SET statement_timeout = '5s'")
        try:
            rollup = do_roll_up_usage(now=late + timedelta(hours=1))
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET statement_timeout")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE billing_staleusagehour RESET (autovacuum_enabled)")

    assert "Seq Scan on billing_staleusagehour" not in plan
    assert "Index Scan using billing_stale_usage_hour_key" in plan
    assert rollup.complete and rollup.token_hours == stale
    assert rollup.batches == math.ceil(stale / MAX_ROLLUP_BATCH_HOURS)
    assert not StaleUsageHour.objects.exists()
    assert sorted(TokenHour.objects.values_list("hour", "requests")) == [
        (BACKLOG_START, 1), (hour_of(late), 2)]


def hold_line(hour: datetime, held: threading.Event, release: threading.Event) -> None:
    """Hold a lock on the token line of `hour`, as a long query of an operator might."""
    try:
        with transaction.atomic():
            TokenHour.objects.select_for_update().get(hour=hour)
            held.set()
            release.wait(30)
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_batch_past_the_timeout_is_undone_and_later_runs_take_smaller_batches(
        cpu_node: Node, org: Organization, settings: object) -> None:
    endpoint = demo_endpoint(org)
    Replica.objects.create(endpoint=endpoint)
    key, _ = inference_key(org)
    hours = [T0 + timedelta(hours=n) for n in range(600)]
    now = hours[-1] + timedelta(hours=1)
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=hour).encode()
                              for hour in hours])
    do_roll_up_usage(now=now)
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=hour).encode()
                              for hour in hours])
    RollupState.objects.filter(id=1).update(batch_hours=400)
    settings.KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS = 3
    held, release = threading.Event(), threading.Event()
    # A line of the second batch.
    holder = threading.Thread(target=hold_line, args=(hour_of(hours[450]), held, release))
    holder.start()
    try:
        assert held.wait(10)
        stopped = do_roll_up_usage(now=now)
    finally:
        release.set()
        holder.join(30)
    state = RollupState.objects.get()
    requests = dict(TokenHour.objects.values_list("hour", "requests"))

    assert (stopped.complete, stopped.batches, stopped.token_hours) == (False, 1, 400)
    assert [requests[hour_of(hour)] for hour in hours] == [2] * 400 + [1] * 200
    assert StaleUsageHour.objects.count() == 200
    assert state.batch_hours == 200 and state.timed_out_at is not None
    assert "ran past the timeout and was rolled back" in state.timeout_reason
    assert "the next runs take batches of 200" in state.timeout_reason

    resumed = do_roll_up_usage(now=now)

    assert resumed.complete and resumed.token_hours == 200
    assert set(TokenHour.objects.values_list("requests", flat=True)) == {2}
    assert not StaleUsageHour.objects.exists()
    assert RollupState.objects.get().batch_hours == 400  # quick batches: room for twice as many


@pytest.mark.django_db(transaction=True)
def test_a_first_batch_past_the_timeout_leaves_the_gpu_hours_rolled_up_all_the_same(
        cpu_node: Node, org: Organization, settings: object) -> None:
    endpoint = demo_endpoint(org)
    replica = Replica.objects.create(endpoint=endpoint)
    run_replica(replica, cpu_node, [(T0, State.SCHEDULING)])
    key, _ = inference_key(org)
    now = T0 + timedelta(hours=1)
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=T0).encode()])
    do_roll_up_usage(now=now)
    do_record_usage(payloads=[usage_report(endpoint, key, started_at=T0).encode()])
    GPUHour.objects.all().delete()
    settings.KVRUN_BILLING_ROLLUP_TIMEOUT_SECONDS = 3
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_line, args=(hour_of(T0), held, release))
    holder.start()
    try:
        assert held.wait(10)
        rollup = do_roll_up_usage(now=now)
    finally:
        release.set()
        holder.join(30)

    assert rollup is not None and (rollup.batches, rollup.complete) == (0, False)
    assert seconds_by_phase() == {"starting": Decimal(3600)}
    assert StaleUsageHour.objects.count() == 1 and TokenHour.objects.get().requests == 1
    assert "ran past the timeout" in RollupState.objects.get().timeout_reason


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
