"""Scale to zero end to end, on a real vLLM engine: the autoscaler (on the worker) stops an
idle endpoint's replica, and a burst of requests at zero, streamed and not, is held by the
gateway (a web process) while one replica starts, and served."""

import threading

import httpx
import pytest
from django.test import override_settings
from django.utils import timezone

from accounts.models import Organization, Role
from endpoints.models import Endpoint, EndpointEvent, ModelSpec, Node, Replica, State
from endpoints.services import do_create_endpoint, do_delete_endpoint
from scaling.tasks import autoscale
from tests.factories import inference_key
from tests.helpers import api_servers, drive, records_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

IDLE_SECONDS = 3


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
            model=ModelSpec.objects.get(slug="kvrun-demo-tiny"), context_length=2048,
            concurrency=4, min_replicas=0, scale_to_zero_after_seconds=IDLE_SECONDS)
    secret = inference_key(org)[1]
    assert drive(lambda: Endpoint.objects.get(id=endpoint.id).state == State.READY, 240)

    assert drive(lambda: at_zero(endpoint), 120)
    zeroed_at = timezone.now()
    assert EndpointEvent.objects.filter(endpoint=endpoint,
                                        message__startswith="scaling to zero: no request for "
                                        ).count() == 1
    listed = httpx.get(f"{web}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert [model["id"] for model in listed.json()["data"]] == ["sleepy"]

    together = threading.Barrier(4)
    responses: dict[int, httpx.Response] = {}

    def send(n: int) -> None:
        together.wait()
        responses[n] = httpx.post(
            f"{web}/v1/completions", timeout=300, headers={"Authorization": f"Bearer {secret}"},
            json={"model": "sleepy", "prompt": f"Wake up, {n}.", "max_tokens": 4,
                  "stream": n % 2 == 0})

    threads = [threading.Thread(target=send, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

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
