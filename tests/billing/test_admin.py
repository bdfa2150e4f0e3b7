import itertools
from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib import admin
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts.models import APIKey, Organization
from accounts.services import do_create_invite
from billing.ingestion import do_record_usage
from billing.models import GPUHour, RollupState, TokenHour, UsageRecord
from billing.rollup import do_roll_up_usage
from endpoints.lifecycle import do_transition_replica
from endpoints.models import Endpoint, Replica, State
from tests.factories import UserFactory, api_key, inference_key, ready_endpoint, usage_report

pytestmark = pytest.mark.django_db

LIST = "/admin/billing/usagerecord/"
_request_ids = itertools.count()


@pytest.fixture
def operator(client: Client) -> Client:
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


@pytest.fixture
def ready_chat(org: Organization) -> Endpoint:
    return ready_endpoint(org, "chat", ports=[9001])


def record(endpoint: Endpoint, key: APIKey | None = None, **fields: object) -> UsageRecord:
    values = dict(
        request_id=f"req_{next(_request_ids):012d}", organization=endpoint.organization,
        endpoint=endpoint, api_key=key, operation="chat.completions", prompt_tokens=12,
        completion_tokens=30, status_code=200, started_at=timezone.now(),
        time_to_first_token_ms=25, duration_ms=180, gateway_overhead_ms=Decimal("0.412"))
    return UsageRecord.objects.create(**values | fields)


def test_it_sends_anonymous_visitors_to_the_admin_login(client: Client) -> None:
    response = client.get(LIST)

    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_it_gives_signed_in_users_who_are_not_staff_no_access(client: Client,
                                                              ready_chat: Endpoint) -> None:
    usage = record(ready_chat)
    client.force_login(UserFactory())

    for url in [LIST, f"{LIST}{usage.id}/change/"]:
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")


def test_it_lists_usage_with_masked_keys_and_never_a_secret_or_digest(
        operator: Client, ready_chat: Endpoint) -> None:
    key, secret = api_key(ready_chat.organization)
    usage = record(ready_chat, key, request_id="req_visible")

    pages = [operator.get(LIST), operator.get(f"{LIST}{usage.id}/change/")]

    for page in pages:
        assert page.status_code == 200
        assert b"req_visible" in page.content and key.masked.encode() in page.content
        assert secret.encode() not in page.content
        assert key.digest.encode() not in page.content
    assert b"12 + 30" in pages[0].content


def test_the_ledger_cannot_be_added_changed_or_deleted(operator: Client,
                                                       ready_chat: Endpoint) -> None:
    usage = record(ready_chat)
    model_admin = admin.site._registry[UsageRecord]
    request = operator.get(LIST).wsgi_request

    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request, usage)
    assert not model_admin.has_delete_permission(request, usage)
    assert operator.get(f"{LIST}add/").status_code == 403
    assert operator.post(f"{LIST}{usage.id}/change/", {"status_code": 500}).status_code == 403
    assert operator.post(f"{LIST}{usage.id}/delete/", {"post": "yes"}).status_code == 403
    operator.post(LIST, {"action": "delete_selected", "post": "yes",
                         "_selected_action": [str(usage.id)]})
    assert UsageRecord.objects.get(id=usage.id).status_code == 200


def test_it_finds_usage_by_request_organisation_or_endpoint_exactly(
        operator: Client, ready_chat: Endpoint, other_org: Organization) -> None:
    record(ready_chat, request_id="req_acme")
    record(ready_endpoint(other_org, "globex-chat", ports=[9002]), request_id="req_globex")

    def found(term: str) -> set[str]:
        response = operator.get(LIST, {"q": term})
        assert response.status_code == 200
        return {rid for rid in ("req_acme", "req_globex") if rid.encode() in response.content}

    assert found("req_globex") == {"req_globex"}
    assert found("acme") == {"req_acme"}
    assert found("globex-chat") == {"req_globex"}
    assert found("req_") == set()  # exact matches only: a substring would scan the ledger


@pytest.mark.parametrize(("params", "expected"), [
    ({"status": "5xx"}, {"req_failed"}),
    ({"status": "499"}, {"req_gone"}),
    ({"status": "2xx", "operation": "completions"}, {"req_plain"}),
    ({"stream__exact": "1"}, {"req_gone"}),
    ({"client_disconnected__exact": "1"}, {"req_gone"}),
    ({"started_at__gte": str(timezone.now() - timedelta(days=1))},
     {"req_failed", "req_gone", "req_plain"}),
])
def test_it_filters_usage(operator: Client, ready_chat: Endpoint, params: dict,
                          expected: set[str]) -> None:
    record(ready_chat, request_id="req_failed", status_code=502, error_code="engine_error")
    record(ready_chat, request_id="req_gone", status_code=499, stream=True,
           client_disconnected=True)
    record(ready_chat, request_id="req_plain", operation="completions")
    record(ready_chat, request_id="req_last_year", started_at=timezone.now() - timedelta(days=400))

    response = operator.get(LIST, params)

    assert response.status_code == 200
    listed = {rid for rid in ("req_failed", "req_gone", "req_plain", "req_last_year")
              if rid.encode() in response.content}
    assert listed == expected


def test_the_list_runs_no_query_per_row_and_never_counts_the_whole_ledger(
        operator: Client, ready_chat: Endpoint) -> None:
    key, _ = api_key(ready_chat.organization)

    def queries_for_the_list() -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            assert operator.get(LIST, {"_facets": "1"}).status_code == 200
        return [query["sql"] for query in captured.captured_queries]

    for _ in range(3):
        record(ready_chat, key)
    few = queries_for_the_list()
    for _ in range(5):
        record(ready_chat, key)
    many = queries_for_the_list()

    assert len(many) == len(few)
    counts = [sql for sql in many if "COUNT(" in sql and "billing_usagerecord" in sql]
    assert counts and all("LIMIT" in sql for sql in counts)


def test_no_console_page_shows_a_key_or_invite_digest(operator: Client,
                                                      ready_chat: Endpoint) -> None:
    org = ready_chat.organization
    key, secret = api_key(org)
    invite, token = do_create_invite(organization=org, actor_role="owner", created_by=None)
    usage = record(ready_chat, key)
    secrets = [secret, token, key.digest, invite.token_digest]
    rows = {APIKey: key, UsageRecord: usage, type(invite): invite, Endpoint: ready_chat,
            type(org): org}

    for model in admin.site._registry:
        opts = model._meta
        urls = [f"/admin/{opts.app_label}/{opts.model_name}/"]
        if model in rows:
            urls.append(f"{urls[0]}{rows[model].pk}/change/")
        for url in urls:
            response = operator.get(url)
            assert response.status_code == 200, url
            assert not [s for s in secrets if s.encode() in response.content], url


@pytest.mark.parametrize("model", [TokenHour, GPUHour])
def test_hourly_lines_are_listed_and_cannot_be_changed(operator: Client, ready_chat: Endpoint,
                                                       model: type) -> None:
    key, _ = inference_key(ready_chat.organization)
    do_record_usage(payloads=[usage_report(ready_chat, key, started_at=timezone.now()).encode()])
    Replica.objects.filter(endpoint=ready_chat).update(state=State.PENDING)
    do_transition_replica(replica_id=ready_chat.replicas.get().id, from_states=[State.PENDING],
                          to_state=State.SCHEDULING, message="placed")
    do_roll_up_usage(now=timezone.now() + timedelta(minutes=1))
    line = model.objects.latest("hour")  # two hours' lines when this ran across an hour's end
    url = f"/admin/billing/{model._meta.model_name}/"

    listed = operator.get(url, {"q": "chat"})

    assert listed.status_code == 200 and b"chat" in listed.content
    assert operator.get(f"{url}add/").status_code == 403
    assert operator.post(f"{url}{line.id}/delete/", {"post": "yes"}).status_code == 403
    assert model.objects.filter(id=line.id).exists()


def test_the_console_shows_how_far_the_rollup_lags_and_why_it_last_gave_up(
        operator: Client, ready_chat: Endpoint) -> None:
    key, _ = inference_key(ready_chat.organization)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=5)
    do_record_usage(payloads=[usage_report(ready_chat, key, started_at=hour + timedelta(hours=n)
                                           ).encode() for n in range(3)])
    RollupState.objects.create(id=1, batch_hours=2_500, timed_out_at=timezone.now(),
                               timeout_reason="A batch of up to 5,000 stale hours ran past "
                                              "the statement timeout")

    page = operator.get("/admin/billing/rollupstate/")

    assert page.status_code == 200
    text = page.content.decode()
    assert "2,500 stale hours" in text  # the batch size
    assert f"{hour:%Y-%m-%d %H:00} UTC" in text  # the oldest stale hour
    assert ">3<" in text  # stale hours
    assert "ran past the statement timeout" in text
    assert operator.get("/admin/billing/rollupstate/1/delete/").status_code == 403
    assert RollupState.objects.get().batch_hours == 2_500


def test_the_console_shows_the_rollup_before_its_first_run(operator: Client) -> None:
    page = operator.get("/admin/billing/rollupstate/")

    assert page.status_code == 200 and "10,000 stale hours" in page.content.decode()
    assert RollupState.objects.get().batch_hours == 10_000
