from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from rest_framework.test import APIClient

from accounts.models import Membership, Organization, Role
from billing.models import TokenPrice
from billing.rollup import do_roll_up_usage
from endpoints.models import Endpoint, Node, State
from tests.billing.helpers import finalize_at, ready_for, record, run_replica
from tests.factories import UserFactory, inference_key

FEB_1 = datetime(2026, 2, 1, tzinfo=UTC)
NOW = FEB_1 + timedelta(days=9)


@pytest.fixture
def billed(cpu_endpoint: Endpoint, cpu_node: Node) -> Endpoint:
    """January final (10 h ready, 1,000 completion tokens), February's draft under way."""
    endpoint = cpu_endpoint
    TokenPrice.objects.create(model=endpoint.model, completion_per_million_usd=Decimal("100"),
                              effective_from=datetime(2025, 1, 1, tzinfo=UTC))
    key, _ = inference_key(endpoint.organization)
    ready_for(endpoint, cpu_node, datetime(2026, 1, 10, 8, tzinfo=UTC), hours=10)
    record(endpoint, key, datetime(2026, 1, 10, 9, tzinfo=UTC), completion_tokens=1_000)
    finalize_at(FEB_1 + timedelta(hours=2))
    record(endpoint, key, datetime(2026, 2, 3, tzinfo=UTC), completion_tokens=5_000)
    finalize_at(NOW)
    return endpoint


@pytest.fixture
def at_now() -> object:
    with time_machine.travel(NOW, tick=False):
        yield


def test_it_lists_the_month_s_draft_and_the_final_invoices(
        owner_api: APIClient, org: Organization, billed: Endpoint, at_now: None) -> None:
    response = owner_api.get(f"/api/v1/organizations/{org.slug}/invoices/")

    assert response.status_code == 200, response.content
    assert [(invoice["month"], invoice["status"], invoice["total_cents"])
            for invoice in response.json()["results"]] == [("2026-02", "draft", 50),
                                                           ("2026-01", "final", 410)]
    final = response.json()["results"][1]
    assert final["number"] == f"KVR-202601-{org.slug}"
    assert final["url"] == f"/api/v1/organizations/{org.slug}/invoices/2026-01/"


def test_an_invoice_shows_its_lines_and_each_drills_down_to_its_ledger_rows(
        owner_api: APIClient, org: Organization, billed: Endpoint, at_now: None) -> None:
    invoice = owner_api.get(f"/api/v1/organizations/{org.slug}/invoices/2026-01/").json()

    lines = {line["description"]: line for line in invoice["lines"]}
    ready, tokens = lines["chat: CPU only, ready"], lines["chat: completion tokens"]
    assert (ready["quantity"], ready["unit"], ready["unit_price_usd"], ready["amount_cents"]) == (
        "10.000000", "GPU-hour", "0.4000", 400)
    assert (tokens["quantity"], tokens["amount_cents"]) == ("0.001000", 10)

    intervals = owner_api.get(ready["usage_url"]).json()["results"]
    assert [(row["phase"], row["seconds"]) for row in intervals] == [("ready", "36000")]
    records = owner_api.get(tokens["usage_url"]).json()["results"]
    assert [row["completion_tokens"] for row in records] == [1_000]


def test_members_see_no_invoices(api: APIClient, org: Organization, billed: Endpoint,
                                 at_now: None) -> None:
    member = UserFactory()
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    api.force_authenticate(member)

    response = api.get(f"/api/v1/organizations/{org.slug}/invoices/")

    assert response.status_code == 403
    assert "owners and admins" in response.json()["error"]["message"]


def test_it_validates_ownership(owner_api: APIClient, other_org: Organization,
                                billed: Endpoint, at_now: None) -> None:
    for path in ["invoices/", "invoices/2026-01/", "invoices/2026-01/lines/1/usage/"]:
        assert owner_api.get(f"/api/v1/organizations/{other_org.slug}/{path}").status_code == 404


@pytest.mark.parametrize("path", ["invoices/2026-13/", "invoices/2026-03/",
                                  "invoices/2026-01/lines/9/usage/",
                                  "invoices/2026-01/lines/0/usage/", "invoices/0001-01/",
                                  "invoices/0001-01/lines/1/usage/"])
def test_a_month_or_line_that_does_not_exist_is_a_404(
        owner_api: APIClient, org: Organization, billed: Endpoint, at_now: None,
        path: str) -> None:
    response = owner_api.get(f"/api/v1/organizations/{org.slug}/{path}")

    assert response.status_code == 404
    assert response.json()["error"]["message"]


def test_an_endpoint_s_cost_per_million_tokens_over_the_last_hour_and_day(
        api: APIClient, org: Organization, cpu_endpoint: Endpoint, cpu_node: Node) -> None:
    now = datetime(2026, 2, 10, 0, 30, tzinfo=UTC)
    replica = cpu_endpoint.replicas.get()
    run_replica(replica, cpu_node, [(now - timedelta(hours=3), State.SCHEDULING),
                                    (now - timedelta(hours=3), State.STARTING),
                                    (now - timedelta(hours=3), State.LOADING),
                                    (now - timedelta(hours=3), State.READY)])
    key, _ = inference_key(org)
    for minutes_ago in (10, 20, 120):
        record(cpu_endpoint, key, now - timedelta(minutes=minutes_ago), prompt_tokens=100_000,
               completion_tokens=100_000)
    member = UserFactory()
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    api.force_authenticate(member)

    with time_machine.travel(now, tick=False):
        do_roll_up_usage()
        response = api.get(f"/api/v1/organizations/{org.slug}/endpoints/chat/cost/")

    assert response.status_code == 200, response.content
    assert response.json() == {
        "endpoint": "chat", "hourly_price_usd": str(cpu_endpoint.hourly_price_usd),
        "month_to_date_cents": 120,  # three hours at $0.40
        "last_hour": {"gpu_cost_usd": "0.400000", "tokens": 400_000,
                      "usd_per_million_tokens": "1.0000"},
        "last_day": {"gpu_cost_usd": "1.200000", "tokens": 600_000,
                     "usd_per_million_tokens": "2.0000"},
    }
    assert api.get(f"/api/v1/organizations/{org.slug}/endpoints/nope/cost/").status_code == 404


def test_daily_usage_lists_gpu_hours_and_tokens_per_day_for_every_member(
        api: APIClient, org: Organization, billed: Endpoint) -> None:
    member = UserFactory()
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    api.force_authenticate(member)

    with time_machine.travel(NOW, tick=False):
        response = api.get(f"/api/v1/organizations/{org.slug}/usage/", {"days": "32"})
        refused = api.get(f"/api/v1/organizations/{org.slug}/usage/", {"days": "0"})

    assert response.status_code == 200
    days = {row["day"]: row for row in response.json()}
    assert len(days) == 32
    assert days["2026-01-10"]["gpu_hours"] == "10.009722"  # 10 h ready, 35 s around it
    assert (days["2026-01-10"]["completion_tokens"], days["2026-02-03"]["completion_tokens"]) == (
        1_000, 5_000)
    assert refused.status_code == 400 and "days" in refused.json()["error"]["fields"]
