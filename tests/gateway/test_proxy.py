"""The gateway relays requests to engines: completions and chats, streams and their usage,
the engine's own time kept apart from the gateway's, answers and events over the limits,
engine errors in OpenAI's shape, and the models a key may call.

The gateway's ASGI app driven in this process, in front of scripted stand-in engines
(tests.stub_upstream); the same against a real vLLM engine is in tests/e2e."""


import httpx
import orjson
import pytest
from django.conf import settings
from django.test import override_settings

from accounts.models import APIKey, Organization
from billing.models import UsageRecord
from endpoints.models import Endpoint, ModelSpec
from engine.processes import free_port
from tests.factories import inference_key, ready_endpoint
from tests.gateway.helpers import InProcessGateway, documented_cache_salt, events, received, stored
from tests.helpers import engine_headers
from tests.stub_upstream import LONG_EVENT_TEXT_BYTES

# e2e: the stand-in engines are processes of their own.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_it_proxies_a_completion_and_records_its_usage(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str,
    stubs: list[httpx.Client]
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "hello", "max_tokens": 4})

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    request_id = response.headers["x-request-id"]
    assert request_id.startswith("req_")
    assert response.headers["x-ratelimit-limit-requests"] == str(
        settings.KVRUN_KEY_REQUESTS_PER_MINUTE)
    [sent] = received(stubs[0])
    replica = stub_endpoint.replicas.get()
    assert sent["body"]["cache_salt"] == documented_cache_salt(org.id)
    assert sent["authorization"] == engine_headers(replica)["Authorization"]

    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.request_id, record.organization_id, record.endpoint_id, record.replica_id) == (
        request_id, org.id, stub_endpoint.id, replica.id)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (7, 4, 3)
    assert (record.status_code, record.operation, record.stream) == (200, "completions", False)
    assert not record.client_disconnected
    assert APIKey.objects.get(id=record.api_key_id).last_used_at == record.started_at


def test_usage_an_engine_could_not_have_used_is_never_recorded(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    # Three prompts, two choices each: six sequences at the endpoint's context at most.
    response = gateway.post(secret, {"model": "chat", "prompt": ["lie", "b", "c"], "n": 2,
                                     "max_tokens": 4})

    assert response.status_code == 200, response.text
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (
        0, 6 * stub_endpoint.context_length, 0)


def test_the_engine_s_time_is_not_the_gateway_s_overhead(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "slow"})  # a second's work

    # Were the engine's second counted, the overhead would be more than that; the gateway's
    # own work is about a millisecond (bench/gateway.py measures it).
    assert response.status_code == 200
    assert float(response.headers["x-kvrun-overhead-ms"]) < 1000
    assert stored(1)
    record = UsageRecord.objects.get()
    assert record.duration_ms >= 1000 and record.gateway_overhead_ms < 1000


def test_a_chat_completion_goes_to_the_engine_s_chat_path(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    response = gateway.post(secret, {"model": "chat", "messages": [
        {"role": "user", "content": "hello"}]}, path="/v1/chat/completions")

    assert response.status_code == 200
    assert [sent["path"] for sent in received(stubs[0])] == ["/v1/chat/completions"]
    assert stored(1)
    assert UsageRecord.objects.get().operation == "chat.completions"


def test_a_model_without_a_chat_template_takes_completions_and_refuses_chats_clearly(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    ModelSpec.objects.filter(id=stub_endpoint.model_id).update(chat_template=False)

    chat = gateway.post(secret, {"model": "chat", "messages": [
        {"role": "user", "content": "hello"}]}, path="/v1/chat/completions")
    completion = gateway.post(secret, {"model": "chat", "prompt": "hello", "max_tokens": 4})

    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "chat_template_missing"
    assert chat.json()["error"]["message"] == (
        "The model behind chat has no chat template, so it cannot take chat messages; send a "
        "prompt to /v1/completions instead.")
    assert completion.status_code == 200
    assert [sent["path"] for sent in received(stubs[0])] == ["/v1/completions"]


def test_a_stream_shows_usage_only_as_the_client_asked(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    body = {"model": "chat", "prompt": "hello", "stream": True}
    plain = gateway.post(secret, body)
    asked = gateway.post(secret, {**body, "stream_options": {"include_usage": True}})
    running = gateway.post(secret, {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})

    assert plain.headers["content-type"].startswith("text/event-stream")
    plain_events = events(plain)
    assert plain_events[-1] == "[DONE]"
    assert all("usage" not in orjson.loads(event) for event in plain_events[:-1])
    assert len(plain_events) == 5  # four chunks, no usage chunk
    asked_chunks = [orjson.loads(event) for event in events(asked)[:-1]]
    assert [chunk["usage"] for chunk in asked_chunks[:-1]] == [None] * 4
    assert asked_chunks[-1]["choices"] == [] and asked_chunks[-1]["usage"]["completion_tokens"] == 4
    running_chunks = [orjson.loads(event) for event in events(running)[:-1]]
    assert [chunk["usage"]["completion_tokens"] for chunk in running_chunks[:4]] == [1, 2, 3, 4]
    # Upstream always runs with usage on, so the gateway can meter every stream.
    for sent in received(stubs[0]):
        assert sent["body"]["stream_options"] == {"include_usage": True,
                                                  "continuous_usage_stats": True}

    assert stored(3)
    assert list(UsageRecord.objects.values_list("completion_tokens", "stream").distinct()) == [
        (4, True)]
    assert all(record.time_to_first_token_ms is not None for record in UsageRecord.objects.all())


# An engine that dies in mid-stream, and one that sends an event not of OpenAI's shape.
@pytest.mark.parametrize("prompt", ["drop", "garbled"])
def test_a_stream_that_breaks_ends_with_an_error_frame_and_done(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str, prompt: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": prompt, "stream": True})

    frames = events(response)
    assert response.status_code == 200
    assert [orjson.loads(frame)["choices"][0]["text"] for frame in frames[:2]] == [" t0", " t1"]
    assert orjson.loads(frames[2])["error"]["code"] == "engine_error"
    assert frames[3:] == ["[DONE]"]
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.error_code, record.completion_tokens) == (
        502, "engine_error", 2)


def test_an_answer_not_of_openai_s_shape_is_relayed_with_no_usage(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "garbled"})

    assert (response.status_code, response.json()) == (200, [1, 2])
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.prompt_tokens, record.completion_tokens) == (200, 0, 0)


@override_settings(KVRUN_GATEWAY_MAX_ANSWER_BYTES=256 * 1024)
def test_an_answer_over_the_limit_is_a_502_with_its_prompt_recorded(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "huge"})

    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "answer_too_large"
    assert "limit of 262144 bytes" in error["message"] and '"stream": true' in error["message"]
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200
    assert stored(2)
    record = UsageRecord.objects.get(status_code=502)
    # The engine's tokenizer counted the prompt ("huge": one word).
    assert (record.error_code, record.prompt_tokens) == ("answer_too_large", 1)


@override_settings(KVRUN_GATEWAY_MAX_ANSWER_BYTES=64 * 1024)
def test_a_stream_event_over_the_limit_ends_the_stream_with_an_error_frame(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "long", "stream": True})

    frames = events(response)
    assert orjson.loads(frames[0])["choices"][0]["text"] == " t0"
    assert orjson.loads(frames[1])["error"]["code"] == "answer_too_large"
    assert frames[2:] == ["[DONE]"]
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.error_code, record.completion_tokens) == (
        502, "answer_too_large", 1)


def test_stream_events_longer_than_aiohttp_s_line_limit_are_relayed_whole(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "long", "stream": True})

    frames = events(response)
    assert response.status_code == 200
    texts = [orjson.loads(frame)["choices"][0]["text"] for frame in frames[:-1]]
    assert texts == [" t0", "x" * LONG_EVENT_TEXT_BYTES, " t2", " t3"]
    assert frames[-1] == "[DONE]"
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.completion_tokens) == (200, 4)


def test_engine_errors_reach_the_client_in_openai_shape(
    gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "context"})

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "context_length_exceeded", "input_tokens")
    assert stored(1)
    assert UsageRecord.objects.get().error_code == "context_length_exceeded"


def test_models_lists_the_ready_endpoints_a_key_may_call(
    gateway: InProcessGateway, stub_endpoint: Endpoint, org: Organization, secret: str
) -> None:
    ready_endpoint(org, "second", [free_port()])
    restricted = inference_key(org, endpoint_names=["chat"])[1]

    listed = gateway.get(secret, "/v1/models")
    only = gateway.get(restricted, "/v1/models")
    one = gateway.get(secret, "/v1/models/chat")
    missing = gateway.get(secret, "/v1/models/nope")
    posted = gateway.post(secret, {}, path="/v1/models")

    assert [model["id"] for model in listed.json()["data"]] == ["chat", "second"]
    assert [model["id"] for model in only.json()["data"]] == ["chat"]
    assert one.json() == {"id": "chat", "object": "model", "owned_by": org.slug,
                          "created": int(stub_endpoint.created_at.timestamp()),
                          "task": "generate",
                          "capabilities": {"tools": True, "reasoning": False,
                                           "structured_outputs": True}}
    assert missing.status_code == 404
    assert posted.status_code == 405 and posted.headers["allow"] == "GET"
