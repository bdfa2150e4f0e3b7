"""Spend caps checked in flight: one event per threshold, and a stop budget that holds the
organisation, stops its endpoints and passes its limit by no more than the stated bound."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.core.exceptions import PermissionDenied, ValidationError

from accounts.models import Organization, Role
from billing.budgets import do_enforce_budgets, do_set_budget, spend_of
from billing.models import BudgetAction, BudgetEvent
from billing.money import cents
from billing.rollup import do_roll_up_usage
from endpoints.lifecycle import do_transition_replica
from endpoints.models import DesiredState, Endpoint, Node, Replica, State
from endpoints.reconciler import reconcile_endpoint
from endpoints.services import do_start_endpoint
from tests.billing.helpers import run_replica

START = datetime(2026, 3, 10, 8, tzinfo=UTC)
CHECK_SECONDS = 300
RATE = Decimal("0.4")  # the cpu_endpoint fixture's price, one replica


@pytest.fixture
def running(cpu_endpoint: Endpoint, cpu_node: Node, settings: object) -> Endpoint:
    settings.KVRUN_BUDGET_CHECK_SECONDS = CHECK_SECONDS
    replica = cpu_endpoint.replicas.get()
    run_replica(replica, cpu_node, [(START, State.SCHEDULING), (START, State.STARTING),
                                    (START, State.LOADING), (START, State.READY)])
    return cpu_endpoint


def check_at(moment: datetime) -> int:
    """What beat does every KVRUN_BUDGET_CHECK_SECONDS: roll up, then check the budgets."""
    with time_machine.travel(moment, tick=False):
        do_roll_up_usage()
        return do_enforce_budgets()


def set_budget(org: Organization, limit_cents: int, action: str) -> None:
    with time_machine.travel(START, tick=False):
        do_set_budget(organization=org, actor_role=Role.OWNER, monthly_limit_cents=limit_cents,
                      thresholds=[100, 50, 80], action=action)


def test_each_threshold_records_one_event_when_the_projection_reaches_it(
        running: Endpoint, org: Organization) -> None:
    set_budget(org, 100, BudgetAction.ALERT)  # $1.00: 2.5 hours at $0.40

    for step in range(1, 49):  # four hours of checks
        check_at(START + timedelta(seconds=CHECK_SECONDS * step))

    events = list(BudgetEvent.objects.order_by("threshold"))
    assert [event.threshold for event in events] == [50, 80, 100]
    for event in events:
        # The first check whose projection (spend + one interval at $0.40/h) reached it.
        assert event.projected_cents * 100 >= event.threshold * 100
        assert event.projected_cents - cents(RATE * CHECK_SECONDS / 3600) < event.threshold
        assert not event.stopped
    assert Endpoint.objects.get(id=running.id).desired_state == DesiredState.RUNNING
    assert Organization.objects.get(id=org.id).billing_hold == ""


def test_a_stop_budget_stops_the_endpoints_within_the_stated_overshoot(
        running: Endpoint, org: Organization, cpu_node: Node, settings: object) -> None:
    set_budget(org, 100, BudgetAction.STOP)
    stopped_at = None
    for step in range(1, 49):
        moment = START + timedelta(seconds=CHECK_SECONDS * step)
        check_at(moment)
        if Endpoint.objects.get(id=running.id).desired_state == DesiredState.STOPPED:
            stopped_at = moment
            break
    assert stopped_at is not None
    # The worker reconciles; the engine drains its requests as long as it may, then takes
    # its whole grace to stop: the longest a stop can bill.
    with time_machine.travel(stopped_at, tick=False):
        reconcile_endpoint(endpoint_id=running.id)
    replica = Replica.objects.get(endpoint=running)
    assert replica.state == State.STOPPING
    stopping = settings.KVRUN_ENGINE_DRAIN_SECONDS + settings.KVRUN_ENGINE_STOP_GRACE_SECONDS
    gone = stopped_at + timedelta(seconds=stopping)
    with time_machine.travel(gone, tick=False):
        assert do_transition_replica(replica_id=replica.id, from_states=[State.STOPPING],
                                     to_state=State.STOPPED, message="engine stopped")
    check_at(gone + timedelta(hours=1))

    with time_machine.travel(gone + timedelta(hours=1), tick=False):
        final = spend_of(organization=org).so_far_cents
    bound = cents(RATE * Decimal(CHECK_SECONDS + stopping) / 3600)
    assert final - 100 <= bound
    hold = Organization.objects.get(id=org.id).billing_hold
    assert "monthly budget of $1.00 is reached" in hold and f"/orgs/{org.slug}/billing/" in hold
    assert [(event.threshold, event.stopped) for event in
            BudgetEvent.objects.order_by("threshold")] == [(50, False), (80, False), (100, True)]
    with pytest.raises(ValidationError, match="monthly budget of \\$1.00 is reached"):
        do_start_endpoint(endpoint=running, actor_role=Role.OWNER)

    # Raised above what the month has cost, the hold lifts at once; the endpoint may start.
    with time_machine.travel(gone + timedelta(hours=1), tick=False):
        do_set_budget(organization=org, actor_role=Role.OWNER, monthly_limit_cents=10_000,
                      thresholds=[100], action=BudgetAction.STOP)
        do_start_endpoint(endpoint=running, actor_role=Role.OWNER)
    assert Organization.objects.get(id=org.id).billing_hold == ""
    assert Endpoint.objects.get(id=running.id).desired_state == DesiredState.RUNNING


def test_a_new_month_lifts_the_hold(running: Endpoint, org: Organization) -> None:
    set_budget(org, 10, BudgetAction.STOP)
    check_at(START + timedelta(hours=1))
    assert Organization.objects.get(id=org.id).billing_hold

    check_at(datetime(2026, 4, 1, 0, 1, tzinfo=UTC))

    assert Organization.objects.get(id=org.id).billing_hold == ""


@pytest.mark.parametrize(("limit", "thresholds", "field"), [
    (0, [100], "monthly_limit_cents"), (100, [], "thresholds"), (100, [0, 50], "thresholds"),
    (100, list(range(10, 120, 10)), "thresholds"),  # eleven: more than a handful
])
def test_a_budget_that_makes_no_sense_is_refused(org: Organization, limit: int,
                                                 thresholds: list[int], field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        do_set_budget(organization=org, actor_role=Role.OWNER, monthly_limit_cents=limit,
                      thresholds=thresholds, action=BudgetAction.STOP)

    assert field in refused.value.message_dict
    assert not Organization.objects.get(id=org.id).budget_events.exists()


def test_members_cannot_set_the_budget(org: Organization) -> None:
    with pytest.raises(PermissionDenied, match="owners and admins"):
        do_set_budget(organization=org, actor_role=Role.MEMBER, monthly_limit_cents=100,
                      thresholds=[100], action=BudgetAction.STOP)


def test_a_stop_budget_without_a_100_percent_threshold_stays_stopped_for_the_month(
        running: Endpoint, org: Organization) -> None:
    with time_machine.travel(START, tick=False):
        do_set_budget(organization=org, actor_role=Role.OWNER, monthly_limit_cents=50,
                      thresholds=[50, 80], action=BudgetAction.STOP)
    check_at(START + timedelta(hours=2))  # $0.80 spent
    assert Endpoint.objects.get(id=running.id).desired_state == DesiredState.STOPPED

    replica = Replica.objects.get(endpoint=running)
    with time_machine.travel(START + timedelta(hours=2, seconds=5), tick=False):
        do_transition_replica(replica_id=replica.id, from_states=[replica.state],
                              to_state=State.STOPPED, message="engine stopped")
    check_at(START + timedelta(hours=5))

    assert "monthly budget of $0.50 is reached" in Organization.objects.get(id=org.id).billing_hold
