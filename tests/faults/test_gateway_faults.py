"""Faults under load at the gateway: the web process killed outright, Redis or PostgreSQL
restarted. Every request admitted must end up in the ledger, once.

The stand-in engine keeps the gateway's request id of every request it was sent, which is
the set of requests that were admitted and reached an engine."""

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
from django.conf import settings
from django.db import connection
from django.db.models import QuerySet
from django.test import override_settings

from accounts.models import Organization
from billing.ingestion import do_ingest_usage
from billing.models import UsageRecord
from billing.usage_stream import INTERRUPTED_CODE
from endpoints.models import Endpoint, Node, Replica, State
from engine.processes import free_port
from kvrun.common.redis import redis_client
from tests.factories import endpoint_at_zero
from tests.gateway.helpers import received
from tests.helpers import PATIENT, RestartableRedis, start_web, stop, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

CONCURRENCY = 8
# The killed web process and this test's ingestion agree on a short lease, so that the
# requests of the dead process are recorded within seconds rather than half a minute.
LEASE_SECONDS = 3
# A stream's trace may lag what its client received by this many tokens: fewer than the
# stand-in engine streams between two renewals of a trace (50 in 0.5 s).
LAG_TOKENS = 2
STUB_STEADY_TOKENS, STUB_TOKENS = 200, 4  # the stand-in engine's streams, steady and at once
KILLS = 5
HELD = 8
METRICS_TOKEN = "faults-metrics"
# Streams of STUB_LASTING_TOKENS, one every 0.1 s: they run on past a Redis outage of the
# lease and a second more, however slowly this machine starts it.
OUTLASTING_STREAMS, STUB_LASTING_TOKENS = 4, 150


class Load:
    """CONCURRENCY clients sending `prompt`, streamed and not, until stopped. Each keeps, by
    the gateway's request id, the completion tokens it received: a stream's events, read as
    they come, and an answer's usage."""

    def __init__(self, base: str, secret: str, prompt: str) -> None:
        self._base, self._secret, self._prompt = base, secret, prompt
        self._stopping = threading.Event()
        self.statuses: list[int] = []
        self.transport_errors = 0
        self.received: dict[str, int] = {}
        self.streams: set[str] = set()
        self._threads = [threading.Thread(target=self._client, args=(number % 2 == 0,))
                         for number in range(CONCURRENCY)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(30)

    def _client(self, stream: bool) -> None:
        body = orjson.dumps({"model": "chat", "prompt": self._prompt, "stream": stream})
        headers = {"Authorization": f"Bearer {self._secret}"}
        while not self._stopping.is_set():
            try:
                with httpx.stream("POST", f"{self._base}/v1/completions", content=body,
                                  headers=headers, timeout=30) as response:
                    request_id = response.headers.get("x-request-id", "")
                    self.received[request_id] = 0
                    if stream:
                        self.streams.add(request_id)
                        for line in response.iter_lines():
                            self.received[request_id] += is_token(line)
                    else:
                        usage = orjson.loads(response.read()).get("usage") or {}
                        self.received[request_id] = usage.get("completion_tokens", 0)
                self.statuses.append(response.status_code)
            except httpx.TransportError:
                self.transport_errors += 1


def is_token(line: str) -> bool:
    """Whether a line of a stream is a whole event with a token (a line the kill cut short
    is not)."""
    try:
        return bool(line.startswith("data: {") and orjson.loads(line[6:]).get("choices"))
    except orjson.JSONDecodeError:
        return False


def served(stub: httpx.Client) -> int:
    """How many requests the stand-in engine has been sent."""
    return len(received(stub))


def every_admitted_request_recorded(stub: httpx.Client, load: Load, figures: Callable[..., None],
                                    *, timeout: float, **measured: int) -> QuerySet[UsageRecord]:
    """Ingest until each request the stand-in engine received (each one admitted) has its
    record; keep the figures of the run; return the records."""
    admitted = {request["request_id"] for request in received(stub)}
    assert wait_until(lambda: do_ingest_usage() == 0 and admitted <= set(
        UsageRecord.objects.values_list("request_id", flat=True)), timeout, interval=0.5)
    records = UsageRecord.objects.filter(request_id__in=admitted)
    figures(sent=len(load.statuses) + load.transport_errors, admitted=len(admitted),
            stored=records.count(), without_record=len(admitted) - records.count(),
            interrupted=records.filter(error_code=INTERRUPTED_CODE).count(),
            server_errors=sum(status >= 500 for status in load.statuses), **measured)
    assert records.count() == len(admitted)
    return records


def test_a_web_process_killed_outright_leaves_a_record_of_every_admitted_request(
    stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client], figures: Callable[..., None]
) -> None:
    port = free_port()
    web = start_web(port, KVRUN_GATEWAY_LEASE_SECONDS=str(LEASE_SECONDS),
                    KVRUN_GATEWAY_TRACE_LAG_TOKENS=str(LAG_TOKENS), **PATIENT)
    try:
        with Load(f"http://127.0.0.1:{port}", secret, "steady") as load:
            # Some requests done, and streams mid-way at the engine.
            assert wait_until(lambda: served(stubs[0]) >= 3 * CONCURRENCY, 30, interval=0.05)
            # A copy: the clients' threads add to it meanwhile.
            assert wait_until(lambda: sum(STUB_STEADY_TOKENS // 4 < tokens < STUB_STEADY_TOKENS
                                          for tokens in list(load.received.values()))
                              >= CONCURRENCY // 2, 30, interval=0.01)
            web.send_signal(signal.SIGKILL)
            web.wait(10)
    finally:
        stop(web)

    counted: dict[str, int] = {}
    with override_settings(KVRUN_GATEWAY_LEASE_SECONDS=LEASE_SECONDS):
        records = every_admitted_request_recorded(stubs[0], load, counted.update,
                                                  timeout=LEASE_SECONDS + 10)

    interrupted = records.filter(error_code=INTERRUPTED_CODE)
    assert load.transport_errors >= CONCURRENCY - 1  # the requests the kill cut off
    assert interrupted.count() >= CONCURRENCY // 2  # the streams in flight at the kill
    assert all(record.prompt_tokens > 0 for record in interrupted)
    assert load.statuses and max(load.statuses) < 500  # some answered, none failed
    # Each client, answered or cut off, is billed what it received: of a stream all but at
    # most the lag, and at most the event its gateway died sending; all of an answer, whose
    # usage is traced before it is sent, even one the kill cut off after its headers.
    billed = dict(records.values_list("request_id", "completion_tokens"))
    pairs = [(load.received[request_id], billed[request_id]) for request_id in load.streams
             if request_id in billed]
    answers = {(load.received[request_id], billed[request_id]) for request_id in load.received
               if request_id in billed and request_id not in load.streams}
    figures(**counted, streams_cut=sum(received < STUB_STEADY_TOKENS for received, _ in pairs),
            most_received_unbilled=max(received - tokens for received, tokens in pairs),
            most_billed_unreceived=max(tokens - received for received, tokens in pairs))
    assert all(received - LAG_TOKENS <= tokens <= received + 1 for received, tokens in pairs), [
        pair for pair in pairs if pair[0] != pair[1]]
    assert answers <= {(STUB_TOKENS, STUB_TOKENS), (0, STUB_TOKENS)}, answers


def test_a_web_process_killed_the_instant_a_stream_ends_bills_all_of_it(
    stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client], figures: Callable[..., None]
) -> None:
    """The client has the stream's last token, and its web process dies at once, before the
    request's record would have left it: the trace already holds every token."""
    body = orjson.dumps({"model": "chat", "prompt": "hello", "stream": True})
    received = {}
    for _ in range(KILLS):
        port = free_port()
        web = start_web(port, KVRUN_GATEWAY_LEASE_SECONDS=str(LEASE_SECONDS), **PATIENT)
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", content=body,
                              headers={"Authorization": f"Bearer {secret}"},
                              timeout=30) as response:
                tokens = 0
                for line in response.iter_lines():
                    tokens += is_token(line)
                    if '"finish_reason":"length"' in line:
                        web.send_signal(signal.SIGKILL)
                        break
                received[response.headers["x-request-id"]] = tokens
            web.wait(10)
        finally:
            stop(web)

    with override_settings(KVRUN_GATEWAY_LEASE_SECONDS=LEASE_SECONDS):
        assert wait_until(lambda: do_ingest_usage() == 0 and UsageRecord.objects.filter(
            request_id__in=received).count() == KILLS, LEASE_SECONDS + 10, interval=0.5)
    billed = dict(UsageRecord.objects.filter(request_id__in=received).values_list(
        "request_id", "completion_tokens"))
    figures(kills=KILLS, streams_billed_in_full=sum(
        billed[request_id] == tokens for request_id, tokens in received.items()))
    assert set(received.values()) == {STUB_TOKENS}
    assert billed == received


def test_a_restart_of_redis_under_load_fails_no_request_and_loses_no_record(
    stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client], own_redis: RestartableRedis,
    figures: Callable[..., None]
) -> None:
    port = free_port()
    web = start_web(port, REDIS_URL=own_redis.url)
    try:
        with Load(f"http://127.0.0.1:{port}", secret, "hello") as load:
            assert wait_until(lambda: served(stubs[0]) >= 100, 30)
            own_redis.stop()
            down_at = served(stubs[0])
            # Served while Redis is away: limits let requests in, records go to PostgreSQL.
            assert wait_until(lambda: served(stubs[0]) >= down_at + 100, 30)
            own_redis.start()
            back_at = served(stubs[0])
            assert wait_until(lambda: served(stubs[0]) >= back_at + 100, 30)
        web.send_signal(signal.SIGTERM)
        web.wait(30)
    finally:
        stop(web)

    with override_settings(REDIS_URL=own_redis.url):
        redis_client.cache_clear()
        try:
            every_admitted_request_recorded(stubs[0], load, figures, timeout=30,
                                            served_while_redis_was_down=back_at - down_at)
        finally:
            redis_client.cache_clear()

    assert load.transport_errors == 0
    assert set(load.statuses) == {200}


def test_streams_that_outlast_a_redis_outage_past_the_lease_are_billed_what_they_sent(
    stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client], own_redis: RestartableRedis,
    figures: Callable[..., None]
) -> None:
    """Redis stays away longer than the lease while streams run. Ingestion reaches Redis
    first when it returns (the web process is held still, SIGSTOP, until it has), takes the
    streams' traces for a dead gateway's and stores them as interrupted; the gateway lives
    on, and each stream's own record then replaces its interrupted one."""
    port = free_port()
    web = start_web(port, REDIS_URL=own_redis.url,
                    KVRUN_GATEWAY_LEASE_SECONDS=str(LEASE_SECONDS))
    body = orjson.dumps({"model": "chat", "prompt": "lasting", "stream": True})
    ended: dict[str, tuple[int, int]] = {}  # request id: status, tokens received

    def stream() -> None:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", content=body,
                          headers={"Authorization": f"Bearer {secret}"},
                          timeout=60) as response:
            tokens = sum(is_token(line) for line in response.iter_lines())
            ended[response.headers["x-request-id"]] = (response.status_code, tokens)

    served_before = served(stubs[0])
    clients = [threading.Thread(target=stream) for _ in range(OUTLASTING_STREAMS)]
    try:
        for client in clients:
            client.start()
        assert wait_until(lambda: served(stubs[0]) == served_before + OUTLASTING_STREAMS, 30)
        own_redis.stop()
        time.sleep(LEASE_SECONDS + 1)  # no renewal can reach Redis for longer than the lease
        running_at_the_outage_end = OUTLASTING_STREAMS - len(ended)
        web.send_signal(signal.SIGSTOP)
        try:
            own_redis.start()
            with override_settings(REDIS_URL=own_redis.url,
                                   KVRUN_GATEWAY_LEASE_SECONDS=LEASE_SECONDS):
                redis_client.cache_clear()
                do_ingest_usage()
            taken_for_interrupted = UsageRecord.objects.filter(
                request_id__in=received_ids(stubs[0], served_before),
                error_code=INTERRUPTED_CODE).count()
        finally:
            web.send_signal(signal.SIGCONT)
        for client in clients:
            client.join(60)
        web.send_signal(signal.SIGTERM)
        web.wait(30)
    finally:
        stop(web)

    with override_settings(REDIS_URL=own_redis.url, KVRUN_GATEWAY_LEASE_SECONDS=LEASE_SECONDS):
        try:
            assert wait_until(lambda: do_ingest_usage() == 0 and not UsageRecord.objects.filter(
                request_id__in=ended, error_code=INTERRUPTED_CODE).exists(), 30, interval=0.5)
        finally:
            redis_client.cache_clear()
    billed = {row.request_id: (row.status_code, row.error_code, row.completion_tokens)
              for row in UsageRecord.objects.filter(request_id__in=ended)}
    figures(streams=OUTLASTING_STREAMS, taken_for_interrupted=taken_for_interrupted,
            billed_as_received=sum(billed[request_id] == (200, "", tokens)
                                   for request_id, (_, tokens) in ended.items()))
    assert running_at_the_outage_end == taken_for_interrupted == OUTLASTING_STREAMS
    assert set(ended.values()) == {(200, STUB_LASTING_TOKENS)}
    assert billed == {request_id: (200, "", STUB_LASTING_TOKENS) for request_id in ended}


def received_ids(stub: httpx.Client, after: int) -> list[str]:
    """The gateway's request ids of what the stand-in engine was sent after its `after`th."""
    return [request["request_id"] for request in received(stub)[after:]]


def test_a_restart_of_postgresql_under_load_fails_no_request_and_loses_no_record(
    stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client], figures: Callable[..., None]
) -> None:
    port = free_port()
    web = start_web(port)
    try:
        with Load(f"http://127.0.0.1:{port}", secret, "hello") as load:
            assert wait_until(lambda: served(stubs[0]) >= 100, 30)
            postgres = SuitePostgres()
            postgres.stop()
            stopped_at, stopped_for = served(stubs[0]), time.monotonic()
            # Longer than the gateway keeps keys and routes: it serves what it knew.
            assert wait_until(lambda: served(stubs[0]) >= stopped_at + 100 and time.monotonic()
                              - stopped_for > settings.KVRUN_API_KEY_CACHE_SECONDS + 1, 30)
            postgres.start()
            started_at = served(stubs[0])
            assert wait_until(lambda: served(stubs[0]) >= started_at + 100, 30)
        web.send_signal(signal.SIGTERM)
        web.wait(30)
    finally:
        stop(web)

    every_admitted_request_recorded(stubs[0], load, figures, timeout=30,
                                    served_while_postgres_was_down=started_at - stopped_at)
    assert load.transport_errors == 0
    assert set(load.statuses) == {200}


def test_a_request_to_an_endpoint_at_zero_while_postgresql_is_down_is_told_to_retry(
        org: Organization, secret: str, celery_worker: subprocess.Popen) -> None:
    endpoint = endpoint_at_zero(org, "sleepy", start_seconds=40)
    no_node_takes_replicas()
    port = free_port()
    web = start_web(port)
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {secret}"}
    request = {"model": "sleepy", "prompt": "hi"}
    try:
        assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200  # key, routes
        postgres = SuitePostgres()
        postgres.stop()
        try:
            refused = httpx.post(f"{base}/v1/completions", json=request, headers=auth,
                                 timeout=30)
        finally:
            postgres.start()
        # Once the database answers again, a request wakes it; the reconciler finds no node
        # for its replica, and the request is told so.
        waited = httpx.post(f"{base}/v1/completions", json=request, headers=auth, timeout=60)
    finally:
        stop(web)

    assert refused.status_code == 503 and refused.headers["retry-after"] == "40"  # its ETA
    assert refused.json()["error"]["code"] == "cold_start_unavailable"
    assert "could not start it just now (its database did not answer)" in (
        refused.json()["error"]["message"])
    assert waited.json()["error"]["code"] == "cold_start_unplaceable"
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 1


def test_requests_held_for_a_replica_no_node_can_take_end_at_once_saying_why(
        org: Organization, secret: str, celery_worker: subprocess.Popen,
        figures: Callable[..., None]) -> None:
    endpoint = endpoint_at_zero(org, "sleepy", start_seconds=40)
    no_node_takes_replicas()
    port = free_port()
    web = start_web(port, KVRUN_METRICS_TOKEN=METRICS_TOKEN)
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {secret}"}
    try:
        with ThreadPoolExecutor(HELD) as pool:
            answers = [pool.submit(httpx.post, f"{base}/v1/completions", timeout=60,
                                   json={"model": "sleepy", "prompt": "hi"}, headers=auth)
                       for _ in range(HELD)]
            assert wait_until(lambda: held_by(base) == HELD, 30)
            # The first woke it; the worker's reconciler finds no node that fits its replica.
            assert wait_until(lambda: Replica.objects.filter(
                endpoint=endpoint, state=State.PENDING, stage__startswith="no node"
            ).exists(), 30, interval=0.05)
            placing_failed = time.monotonic()
            responses = [answer.result(30) for answer in answers]
            answered_within = time.monotonic() - placing_failed
    finally:
        stop(web)

    figures(held=HELD, refused_with_the_reason=sum(
        response.json()["error"]["code"] == "cold_start_unplaceable" for response in responses),
        seconds_from_the_reconciler_to_the_last_answer=round(answered_within, 2))
    assert {response.status_code for response in responses} == {503}
    assert {response.json()["error"]["code"] for response in responses} == {
        "cold_start_unplaceable"}
    assert "cannot start now: no node online fits 1 × CPU only" in responses[0].json()[
        "error"]["message"]


def no_node_takes_replicas() -> None:
    """Every node drains: the reconciler places no replica (the ETA's history stays)."""
    Node.objects.update(draining=True)


def held_by(base: str) -> int:
    """What a web process's gauge says it holds for cold starts."""
    metrics = httpx.get(f"{base}/metrics",
                        headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    found = re.search(r"^kvrun_gateway_requests_held (\S+)$", metrics, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


class SuitePostgres:
    """The suite's PostgreSQL, stopped and started again as its supervisor would (a fast
    shutdown ends its sessions); this process then connects afresh."""

    def __init__(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('data_directory'), "
                           "current_setting('unix_socket_directories')")
            self._data_directory, self._socket_directory = cursor.fetchone()
        # pgserver runs the server as a user of its own when started by root.
        self._user = "pgserver" if os.geteuid() == 0 else None

    def stop(self) -> None:
        connection.close()
        self._pg_ctl(["stop", "-m", "fast", "-w"])

    def start(self) -> None:
        self._pg_ctl(["start", "-w", "-o", f"-h '' -k {self._socket_directory}",
                      "-l", f"{self._data_directory}/restarted.log"])

    def _pg_ctl(self, args: list[str]) -> None:
        import pgserver

        pgserver.pg_ctl(args, pgdata=self._data_directory, user=self._user)
