"""Anthropic's Messages API through the gateway, read by the official `anthropic` client
against a stand-in engine that answers as vLLM's does: the same keys (in `x-api-key` too),
admission and metering as chat, and errors in Anthropic's shape."""

from collections.abc import Iterator

import anthropic
import httpx
import httpx2
import pytest

from accounts.models import Organization
from accounts.services import do_set_billing_hold
from billing.models import UsageRecord
from endpoints.models import Endpoint, Replica
from tests.gateway.helpers import InProcessGateway, received, stored
from tests.stub_upstream import MESSAGE_USAGE

ASKED = {"model": "chat", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def client(gateway: InProcessGateway, stub_endpoint: Endpoint,
           secret: str) -> Iterator[anthropic.AsyncAnthropic]:
    """Anthropic's client, in the gateway's process (it sends its key as x-api-key)."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gateway.app),
                              base_url="http://gateway")
    yield anthropic.AsyncAnthropic(base_url="http://gateway", api_key=secret,
                                   http_client=http, max_retries=0)
    gateway.run(http.aclose())


def test_a_message_and_a_stream_reach_anthropic_s_client_metered_from_their_usage(
        gateway: InProcessGateway, client: anthropic.AsyncAnthropic,
        stubs: list[httpx.Client]) -> None:
    async def both() -> tuple[anthropic.types.Message, list, anthropic.types.Message]:
        whole = await client.messages.create(**ASKED)
        async with client.messages.stream(**ASKED) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
        return whole, events, final

    whole, events, final = gateway.run(both())

    assert whole.content[0].text == " t0 t1 t2 t3" and whole.usage.output_tokens == 4
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == (
        " t0 t1 t2 t3")
    assert final.usage.output_tokens == 4
    # The engine got the tenant's cache salt, and no OpenAI stream options.
    sent = received(stubs[0])
    assert [request["path"] for request in sent] == ["/v1/messages"] * 2
    assert all(request["body"]["cache_salt"] and "stream_options" not in request["body"]
               for request in sent)
    # Metered as the engine counted: the prompt is its new and its cached tokens together.
    assert stored(2)
    records = UsageRecord.objects.order_by("started_at")
    prompt = sum(MESSAGE_USAGE[name] for name in (
        "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    assert [(r.operation, r.stream, r.prompt_tokens, r.completion_tokens, r.cached_tokens)
            for r in records] == [("messages", False, prompt, 4, 3),
                                  ("messages", True, prompt, 4, 3)]
    assert records[1].time_to_first_token_ms is not None


def test_refusals_come_in_anthropic_s_shape_and_change_nothing(
        gateway: InProcessGateway, client: anthropic.AsyncAnthropic, org: Organization,
        stubs: list[httpx.Client]) -> None:
    stranger = client.with_options(api_key="kvr_" + "0" * 43)

    async def refused(call: object) -> anthropic.APIStatusError:
        try:
            await call  # type: ignore[misc]
        except anthropic.APIStatusError as error:
            return error
        raise AssertionError("not refused")

    async def all_of_them() -> list[anthropic.APIStatusError]:
        return [await refused(stranger.messages.create(**ASKED)),
                await refused(client.messages.create(**{**ASKED, "model": "nope"})),
                await refused(client.messages.create(**{**ASKED, "messages": [
                    {"role": "user", "content": "context"}]}))]

    bad_key, unknown, too_long = gateway.run(all_of_them())

    assert isinstance(bad_key, anthropic.AuthenticationError)
    assert bad_key.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert "Incorrect API key provided" in bad_key.message
    assert isinstance(unknown, anthropic.NotFoundError)
    assert unknown.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert isinstance(too_long, anthropic.BadRequestError)
    assert too_long.body == {  # type: ignore[comparison-overlap]
        "type": "error", "request_id": too_long.response.headers["x-request-id"],
        "error": {"type": "invalid_request_error",
                  "message": "This model's maximum context length is 2048 tokens. However, "
                             "your prompt contains 3000 input tokens."}}
    # Only the over-long prompt reached the engine; it is recorded as refused.
    assert len(received(stubs[0])) == 1
    assert stored(1) and UsageRecord.objects.get().error_code == "context_length_exceeded"


def test_a_budget_hold_refuses_messages_as_a_billing_error(
        gateway: InProcessGateway, client: anthropic.AsyncAnthropic, org: Organization,
        stubs: list[httpx.Client]) -> None:
    do_set_billing_hold(organization_id=org.id, reason="The monthly budget is reached.")

    with pytest.raises(anthropic.APIStatusError) as held:
        gateway.run(client.messages.create(**ASKED))

    assert held.value.status_code == 402
    assert held.value.body["error"] == {  # type: ignore[index]
        "type": "billing_error", "message": "The monthly budget is reached."}
    assert received(stubs[0]) == []


def test_a_stream_the_engine_drops_ends_on_an_error_event_billed_what_was_sent(
        gateway: InProcessGateway, secret: str, stub_endpoint: Endpoint) -> None:
    response = gateway.post(secret, {**ASKED, "stream": True, "messages": [
        {"role": "user", "content": "drop"}]}, path="/v1/messages",
                            **{"x-api-key": secret})

    events = [line for line in response.text.splitlines() if line.startswith("event: ")]
    assert events[-1] == "event: error"
    assert response.text.rstrip().endswith(
        '"error":{"type":"api_error","message":"The engine stopped answering in mid-stream; '
        'the text so far is all there is."},"request_id":"'
        + response.headers["x-request-id"] + '"}')
    assert stored(1)
    record = UsageRecord.objects.get()
    # Two deltas reached the client: a token each, and the prompt the engine counted.
    assert (record.status_code, record.prompt_tokens, record.completion_tokens) == (502, 9, 2)


def test_an_engine_s_error_event_and_impossible_usage_are_not_passed_on_as_they_came(
        gateway: InProcessGateway, secret: str, stub_endpoint: Endpoint) -> None:
    failed = gateway.post(secret, {**ASKED, "stream": True, "messages": [
        {"role": "user", "content": "fail"}]}, path="/v1/messages")
    lied = gateway.post(secret, {**ASKED, "messages": [{"role": "user", "content": "lie"}]},
                        path="/v1/messages")

    # The engine's own error type is not one of Anthropic's: rewritten, as chat's are.
    assert failed.text.endswith(
        'event: error\ndata: {"type":"error","error":{"type":"api_error","message":'
        '"The engine failed: EngineCore encountered an issue."},"request_id":"'
        + failed.headers["x-request-id"] + '"}\n\n')
    assert 'internal_error' not in failed.text
    assert lied.status_code == 200
    assert stored(2)
    by_id = {r.request_id: r for r in UsageRecord.objects.all()}
    assert (by_id[failed.headers["x-request-id"]].completion_tokens,
            by_id[failed.headers["x-request-id"]].status_code) == (2, 502)
    # A negative cache read would cancel the prompt out: the figure counts as none.
    assert (by_id[lied.headers["x-request-id"]].prompt_tokens,
            by_id[lied.headers["x-request-id"]].completion_tokens) == (0, 4)


def test_messages_keep_anthropic_s_shapes_at_their_edges(
        gateway: InProcessGateway, secret: str, stub_endpoint: Endpoint,
        stubs: list[httpx.Client]) -> None:
    # Its engine was started without a tool-call parser.
    Replica.objects.filter(endpoint=stub_endpoint).update(tool_call_parser="")
    key = {"Idempotency-Key": "same-body-twice"}
    chat = gateway.post(secret, ASKED, path="/v1/chat/completions", **key)
    message = gateway.post(secret, ASKED, path="/v1/messages", **key)
    counted = gateway.post(secret, ASKED, path="/v1/messages/count_tokens")
    empty_bearer = gateway.post(None, ASKED, path="/v1/messages",
                                **{"Authorization": "Bearer ", "x-api-key": secret})
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    no_parser = gateway.post(secret, {**ASKED, "tools": tools, "tool_choice": None},
                             path="/v1/messages")

    # One Idempotency-Key on both APIs is two requests: no chat answer replayed as a message.
    assert chat.json()["object"] == "text_completion" and message.json()["type"] == "message"
    assert "x-kvrun-idempotent-replay" not in message.headers
    # Counted by the engine, and metered as a request of no tokens.
    assert counted.status_code == 200 and counted.json() == {"input_tokens": 1}
    assert empty_bearer.status_code == 200
    # Anthropic's null tool_choice is "auto": refused before the engine, saying its "none".
    assert no_parser.status_code == 400
    assert no_parser.json()["error"]["message"].endswith(
        'Send tool_choice {"type": "none"}, or use a model whose catalog entry names a '
        "tool-call parser.")
    assert [request["path"] for request in received(stubs[0])] == [
        "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/messages"]
    assert stored(4)
    assert list(UsageRecord.objects.filter(operation="count_tokens").values_list(
        "status_code", "prompt_tokens", "completion_tokens")) == [(200, 0, 0)]
