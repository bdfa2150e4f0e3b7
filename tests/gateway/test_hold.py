"""Requests to an endpoint scaled to zero (gateway.hold): the first wakes it, each waits for
its replica within the hold's bounds, streams are told how the start goes. The reconciler's
part is played here by the test; the whole path on a real engine is tests/e2e."""

import re
import threading
import time

import httpx
import pytest
from django.test import override_settings
from django.utils import timezone

from accounts.models import Organization
from billing.models import UsageRecord
from endpoints.models import DesiredState, Endpoint, EndpointEvent, Replica, State
from endpoints.services import scaling as scaling_services
from gateway import directory
from kvrun.common.redis import redis_client
from scaling.activity import in_flight_name
from tests.factories import endpoint_at_zero, inference_key, organization_with_owner, ready_endpoint
from tests.gateway.helpers import InProcessGateway, raw_client, stored
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _a_quick_watch(settings: object) -> None:
    """The watch looks four times a second here: the waits below count its looks."""
    settings.KVRUN_GATEWAY_HOLD_WATCH_SECONDS = 0.25  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _no_reconciler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wake asks for a replica and nothing more: the test plays the reconciler, and a
    control worker running for other tests of the session must not play it too."""
    monkeypatch.setattr(scaling_services, "reconcile_after_commit", lambda endpoint: None)


def waking(org: Organization, port: int) -> tuple[Endpoint, Replica]:
    """An endpoint a request has woken: its replica is loading on `port`."""
    endpoint = ready_endpoint(org, "sleepy", [port], state=State.LOADING, min_replicas=0,
                              desired_replicas=1)
    replica = endpoint.replicas.get()
    Replica.objects.filter(id=replica.id).update(ready_at=None, stage="loading weights",
                                                 progress_percent=40)
    return endpoint, replica


def test_an_endpoint_at_zero_is_listed_and_a_request_wakes_it_once(
    gateway: InProcessGateway, org: Organization, secret: str
) -> None:
    ready_endpoint(org, "chat", [], state=State.STOPPED)  # stopped: neither listed nor woken
    endpoint = endpoint_at_zero(org, "sleepy", start_seconds=40)

    assert [model["id"] for model in gateway.get(secret, "/v1/models").json()["data"]] == [
        "sleepy"]
    started = time.monotonic()
    with override_settings(KVRUN_GATEWAY_HOLD_SECONDS=1.0):
        answers = [gateway.submit(gateway.send(secret, {"model": "sleepy", "prompt": "hi"}))
                   for _ in range(3)]
        responses = [answer.result(30) for answer in answers]
    waited = time.monotonic() - started

    # Nothing became ready within the hold: a 503 that says when to come back, from the
    # model's past start (40 s) less the time this start has taken, at most what they waited.
    for response in responses:
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "cold_start_timeout"
        assert 40 - waited <= int(response.headers["retry-after"]) <= 40
        assert "ready in about" in response.json()["error"]["message"]
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 1
    assert EndpointEvent.objects.filter(
        endpoint=endpoint, message="woken by a request: starting one replica").count() == 1
    assert stored(3)
    assert sorted(UsageRecord.objects.values_list("status_code", flat=True)) == [503] * 3


def test_a_stream_held_at_zero_is_told_first_that_a_replica_is_asked_for(
    gateway: InProcessGateway, org: Organization, secret: str
) -> None:
    endpoint_at_zero(org, "sleepy", start_seconds=40)

    with override_settings(KVRUN_GATEWAY_HOLD_SECONDS=1.0):
        response = gateway.post(secret, {"model": "sleepy", "prompt": "hi", "stream": True})

    assert response.headers["x-kvrun-cold-start"] == "true"
    # Its stage is the one the gateway last read: asking for a replica, or the replica's
    # first stage where the wake was quicker than the gateway's read.
    first = re.match(r": kvrun: starting from zero: [a-z ]+ \(\d+%\), ready in about (\d+) s\n\n",
                     response.text)
    assert first and int(first[1]) <= 40, response.text
    assert '"code":"cold_start_timeout"' in response.text


def test_held_requests_are_served_once_the_replica_is_ready(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    endpoint, replica = waking(org, stub_ports[0])

    stream = gateway.submit(gateway.send(secret, {"model": "sleepy", "prompt": "hi",
                                                  "stream": True}))
    plain = gateway.submit(gateway.send(secret, {"model": "sleepy", "prompt": "hi"}))
    assert wait_until(lambda: redis_client().zcard(in_flight_name(endpoint.id)) == 2, 10,
                      interval=0.05)
    # Both are admitted, and about to be held if not yet: two seconds later, each has been
    # held for more than one whatever the machine's pace.
    time.sleep(2.0)
    assert not stream.done() and not plain.done()
    Replica.objects.filter(id=replica.id).update(state=State.READY, ready_at=timezone.now())
    streamed, answered = stream.result(30), plain.result(30)

    assert streamed.status_code == answered.status_code == 200
    assert streamed.headers["x-kvrun-cold-start"] == "true"
    lines = streamed.text.splitlines()
    assert ": kvrun: starting from zero: loading weights (40%), no start of this model on this " \
           "kind of node is known yet to tell how long" in lines
    assert any(line.startswith(": kvrun: ready after ") for line in lines)
    assert "data: [DONE]" in lines
    assert int(answered.headers["x-kvrun-cold-start-ms"]) >= 1000
    # The wait is not the gateway's overhead.
    assert float(answered.headers["x-kvrun-overhead-ms"]) < 1000
    assert stored(2)
    assert set(UsageRecord.objects.values_list("replica_id", flat=True)) == {replica.id}


def test_past_the_count_bound_a_request_gets_a_429_with_retry_after(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    _, replica = waking(org, stub_ports[0])
    body = {"model": "sleepy", "prompt": "hi"}

    with override_settings(KVRUN_GATEWAY_HOLD_MAX_REQUESTS=1):
        burst = {f"order-{n}": gateway.submit(gateway.send(secret, body,
                                                           **{"Idempotency-Key": f"order-{n}"}))
                 for n in range(5)}
        assert wait_until(lambda: sum(answer.done() for answer in burst.values()) == 4, 10,
                          interval=0.05)
    refused = {key: answer.result() for key, answer in burst.items() if answer.done()}
    Replica.objects.filter(id=replica.id).update(state=State.READY, ready_at=timezone.now())

    # Arriving together, only one is held: the bound is counted as each is let in.
    for response in refused.values():
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "cold_start_queue_full"
    [held] = [answer for key, answer in burst.items() if key not in refused]
    assert held.result(30).status_code == 200
    # A refused request ran nothing: its Idempotency-Key is free for the retry.
    retried = gateway.post(secret, body, **{"Idempotency-Key": next(iter(refused))})
    assert retried.status_code == 200 and "x-kvrun-idempotent-replay" not in retried.headers


def test_an_endpoint_stopped_while_a_request_waits_ends_the_wait_with_a_503(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int]
) -> None:
    endpoint, _ = waking(org, stub_ports[0])

    held = gateway.submit(gateway.send(secret, {"model": "sleepy", "prompt": "hi",
                                                "stream": True}))
    assert wait_until(lambda: redis_client().zcard(in_flight_name(endpoint.id)), 5,
                      interval=0.05)
    Endpoint.objects.filter(id=endpoint.id).update(desired_state=DesiredState.STOPPED)
    streamed = held.result(30)

    # The stream had its headers already: the error is its last event.
    assert streamed.status_code == 200
    assert '"code":"endpoint_not_ready"' in streamed.text
    assert "Endpoint 'sleepy' was stopped while this request waited for it." in streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")


def test_a_held_stream_that_the_engine_refuses_ends_with_the_engine_s_error(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    _, replica = waking(org, stub_ports[0])
    headers_sent = threading.Event()
    statuses = []

    async def on_frame(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
            headers_sent.set()

    held = gateway.submit(raw_client(gateway, secret, {"model": "sleepy", "prompt": "context",
                                                       "stream": True}, on_frame=on_frame))
    assert headers_sent.wait(10)
    Replica.objects.filter(id=replica.id).update(state=State.READY, ready_at=timezone.now())
    streamed = b"".join(held.result(30)).decode()

    # Its headers went out while it waited: the engine's 400 is the stream's last event.
    assert statuses == [200]
    assert '"code":"context_length_exceeded"' in streamed
    assert streamed.rstrip().endswith("data: [DONE]")
    assert stored(1)
    assert UsageRecord.objects.get().status_code == 400


@pytest.mark.parametrize("bound", ["organisation", "process"])
def test_past_an_organisation_s_or_the_process_s_bound_a_request_gets_a_429(
    gateway: InProcessGateway, org: Organization, other_org: Organization, secret: str,
    bound: str
) -> None:
    for organization in (org, other_org):
        endpoint_at_zero(organization, "sleepy", start_seconds=40)
        endpoint_at_zero(organization, "dozy", start_seconds=40)
    theirs = inference_key(other_org)[1]

    with override_settings(KVRUN_GATEWAY_HOLD_SECONDS=3.0,
                           KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_ORGANIZATION=1
                           if bound == "organisation" else 10,
                           KVRUN_GATEWAY_HOLD_MAX_REQUESTS_PER_PROCESS=1 if bound == "process"
                           else 10):
        held = gateway.submit(gateway.send(secret, {"model": "sleepy", "prompt": "hi"}))
        assert wait_until(lambda: gateway.app.cold_starts.held == 1, 10, interval=0.05)
        ours = gateway.post(secret, {"model": "dozy", "prompt": "hi"})
        other = gateway.post(theirs, {"model": "sleepy", "prompt": "hi"})
        first = held.result(30)

    assert ours.status_code == 429 and ours.json()["error"]["code"] == "cold_start_queue_full"
    if bound == "organisation":
        assert "1 of this organisation's requests already wait for its endpoints" in \
            ours.json()["error"]["message"]
        # Another organisation's request is held as ever, until the hold's end.
        assert other.json()["error"]["code"] == "cold_start_timeout"
    else:
        assert "1 requests already wait for endpoints to start here" in \
            ours.json()["error"]["message"]
        assert other.status_code == 429
    assert first.json()["error"]["code"] == "cold_start_timeout"


def test_a_replica_no_node_can_take_fails_the_held_requests_at_once_saying_why(
    gateway: InProcessGateway, org: Organization, secret: str
) -> None:
    endpoint = endpoint_at_zero(org, "sleepy", start_seconds=40)
    held = gateway.submit(gateway.send(secret, {"model": "sleepy", "prompt": "hi"}))
    assert wait_until(lambda: gateway.app.cold_starts.held == 1, 10, interval=0.05)

    # Nodes that fit it are busy: it waits for one to free its GPUs.
    replica = Replica.objects.create(endpoint=endpoint, state=State.PENDING,
                                     stage="waiting for a node with 1 free NVIDIA H100 80 GB")
    time.sleep(1)  # four looks of the watch
    assert not held.done()
    # None fits: nothing is worth the wait.
    Replica.objects.filter(id=replica.id).update(
        stage="no node online fits 1 × NVIDIA H100 80 GB")
    response = held.result(10)  # the hold itself lasts 300 s

    assert response.status_code == 503
    assert response.headers["retry-after"] == "60"
    assert response.json()["error"] == {
        "type": "server_error", "code": "cold_start_unplaceable", "param": None,
        "message": "Endpoint 'sleepy' cannot start now: no node online fits 1 × NVIDIA H100 "
                   "80 GB. Retry later, or choose other hardware for it."}


def test_held_requests_of_many_organisations_read_their_routes_only_when_they_change(
    gateway: InProcessGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[tuple[object, bool]] = []  # organisation, by the watch
    read = directory.read_endpoints

    def counted(organization_id: object, **how: bool) -> object:
        reads.append((organization_id, how.get("fresh_connection") is False))
        return read(organization_id, **how)
    monkeypatch.setattr(directory, "read_endpoints", counted)
    secrets, organizations = [], []
    for number in range(4):
        organization = organization_with_owner(f"Tenant {number}")
        endpoint_at_zero(organization, "sleepy", start_seconds=40)
        secrets.append(inference_key(organization)[1])
        organizations.append(organization.id)

    with override_settings(KVRUN_GATEWAY_HOLD_SECONDS=8.0):
        held = [gateway.submit(gateway.send(secret, {"model": "sleepy", "prompt": "hi"}))
                for secret in secrets for _ in range(2)]
        assert wait_until(lambda: gateway.app.cold_starts.held == 8, 10, interval=0.05)
        time.sleep(1)  # each endpoint has been woken, and read again once since
        settled = len(reads)
        time.sleep(2)  # eight polls of the one watch
        quiet = len(reads) == settled
        answers = [answer.result(30) for answer in held]

    assert quiet, reads[settled:]
    assert {organization for organization, by_the_watch in reads if by_the_watch} == set(
        organizations)
    assert {answer.json()["error"]["code"] for answer in answers} == {"cold_start_timeout"}
