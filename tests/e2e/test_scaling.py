"""Autoscaling end to end, on real vLLM engines, the autoscaler running on the worker: an idle
endpoint scales to zero and a burst of requests at zero, streamed and not, is held by the
gateway (a web process) while one replica starts, and served; a sustained load scales an
endpoint up to its max, and after it, down, with no request failed."""

import functools
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from django.test import override_settings
from django.utils import timezone

from accounts.models import Organization, Role
from endpoints.models import Endpoint, EndpointEvent, GPUType, ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.services import do_create_endpoint, do_delete_endpoint
from endpoints.tasks import reconcile
from scaling.tasks import autoscale
from tests.factories import inference_key
from tests.helpers import ENGINE_READY_WITHIN, api_servers, at_once, drive, records_for, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

IDLE_SECONDS = 3


def autoscaled(predicate: Callable[[], bool], timeout: float) -> bool:
    """Wait for `predicate`, running the autoscaler and the reconciler on the worker as beat
    would. Not the liveness check: the engines' load starves this 2-core machine, and a
    heartbeat late past the tests' 3 s would count the node lost."""
    def step() -> bool:
        autoscale.delay()
        reconcile.delay()
        return predicate()
    return wait_until(step, timeout, interval=1.0)


def at_zero(endpoint: Endpoint) -> bool:
    autoscale.delay()
    return (Endpoint.objects.get(id=endpoint.id).state == State.IDLE
            and not api_servers("sleepy"))


def test_an_idle_endpoint_scales_to_zero_and_a_burst_at_zero_is_served_by_one_start(
    ready_node: Node, web: str, org: Organization
) -> None:
    with override_settings(KVRUN_SCALE_TO_ZERO_MIN_SECONDS=1):
        endpoint = do_create_endpoint(
            organization=org, actor_role=Role.OWNER, created_by=None, name="sleepy",
            model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
            gpu_type=GPUType.objects.get(slug="cpu"),  # sized for the CPU node, late or not
            policy=EndpointPolicy(context_length=2048, concurrency=4),
            scaling=EndpointScaling(min_replicas=0, scale_to_zero_after_seconds=IDLE_SECONDS))
    secret = inference_key(org)[1]
    assert drive(lambda: Endpoint.objects.get(id=endpoint.id).state == State.READY,
                 ENGINE_READY_WITHIN)

    assert drive(lambda: at_zero(endpoint), 120)
    zeroed_at = timezone.now()
    assert EndpointEvent.objects.filter(endpoint=endpoint,
                                        message__startswith="scaling to zero: no request for "
                                        ).count() == 1
    listed = httpx.get(f"{web}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert [model["id"] for model in listed.json()["data"]] == ["sleepy"]

    def send(n: int) -> httpx.Response:
        return httpx.post(
            f"{web}/v1/completions", timeout=300, headers={"Authorization": f"Bearer {secret}"},
            json={"model": "sleepy", "prompt": f"Wake up, {n}.", "max_tokens": 4,
                  "stream": n % 2 == 0})

    responses = at_once(*(functools.partial(send, n) for n in range(4)))

    assert [responses[n].status_code for n in range(4)] == [200] * 4, [
        responses[n].text[:300] for n in range(4)]
    for n in (0, 2):  # streamed: told how the start went, then the answer
        lines = responses[n].text.splitlines()
        assert any(line.startswith(": kvrun: starting from zero: ") for line in lines)
        assert any(line.startswith(": kvrun: ready after ") for line in lines)
        assert "data: [DONE]" in lines
    for n in (1, 3):
        assert int(responses[n].headers["x-kvrun-cold-start-ms"]) > 1000
    started = Replica.objects.filter(endpoint=endpoint, created_at__gt=zeroed_at)
    assert started.count() == 1 and started.get().state == State.READY
    assert EndpointEvent.objects.filter(
        endpoint=endpoint, message="woken by a request: starting one replica").count() == 1
    ids = [responses[n].headers["x-request-id"] for n in range(4)]
    records = records_for(ids)
    assert sorted(record.request_id for record in records) == sorted(ids)
    assert {record.replica_id for record in records} == {started.get().id}

    do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
    assert drive(lambda: not api_servers("sleepy") and not Replica.objects.filter(
        endpoint=endpoint).exclude(state=State.STOPPED).exists(), 90)


def test_a_sustained_load_scales_up_to_max_and_after_it_down_with_no_request_failed(
    ready_node: Node, web: str, org: Organization
) -> None:
    endpoint = do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name="elastic",
        model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        gpu_type=GPUType.objects.get(slug="cpu"),  # sized for the CPU node, late or not
        policy=EndpointPolicy(context_length=2048, concurrency=4),
        scaling=EndpointScaling(
            min_replicas=1, max_replicas=2, scaling_target=0.25, scale_up_window_seconds=15,
            scale_down_window_seconds=15))
    secret = inference_key(org)[1]
    assert drive(lambda: Endpoint.objects.get(id=endpoint.id).state == State.READY,
                 ENGINE_READY_WITHIN)

    def ask(max_tokens: int) -> httpx.Response:
        return httpx.post(f"{web}/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {secret}"},
                          json={"model": "elastic", "prompt": "Keep going.",
                                "max_tokens": max_tokens, "ignore_eos": True})

    # Two clients, each sending long answers one after the other: on this 2-core machine,
    # whose engine and web process they starve, about one request is in flight on average,
    # against a target of 0.25. The load stops once the autoscaler has decided: a second
    # engine would not start beside it within the start timeout.
    loaded = threading.Event()
    loaded.set()
    heavy: list[int] = []

    def keep_busy() -> None:
        while loaded.is_set():
            heavy.append(ask(512).status_code)

    clients = [threading.Thread(target=keep_busy) for _ in range(2)]
    for client in clients:
        client.start()

    try:
        assert autoscaled(
            lambda: Endpoint.objects.get(id=endpoint.id).desired_replicas == 2, 120)
    finally:
        loaded.clear()
        for client in clients:
            client.join()
    assert set(heavy) == {200}

    # A light load after it, a short request a second, none of which may fail while the
    # second replica starts and, the load being gone, is scaled down again (the autoscaler
    # may decide that as soon as both are ready: its window has passed while it started).
    lightly = threading.Event()
    lightly.set()
    light: list[int] = []

    def keep_light() -> None:
        while lightly.is_set():
            light.append(ask(4).status_code)
            time.sleep(1)

    client = threading.Thread(target=keep_light)
    client.start()
    try:
        # Both served: the second became ready (it may be the one stopped since).
        assert autoscaled(lambda: Replica.objects.filter(
            endpoint=endpoint, ready_at__isnull=False).count() == 2, ENGINE_READY_WITHIN)
        assert autoscaled(lambda: Replica.objects.filter(
            endpoint=endpoint, state=State.STOPPED).exists() and Replica.objects.filter(
            endpoint=endpoint).exclude(state=State.STOPPED).count() == 1, 240)
    finally:
        lightly.clear()
        client.join()
    assert set(light) == {200} and len(light) >= 3
    [up] = EndpointEvent.objects.filter(endpoint=endpoint,
                                        message__startswith="scaling up from 1 to 2")
    assert "stayed above its target of 0.25 through the last 15 s" in up.message
    [down] = EndpointEvent.objects.filter(endpoint=endpoint,
                                          message__startswith="scaling down from 2 to 1")
    stopped = Replica.objects.get(endpoint=endpoint, state=State.STOPPED)
    assert f"replica {str(stopped.id)[:8]} stops, the one with the fewest requests" in (
        down.message)
    assert Endpoint.objects.get(id=endpoint.id).desired_replicas == 1

    do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
    assert drive(lambda: not api_servers("elastic") and not Replica.objects.filter(
        endpoint=endpoint).exclude(state=State.STOPPED).exists(), 90)
