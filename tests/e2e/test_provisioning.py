"""Provisioning end to end: REST API → control worker → node agent → a real vLLM engine."""

import itertools
import os
import signal
import uuid
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from django.db.models import Sum
from rest_framework.test import APIClient

from accounts.models import Organization
from billing.models import GPUHour
from billing.rollup import do_roll_up_usage
from endpoints.models import Endpoint, ModelSpec, Node, Replica, State
from endpoints.planning import shape_of
from engine.processes import port_is_free
from engine.sizing import kv_cache_tokens
from fleet.certificates import engine_address
from nodes.config import AgentConfig
from telemetry.models import EngineSample
from tests.factories import inference_key
from tests.helpers import (
    ANSWER_WITHIN,
    api_servers,
    drive,
    engine_client,
    process_alive,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

READY_WITHIN = 120  # the promise for create → ready
RESTART_WITHIN = 180


def create(api: APIClient, org: Organization, name: str, model: str = "kvrun-demo-tiny") -> dict:
    """Create the endpoint on the CPU by name: it is sized when created, and one created while
    the node's heartbeat is late (a busy machine) would be sized for the GPU catalog."""
    response = api.post(f"/api/v1/organizations/{org.slug}/endpoints/",
                        {"name": name, "model": model, "context_length": 2048,
                         "concurrency": 4, "gpu_type": "cpu"}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def state_of(name: str) -> str:
    return Endpoint.objects.get(name=name, deleted_at=None).state


def ready_replica(name: str) -> Replica:
    return Replica.objects.get(endpoint__name=name, state=State.READY)


def delete_and_settle(api: APIClient, org: Organization, name: str) -> None:
    """Delete the endpoint and wait until its engines are gone and every replica is stopped,
    so that nothing of this test is still writing when the next one starts."""
    assert api.delete(f"/api/v1/organizations/{org.slug}/endpoints/{name}/").status_code == 204
    assert drive(lambda: not api_servers(name) and not Replica.objects.filter(
        endpoint__name=name).exclude(state=State.STOPPED).exists(), 60)


def complete(replica: Replica, name: str) -> httpx.Response:
    with engine_client(replica) as engine:
        return engine.post("/v1/completions",
                           json={"model": name, "prompt": "Hello, world!", "max_tokens": 5})


def test_create_ready_complete_stop(ready_node: Node, owner_api: APIClient, web: str,
                                    org: Organization, engine_logs: Path) -> None:
    create(owner_api, org, "chat")

    # While it loads, the engine's own log lines reach the API through the agent's heartbeat.
    assert drive(lambda: "vllm" in (Replica.objects.filter(endpoint__name="chat")
                                   .values_list("log_tail", flat=True).first() or "").lower(),
                 READY_WITHIN)
    assert drive(lambda: state_of("chat") == State.READY, READY_WITHIN), (
        Endpoint.objects.get(name="chat").events.values_list("message", flat=True))
    replica = ready_replica("chat")
    answer = complete(replica, "chat")
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 5
    # It serves TLS only, with a certificate for this replica that the control plane's
    # authority signed: plain HTTP, a client trusting only the system's authorities, and one
    # asking for another replica's name are each refused.
    assert replica.tls
    with pytest.raises(httpx.TransportError):  # no answer: a TLS server, spoken to in clear
        httpx.get(f"http://127.0.0.1:{replica.port}/health")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{replica.port}/health")
    address = engine_address(replica=replica)
    elsewhere = replace(address, host_name=address.host_name.replace(str(replica.id),
                                                                     str(uuid.uuid4())))
    with pytest.raises(httpx.ConnectError, match="Hostname mismatch"), elsewhere.client(
            timeout=30) as impostor:
        impostor.get("/health")
    # Every path but /health demands the engine's key, not only /v1 (vLLM's own check).
    with engine_client(replica, keyed=False) as engine:
        assert engine.get("/health").status_code == 200
        for method, path in [("POST", "/v1/completions"), ("POST", "/invocations"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
                             ("GET", "/ping"), ("GET", "/version"), ("GET", "/v1/models")]:
            refused = engine.request(method, path, json={"model": "chat", "prompt": "x"})
            assert refused.status_code == 401, (path, refused.status_code)
    with engine_client(replica) as engine:
        assert engine.get("/metrics").status_code == 200
        assert engine.post("/tokenize", json={"model": "chat", "prompt": "x"}).status_code == 200
    # The gateway reaches it that way: over TLS, by the replica's name.
    through = httpx.post(f"{web}/v1/completions", timeout=ANSWER_WITHIN,
                         headers={"Authorization": f"Bearer {inference_key(org)[1]}"},
                         json={"model": "chat", "prompt": "Hello", "max_tokens": 3})
    assert through.status_code == 200, through.text
    assert through.json()["usage"]["completion_tokens"] == 3
    # Its agent scrapes its /metrics the same way, into samples.
    assert wait_until(lambda: EngineSample.objects.filter(replica=replica).exists(),
                      ANSWER_WITHIN)
    # The engine holds none of the control plane's secrets.
    environ = Path(f"/proc/{replica.pid}/environ").read_bytes().split(b"\0")
    names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
    assert "VLLM_API_KEY" in names
    assert not names & {"SECRET_KEY", "KVRUN_KEY_PEPPER", "DATABASE_URL", "REDIS_URL"}
    # The engine's KV pool is the policy's budget, 4 requests × 2,048 tokens, and the
    # planner predicted the capacity the engine itself logged.
    demo = shape_of(ModelSpec.objects.get(slug="kvrun-demo-tiny"))
    budget = Endpoint.objects.get(name="chat").sizing["cpu_kv_cache_bytes"]
    assert kv_cache_tokens(demo, kv_bytes=budget) == 4 * 2048
    predicted = Endpoint.objects.get(name="chat").sizing["kv_cache_tokens"]
    assert replica.kv_cache_tokens == predicted  # as vLLM logged it
    detail = owner_api.get(f"/api/v1/organizations/{org.slug}/endpoints/chat/").json()
    assert detail["progress"] == {"stage": "ready", "percent": 100}
    assert detail["replicas"][0]["kv_cache_tokens"] == replica.kv_cache_tokens
    assert "/v1/models" in detail["replicas"][0]["log_tail"]
    # The agent's probes and scrapes are not in the engine's log; requests are.
    log = (engine_logs / f"{replica.id}.log").read_text()
    assert '"POST /tokenize HTTP/1.1" 200' in log
    assert "GET /metrics" not in log and "GET /health" not in log
    pid, port = replica.pid, replica.port

    assert owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/chat/stop/"
                          ).status_code == 200
    assert drive(lambda: state_of("chat") == State.STOPPED, 60)
    assert not process_alive(pid)
    assert not api_servers("chat")
    assert port_is_free(port)
    states = list(Endpoint.objects.get(name="chat").events.values_list("state", flat=True))
    for state in ["pending", "scheduling", "starting", "loading", "ready", "stopping", "stopped"]:
        assert state in states

    # Its devices were billed from their reservation to the engine's end, phase by phase.
    intervals = list(replica.intervals.values_list("phase", "started_at", "ended_at"))
    assert [phase for phase, *_ in intervals] == ["starting", "loading", "ready", "stopping"]
    assert all(ended == next_started for (_, _, ended), (_, next_started, _)
               in itertools.pairwise(intervals))
    moments = dict(replica.events.values_list("state", "at"))
    assert (intervals[0][1], intervals[-1][2]) == (moments["scheduling"], moments["stopped"])
    do_roll_up_usage()
    held = moments["stopped"] - moments["scheduling"]
    billed = GPUHour.objects.filter(endpoint__name="chat").aggregate(total=Sum("gpu_seconds"))
    assert billed["total"] == Decimal(held // timedelta(microseconds=1)) / 10**6


def test_a_killed_engine_is_restarted(
    ready_node: Node, owner_api: APIClient, org: Organization
) -> None:
    create(owner_api, org, "sturdy")
    assert drive(lambda: state_of("sturdy") == State.READY, RESTART_WITHIN)
    first = ready_replica("sturdy")

    [engine] = api_servers("sturdy")
    assert os.getpgid(engine) == first.pid  # the replica's sandbox, leading its group

    os.kill(engine, signal.SIGKILL)
    assert drive(lambda: Replica.objects.get(id=first.id).state != State.READY, 30)
    assert drive(lambda: Replica.objects.filter(endpoint__name="sturdy", state=State.READY)
                 .exclude(pid=first.pid).exists(), RESTART_WITHIN)
    again = ready_replica("sturdy")
    assert complete(again, "sturdy").status_code == 200
    assert len(api_servers("sturdy")) == 1
    delete_and_settle(owner_api, org, "sturdy")


def test_an_engine_that_cannot_start_fails_the_endpoint_with_a_reason(
    ready_node: Node, owner_api: APIClient, org: Organization, settings: object
) -> None:
    demo = ModelSpec.objects.get(slug="kvrun-demo-tiny")
    demo.pk, demo.slug, demo.name = None, "broken-model", "Broken model"
    demo.save()
    broken = AgentConfig.from_environ().model_dir / "broken-model"
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    create(owner_api, org, "broken", model="broken-model")

    assert drive(lambda: state_of("broken") == State.FAILED, 240)
    endpoint = Endpoint.objects.get(name="broken")
    assert "failed 2 times in a row" in endpoint.failure_reason
    assert "Last engine log lines" in endpoint.failure_reason
    assert "no-such-architecture" in endpoint.failure_reason
    assert not api_servers("broken")
    detail = owner_api.get(f"/api/v1/organizations/{org.slug}/endpoints/broken/").json()
    assert detail["state"] == "failed" and detail["failure_reason"] == endpoint.failure_reason
