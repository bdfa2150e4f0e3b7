"""The gateway's own logic, through a real web process, against scripted stand-in engines
(tests.stub_upstream). The same behaviour against a real vLLM engine: tests/e2e."""

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from django.conf import settings
from django.utils import timezone

from accounts.models import APIKey, Organization
from billing.models import UsageRecord
from endpoints.gateway.app import cache_salt
from endpoints.models import Endpoint, State
from engine.agent import engine_api_key
from engine.supervisor import free_port
from tests.conftest import Ingested, start_web, stop, wait_until
from tests.factories import api_key, inference_key, organization_with_owner, ready_endpoint

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def stubs(stub_ports: list[int]) -> Iterator[list[httpx.Client]]:
    clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}") for port in stub_ports]
    for client in clients:
        client.delete("/_requests")
    yield clients
    for client in clients:
        client.close()


@pytest.fixture
def endpoint(org: Organization, stub_ports: list[int]) -> Endpoint:
    return ready_endpoint(org, "chat", stub_ports[:1])


@pytest.fixture
def secret(org: Organization) -> str:
    return inference_key(org)[1]


def call(web: str, secret: str | None, body: object, path: str = "/v1/completions",
         **headers: str) -> httpx.Response:
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    return httpx.post(web + path, content=json.dumps(body), headers=headers, timeout=30)


def received(stub: httpx.Client) -> list[dict]:
    return stub.get("/_requests").json()


def events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_it_proxies_a_completion_and_records_its_usage(
    web: str, endpoint: Endpoint, org: Organization, secret: str, stubs: list[httpx.Client],
    ingested: Ingested
) -> None:
    response = call(web, secret, {"model": "chat", "prompt": "hello", "max_tokens": 4})

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    request_id = response.headers["x-request-id"]
    assert request_id.startswith("req_")
    assert float(response.headers["x-kvrun-overhead-ms"]) >= 0
    assert response.headers["x-ratelimit-limit-requests"] == str(
        settings.KVRUN_KEY_REQUESTS_PER_MINUTE)
    [sent] = received(stubs[0])
    replica = endpoint.replicas.get()
    assert sent["body"]["cache_salt"] == cache_salt(org.id)
    assert sent["authorization"] == f"Bearer {engine_api_key(replica.id)}"

    assert ingested(1)
    record = UsageRecord.objects.get()
    assert (record.request_id, record.organization_id, record.endpoint_id, record.replica_id) == (
        request_id, org.id, endpoint.id, replica.id)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (7, 4, 3)
    assert (record.status_code, record.operation, record.stream) == (200, "completions", False)
    assert not record.client_disconnected
    assert APIKey.objects.get(id=record.api_key_id).last_used_at == record.started_at


def test_a_stream_shows_usage_only_as_the_client_asked(
    web: str, endpoint: Endpoint, secret: str, stubs: list[httpx.Client], ingested: Ingested
) -> None:
    body = {"model": "chat", "prompt": "hello", "stream": True}
    plain = call(web, secret, body)
    asked = call(web, secret, {**body, "stream_options": {"include_usage": True}})
    running = call(web, secret, {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})

    assert plain.headers["content-type"].startswith("text/event-stream")
    plain_events = events(plain)
    assert plain_events[-1] == "[DONE]"
    assert all("usage" not in json.loads(event) for event in plain_events[:-1])
    assert len(plain_events) == 5  # four chunks, no usage chunk
    asked_chunks = [json.loads(event) for event in events(asked)[:-1]]
    assert [chunk["usage"] for chunk in asked_chunks[:-1]] == [None] * 4
    assert asked_chunks[-1]["choices"] == [] and asked_chunks[-1]["usage"]["completion_tokens"] == 4
    running_chunks = [json.loads(event) for event in events(running)[:-1]]
    assert [chunk["usage"]["completion_tokens"] for chunk in running_chunks[:4]] == [1, 2, 3, 4]
    # Upstream always runs with usage on, so the gateway can meter every stream.
    for sent in received(stubs[0]):
        assert sent["body"]["stream_options"] == {"include_usage": True,
                                                  "continuous_usage_stats": True}

    assert ingested(3)
    assert list(UsageRecord.objects.values_list("completion_tokens", "stream").distinct()) == [
        (4, True)]
    assert all(record.time_to_first_token_ms is not None for record in UsageRecord.objects.all())


def test_a_client_cannot_choose_its_cache_salt(
    web: str, endpoint: Endpoint, org: Organization, secret: str, stubs: list[httpx.Client]
) -> None:
    response = call(web, secret, {"model": "chat", "prompt": "hello", "cache_salt": "theirs"})

    assert response.status_code == 200
    assert received(stubs[0])[0]["body"]["cache_salt"] == cache_salt(org.id)
    assert cache_salt(org.id) != cache_salt(organization_with_owner("Globex").id)


def test_it_refuses_missing_wrong_and_misused_keys(
    web: str, endpoint: Endpoint, org: Organization, other_org: Organization, secret: str,
    stubs: list[httpx.Client], ingested: Ingested
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    restricted = inference_key(org, endpoint_names=["other"])[1]
    ready_endpoint(other_org, "theirs", [free_port()])
    outsider = inference_key(other_org)[1]

    missing = call(web, None, body)
    wrong = call(web, "kvr_" + "x" * 43, body)
    manage = call(web, api_key(org)[1], body)
    not_allowed = call(web, restricted, body)
    foreign = call(web, outsider, body)
    other_way = call(web, secret, {"model": "theirs", "prompt": "hello"})

    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")
    assert "kvr_xxxx…xxxx" in wrong.json()["error"]["message"]
    assert (manage.status_code, manage.json()["error"]["code"]) == (403, "insufficient_scope")
    assert not_allowed.status_code == 403 and "other" in not_allowed.json()["error"]["message"]
    # Another organisation's endpoint does not exist for the caller.
    assert (foreign.status_code, foreign.json()["error"]["code"]) == (404, "model_not_found")
    assert other_way.status_code == 404
    assert foreign.json()["error"]["type"] == "invalid_request_error"
    assert received(stubs[0]) == []
    assert not ingested(1, timeout=2)


def test_it_refuses_bad_input_without_reaching_an_engine(
    web: str, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    auth = {"Authorization": f"Bearer {secret}"}
    cases = {
        "invalid_json": httpx.post(f"{web}/v1/completions", content=b"{not json", headers=auth),
        "no model": call(web, secret, {"prompt": "hello"}),
        "bad stream": call(web, secret, {"model": "chat", "prompt": "x", "stream": "yes"}),
        "too large": call(web, secret, {"model": "chat",
                                        "prompt": "x" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE}),
        "wrong method": httpx.get(f"{web}/v1/completions", headers=auth),
        "engine metrics": httpx.get(f"{web}/v1/metrics", headers=auth),
        "engine health": httpx.get(f"{web}/health", headers=auth),
    }

    statuses = {name: response.status_code for name, response in cases.items()}
    assert statuses == {"invalid_json": 400, "no model": 400, "bad stream": 400,
                        "too large": 413, "wrong method": 405, "engine metrics": 404,
                        "engine health": 404}
    assert cases["invalid_json"].json()["error"]["code"] == "invalid_json"
    assert cases["no model"].json()["error"]["param"] == "model"
    assert "limit of" in cases["too large"].json()["error"]["message"]
    assert cases["wrong method"].headers["allow"] == "POST"
    assert "vllm" not in cases["engine metrics"].text.lower()
    assert received(stubs[0]) == []


def test_an_endpoint_that_is_not_ready_says_what_it_is_doing(
    web: str, org: Organization, secret: str
) -> None:
    loading = ready_endpoint(org, "warming", [free_port()], state=State.LOADING)
    loading.replicas.update(stage="loading weights", progress_percent=50)
    ready_endpoint(org, "resting", [], state=State.STOPPED)

    starting = call(web, secret, {"model": "warming", "prompt": "hello"})
    stopped = call(web, secret, {"model": "resting", "prompt": "hello"})

    assert starting.status_code == 503 and starting.headers["retry-after"] == "5"
    assert starting.json()["error"]["message"] == (
        "Endpoint 'warming' is loading (loading weights, 50%); retry in a few seconds.")
    assert stopped.status_code == 503
    assert f"/api/v1/organizations/{org.slug}/endpoints/resting/start/" in (
        stopped.json()["error"]["message"])
    models = httpx.get(f"{web}/v1/models", headers={"Authorization": f"Bearer {secret}"}).json()
    assert models == {"object": "list", "data": []}


def test_a_refused_connection_is_retried_on_another_replica(
    web: str, org: Organization, secret: str, stub_ports: list[int], stubs: list[httpx.Client],
    ingested: Ingested
) -> None:
    endpoint = ready_endpoint(org, "sturdy", [free_port(), stub_ports[0]])
    live = endpoint.replicas.get(port=stub_ports[0])

    statuses = [call(web, secret, {"model": "sturdy", "prompt": "hello"}).status_code
                for _ in range(4)]

    assert statuses == [200] * 4
    assert len(received(stubs[0])) == 4
    assert ingested(4)
    assert set(UsageRecord.objects.values_list("replica_id", flat=True)) == {live.id}


def test_requests_go_to_the_replica_with_the_fewest_in_flight(
    web: str, org: Organization, secret: str, stub_ports: list[int], stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "pair", stub_ports)
    results: list[int] = []

    def slow() -> None:
        results.append(call(web, secret, {"model": "pair", "prompt": "slow"}).status_code)

    threads = [threading.Thread(target=slow) for _ in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join()

    assert results == [200] * 4
    assert [len(received(stub)) for stub in stubs] == [2, 2]


def test_a_stream_that_breaks_ends_with_an_error_frame_and_done(
    web: str, endpoint: Endpoint, secret: str, ingested: Ingested
) -> None:
    response = call(web, secret, {"model": "chat", "prompt": "drop", "stream": True})

    frames = events(response)
    assert response.status_code == 200
    assert [json.loads(frame)["choices"][0]["text"] for frame in frames[:2]] == [" t0", " t1"]
    assert json.loads(frames[2])["error"]["code"] == "engine_error"
    assert frames[3:] == ["[DONE]"]
    assert ingested(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.error_code, record.completion_tokens) == (
        502, "engine_error", 2)


def test_engine_errors_reach_the_client_in_openai_shape(
    web: str, endpoint: Endpoint, secret: str, ingested: Ingested
) -> None:
    response = call(web, secret, {"model": "chat", "prompt": "context"})

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "context_length_exceeded", "input_tokens")
    assert ingested(1)
    assert UsageRecord.objects.get().error_code == "context_length_exceeded"


def test_a_key_has_a_request_limit_per_minute(
    web: str, endpoint: Endpoint, org: Organization, ingested: Ingested
) -> None:
    _, secret = inference_key(org, requests_per_minute=2)

    statuses = [call(web, secret, {"model": "chat", "prompt": "hello"}) for _ in range(3)]

    assert [r.status_code for r in statuses] == [200, 200, 429]
    refused = statuses[2]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "2 requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert statuses[0].headers["x-ratelimit-remaining-requests"] == "1"
    assert ingested(2)
    assert not ingested(3, timeout=2)  # the refused one ran nowhere and is not billed


def test_a_key_has_a_token_limit_per_minute(
    web: str, endpoint: Endpoint, org: Organization
) -> None:
    _, secret = inference_key(org, tokens_per_minute=10)

    first = call(web, secret, {"model": "chat", "prompt": "hello"})  # 7 + 4 tokens
    assert first.status_code == 200
    assert wait_until(lambda: call(web, secret, {"model": "chat", "prompt": "x"}).status_code
                      == 429, 5)
    refused = call(web, secret, {"model": "chat", "prompt": "hello"})

    assert refused.json()["error"]["type"] == "tokens"
    assert "10 tokens per minute" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


def test_an_organisation_has_a_limit_on_requests_in_flight(
    web: str, endpoint: Endpoint, org: Organization
) -> None:
    Organization.objects.filter(id=org.id).update(max_concurrent_requests=1)
    _, secret = inference_key(org)
    slow = threading.Thread(target=call, args=(web, secret, {"model": "chat", "prompt": "slow"}))
    slow.start()
    time.sleep(0.4)

    refused = call(web, secret, {"model": "chat", "prompt": "hello"})
    slow.join()
    after = call(web, secret, {"model": "chat", "prompt": "hello"})

    assert refused.status_code == 429
    assert "1 requests in flight" in refused.json()["error"]["message"]
    assert after.status_code == 200


def test_a_repeated_idempotency_key_does_not_run_again(
    web: str, endpoint: Endpoint, secret: str, stubs: list[httpx.Client], ingested: Ingested
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    first = call(web, secret, body, **{"Idempotency-Key": "order-1"})
    again = call(web, secret, body, **{"Idempotency-Key": "order-1"})
    failed = call(web, secret, {"model": "chat", "prompt": "context"},
                  **{"Idempotency-Key": "order-2"})
    retried = call(web, secret, {"model": "chat", "prompt": "context"},
                   **{"Idempotency-Key": "order-2"})

    assert (first.status_code, again.status_code) == (200, 200)
    assert again.content == first.content
    assert again.headers["x-kvrun-idempotent-replay"] == "true"
    assert (failed.status_code, retried.status_code) == (400, 400)  # a failure frees the key
    assert len(received(stubs[0])) == 3
    assert ingested(3)
    assert UsageRecord.objects.filter(idempotency_key="order-1").count() == 1


def test_an_idempotency_key_in_use_is_a_conflict(web: str, endpoint: Endpoint, secret: str) -> None:
    slow = threading.Thread(target=call, args=(web, secret, {"model": "chat", "prompt": "slow"}),
                            kwargs={"Idempotency-Key": "job-7"})
    slow.start()
    time.sleep(0.4)
    clash = call(web, secret, {"model": "chat", "prompt": "slow"}, **{"Idempotency-Key": "job-7"})
    slow.join()

    assert clash.status_code == 409
    assert clash.json()["error"]["code"] == "idempotency_key_reused"


def test_a_key_revoked_through_kvrun_is_refused_at_once(
    web: str, endpoint: Endpoint, org: Organization, owner_api: object
) -> None:
    key, secret = inference_key(org)
    assert call(web, secret, {"model": "chat", "prompt": "hello"}).status_code == 200

    assert owner_api.delete(f"/api/v1/organizations/{org.slug}/api-keys/{key.id}/"
                            ).status_code == 204

    # Every gateway hears of the revocation; give the message a moment to arrive.
    assert wait_until(lambda: call(web, secret, {"model": "chat", "prompt": "hello"}
                                   ).status_code == 401, 1.0, interval=0.05)


def test_a_key_revoked_behind_kvrun_s_back_is_refused_within_the_cache_ttl(
    web: str, endpoint: Endpoint, org: Organization
) -> None:
    key, secret = inference_key(org)
    assert call(web, secret, {"model": "chat", "prompt": "hello"}).status_code == 200

    APIKey.objects.filter(id=key.id).update(revoked_at=timezone.now())  # no message sent
    revoked_at = time.monotonic()

    assert wait_until(lambda: call(web, secret, {"model": "chat", "prompt": "hello"}
                                   ).status_code == 401,
                      settings.KVRUN_API_KEY_CACHE_SECONDS + 1, interval=0.2)
    assert time.monotonic() - revoked_at <= settings.KVRUN_API_KEY_CACHE_SECONDS + 0.5


def test_a_client_that_leaves_mid_stream_is_recorded_with_what_it_got(
    web: str, endpoint: Endpoint, secret: str, ingested: Ingested
) -> None:
    with httpx.stream("POST", f"{web}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "chat", "prompt": "slow", "stream": True}) as response:
        lines = response.iter_lines()
        seen = [line for line, _ in zip(lines, range(5)) if line.startswith("data: ")]
    assert len(seen) == 3

    assert ingested(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.client_disconnected) == (499, True)
    assert 3 <= record.completion_tokens < 20 and record.prompt_tokens == 7


def test_a_client_that_leaves_before_any_usage_is_billed_for_its_prompt(
    web: str, endpoint: Endpoint, secret: str, ingested: Ingested
) -> None:
    with pytest.raises(httpx.ReadTimeout):  # gone before the slow answer is ready
        httpx.post(f"{web}/v1/completions", timeout=0.3,
                   headers={"Authorization": f"Bearer {secret}"},
                   json={"model": "chat", "prompt": "slow"})

    assert ingested(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.client_disconnected) == (499, True)
    # No usage came back, so the engine's tokenizer counted the prompt.
    assert (record.prompt_tokens, record.completion_tokens) == (1, 0)


def test_usage_survives_a_web_process_told_to_stop(
    endpoint: Endpoint, secret: str, ingested: Ingested
) -> None:
    port = free_port()
    web = start_web(port)
    base = f"http://127.0.0.1:{port}"
    answered: list[int] = []

    def send() -> None:
        try:
            answered.append(call(base, secret, {"model": "chat", "prompt": "slow"}).status_code)
        except httpx.TransportError:
            pass  # the server had stopped taking connections; nothing was admitted

    threads = [threading.Thread(target=send) for _ in range(12)]
    try:
        for thread in threads[:8]:
            thread.start()
        time.sleep(0.5)
        web.send_signal(signal.SIGTERM)  # 8 requests in flight
        for thread in threads[8:]:
            thread.start()
        for thread in threads:
            thread.join()
        assert web.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    finally:
        stop(web)

    assert answered.count(200) >= 8
    assert ingested(len(answered))
    assert UsageRecord.objects.count() == len(answered) == answered.count(200)


def test_models_lists_the_ready_endpoints_a_key_may_call(
    web: str, endpoint: Endpoint, org: Organization, secret: str
) -> None:
    ready_endpoint(org, "second", [free_port()])
    restricted = inference_key(org, endpoint_names=["chat"])[1]

    listed = httpx.get(f"{web}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    only = httpx.get(f"{web}/v1/models", headers={"Authorization": f"Bearer {restricted}"})
    one = httpx.get(f"{web}/v1/models/chat", headers={"Authorization": f"Bearer {secret}"})
    missing = httpx.get(f"{web}/v1/models/nope", headers={"Authorization": f"Bearer {secret}"})

    assert [model["id"] for model in listed.json()["data"]] == ["chat", "second"]
    assert [model["id"] for model in only.json()["data"]] == ["chat"]
    assert one.json() == {"id": "chat", "object": "model", "owned_by": org.slug,
                          "created": int(endpoint.created_at.timestamp())}
    assert missing.status_code == 404
