"""The endpoints list, an endpoint's page (live status, ETA, charts' data, snippets) and the
actions on it."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import Organization
from billing.models import UsageRecord
from endpoints.models import DesiredState, Endpoint, Node, Replica, State
from endpoints.policies import EndpointPolicy
from tests.factories import ready_endpoint

pytestmark = pytest.mark.django_db


def usage(endpoint: Endpoint, *, minutes_ago: float, status: int = 200, ttft: int = 100,
          tokens: int = 10) -> UsageRecord:
    return UsageRecord.objects.create(
        request_id=f"req-{UsageRecord.objects.count()}", organization=endpoint.organization,
        endpoint=endpoint, operation="chat.completions", prompt_tokens=tokens,
        completion_tokens=tokens, status_code=status,
        started_at=timezone.now() - timedelta(minutes=minutes_ago),
        time_to_first_token_ms=ttft, duration_ms=500, gateway_overhead_ms=Decimal("0.2"))


def test_the_list_shows_each_endpoint_with_its_last_hour(owner_client: Client,
                                                         org: Organization) -> None:
    chat = ready_endpoint(org, "chat", ports=[9001])
    ready_endpoint(org, "idle", ports=[])
    usage(chat, minutes_ago=5, tokens=7)
    usage(chat, minutes_ago=30, tokens=3)
    usage(chat, minutes_ago=90, tokens=100)  # older than an hour

    response = owner_client.get(f"/orgs/{org.slug}/")

    assert response.status_code == 200
    rows = {row["endpoint"].name: row for row in response.context["rows"]}
    assert (rows["chat"]["usage"].requests, rows["chat"]["usage"].tokens) == (2, 20)
    assert rows["chat"]["ready"] == 1
    assert rows["idle"]["usage"] is None


def test_the_list_costs_the_same_queries_for_many_endpoints(owner_client: Client,
                                                            org: Organization,
                                                            django_assert_max_num_queries: object
                                                            ) -> None:
    for n in range(3):
        ready_endpoint(org, f"e{n}", ports=[9000 + n])
    # Usage, this month's cost (GPU and token lines) and 24 h of GPU time and tokens, each
    # in a fixed number of queries.
    with django_assert_max_num_queries(16) as few:
        owner_client.get(f"/orgs/{org.slug}/")
    for n in range(3, 30):
        ready_endpoint(org, f"e{n}", ports=[9000 + n])

    with django_assert_max_num_queries(len(few.captured_queries)):
        owner_client.get(f"/orgs/{org.slug}/")


def test_a_starting_endpoint_shows_stage_percent_and_no_eta_without_history(
        owner_client: Client, org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[], state=State.LOADING)
    Replica.objects.create(endpoint=endpoint, node=Node.objects.get(), state=State.LOADING,
                           stage="loading weights and allocating the KV cache",
                           progress_percent=50)

    response = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/status/")

    assert response.status_code == 200
    assert b"loading weights and allocating the KV cache" in response.content
    assert b'aria-valuenow="50"' in response.content
    assert b"no estimate yet" in response.content
    assert b"left" not in response.content


def test_the_eta_is_the_median_of_past_starts_of_this_model_on_this_hardware(
        owner_client: Client, org: Organization) -> None:
    earlier = ready_endpoint(org, "earlier", ports=[])
    node = Node.objects.get()
    now = timezone.now()
    for seconds in (30, 40, 200):  # the median is 40 s
        Replica.objects.create(endpoint=earlier, node=node, state=State.STOPPED,
                               created_at=now - timedelta(hours=1),
                               ready_at=now - timedelta(hours=1) + timedelta(seconds=seconds))
    starting = ready_endpoint(org, "chat", ports=[], state=State.LOADING)
    Replica.objects.create(endpoint=starting, node=node, state=State.LOADING, stage="loading",
                           progress_percent=40, created_at=now - timedelta(seconds=10))

    status = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/status/").context["status"]

    assert status["median_seconds"] == 40
    assert 29 <= status["eta_seconds"] <= 30
    assert status["progress"]["percent"] == 40  # 10 of 40 s is 25%, below the stage's 40%


def test_usage_data_is_per_minute_with_ttft_percentiles(owner_client: Client,
                                                        org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[])
    for ttft in (100, 200, 300, 400):
        usage(endpoint, minutes_ago=2, ttft=ttft, tokens=30)
    usage(endpoint, minutes_ago=2, status=500, ttft=None, tokens=0)
    usage(endpoint, minutes_ago=2, status=400, ttft=None, tokens=0)

    data = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/usage/").json()

    assert data["requests"] == 6
    assert len(data["minutes"]) == 60  # the idle minutes are there, as zeros
    busy = [i for i, rate in enumerate(data["requests_per_second"]) if rate]
    assert len(busy) == 1
    (minute,) = busy
    assert data["minutes"][minute] == data["minutes"][-1] - 120  # two minutes ago
    assert data["failed"][minute] == 1 and sum(data["failed"]) == 1
    assert data["refused"][minute] == 1 and sum(data["refused"]) == 1
    assert data["ttft_p50_ms"][minute] == 250.0
    assert data["ttft_p95_ms"][minute] == pytest.approx(385.0)
    assert data["tokens_per_second"][minute] == round(120 / 60, 3)
    assert data["requests_per_second"][minute] == round(6 / 60, 4)
    assert data["ttft_p50_ms"][0] is None and data["requests_per_second"][0] == 0


def test_snippets_name_the_endpoint_and_the_gateway(owner_client: Client, org: Organization,
                                                    settings: object) -> None:
    settings.KVRUN_GATEWAY_URL = "https://api.example.com"
    ready_endpoint(org, "chat", ports=[])

    snippets = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/").context["snippets"]

    assert 'base_url="https://api.example.com/v1"' in snippets["python"]
    assert 'model="chat"' in snippets["python"]
    assert "curl https://api.example.com/v1/chat/completions" in snippets["curl"]
    assert '"model": "chat"' in snippets["curl"]


def test_scale_stop_start_and_delete_change_what_the_endpoint_should_be(
        owner_client: Client, org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[])
    Endpoint.objects.filter(id=endpoint.id).update(max_replicas=3)
    base = f"/orgs/{org.slug}/endpoints/chat"

    owner_client.post(f"{base}/scale/", {"replicas": "3"})
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 3
    owner_client.post(f"{base}/stop/")
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.STOPPED
    owner_client.post(f"{base}/start/")
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.RUNNING
    deleted = owner_client.post(f"{base}/delete/")
    assert deleted["Location"] == f"/orgs/{org.slug}/"
    assert Endpoint.objects.get(id=endpoint.id).deleted_at is not None
    assert owner_client.get(f"{base}/").status_code == 404


def test_scaling_out_of_range_says_why_and_changes_nothing(owner_client: Client,
                                                           org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[])

    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/scale/", {"replicas": "5"},
                                 follow=True)

    assert b"Choose between 1 and 1, the most replicas" in response.content
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 1


def test_a_member_sees_but_cannot_stop_an_endpoint(member_client: Client,
                                                   org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[])

    page = member_client.get(f"/orgs/{org.slug}/endpoints/chat/")
    stopped = member_client.post(f"/orgs/{org.slug}/endpoints/chat/stop/", follow=True)

    assert page.status_code == 200
    assert b"Manage" not in page.content
    assert b"Only owners and admins can stop endpoints" in stopped.content
    assert Endpoint.objects.get(id=endpoint.id).desired_state == DesiredState.RUNNING


def test_the_endpoint_page_shows_its_memory_and_the_kv_cache_the_engine_reports(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    from endpoints.models import ModelSpec
    from endpoints.services import do_create_endpoint

    endpoint = do_create_endpoint(
        organization=org, actor_role="owner", created_by=None, name="chat",
        model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        policy=EndpointPolicy(context_length=2048, concurrency=8))
    Replica.objects.create(endpoint=endpoint, node=cpu_node, state=State.READY,
                           kv_cache_tokens=2_097_152)

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/")

    assert [part["name"] for part in page.context["memory"]] == [
        "weights", "KV cache", "runtime", "headroom"]
    assert sum(part["bytes"] for part in page.context["memory"]) == page.context["device_bytes"]
    assert b"2,097,152 tokens" in page.content


def test_the_status_counts_replicas_only_while_some_are_asked_for(owner_client: Client,
                                                                  org: Organization) -> None:
    ready_endpoint(org, "chat", ports=[9001])
    stopped = ready_endpoint(org, "resting", ports=[], state=State.STOPPED)
    Endpoint.objects.filter(id=stopped.id).update(desired_state=DesiredState.STOPPED,
                                                  desired_replicas=0)

    running = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/status/").content.decode()
    resting = owner_client.get(f"/orgs/{org.slug}/endpoints/resting/status/").content.decode()

    assert 'data-testid="state">stopped' in resting
    assert "1 of 1 replica(s) ready" in running
    assert "replica(s)" not in resting  # was "0 of 0 replica(s) ready"


def test_the_page_says_what_the_endpoint_takes_and_when_its_engines_lag_its_model(
        owner_client: Client, org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[8001, 8002])

    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/").content.decode()
    assert "<strong>Tools:</strong> yes, any <code>tool_choice</code>" in page
    assert 'data-testid="parsers-behind"' not in page

    # One engine was started before its model had a parser.
    Replica.objects.filter(id=endpoint.replicas.first().id).update(tool_call_parser="")
    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/").content.decode()
    assert ("1 of its replicas started before its model's parsers were set, and the gateway "
            "goes by what they run: restart the endpoint to apply them.") in page
