"""Tools, reasoning and structured outputs through the gateway (engine.parsers says which
engines take them): requests pass through as clients send them, and answers reach the
official `openai` client whole."""

import httpx
import openai
import pytest

from billing.models import UsageRecord
from endpoints.models import Endpoint, ModelSpec, Replica
from tests.gateway.helpers import InProcessGateway, received, stored
from tests.stub_upstream import THOUGHTS, TOOL_CALL

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]


def chat(content: str, **fields: object) -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": content}], **fields}


def started_with(endpoint: Endpoint, *, tool_call_parser: str, reasoning_parser: str) -> None:
    """Its model names these parsers, and its ready engines were started with them."""
    ModelSpec.objects.filter(id=endpoint.model_id).update(
        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    Replica.objects.filter(endpoint=endpoint).update(
        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)


@pytest.fixture
def parsed(stub_endpoint: Endpoint) -> Endpoint:
    """Its engines have a tool-call and a reasoning parser, as Qwen3's do."""
    started_with(stub_endpoint, tool_call_parser="hermes", reasoning_parser="qwen3")
    return stub_endpoint


def test_tools_sent_to_an_engine_without_a_parser_are_refused_saying_why(
        gateway: InProcessGateway, stub_endpoint: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    # Its model has a parser now, but its engine was started before it had one.
    started_with(stub_endpoint, tool_call_parser="", reasoning_parser="")
    ModelSpec.objects.filter(id=stub_endpoint.model_id).update(tool_call_parser="hermes")

    refused = gateway.post(secret, chat("hello", tools=TOOLS), path="/v1/chat/completions")
    named = gateway.post(secret, chat("hello", tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), path="/v1/chat/completions")
    listed = gateway.get(secret, "/v1/models/chat").json()
    # What vLLM takes without a parser passes: tool_choice "none" or null, and a completion.
    without = gateway.post(secret, chat("hello", tools=TOOLS, tool_choice="none"),
                           path="/v1/chat/completions")
    null = gateway.post(secret, chat("hello", tools=TOOLS, tool_choice=None),
                        path="/v1/chat/completions")
    completion = gateway.post(secret, {"model": "chat", "prompt": "hello", "tools": TOOLS})

    assert refused.status_code == named.status_code == 400
    assert refused.json()["error"] == named.json()["error"] == {
        "message": "The model behind chat has no tool-call parser, so its engines take no "
                   "tools (GET /v1/models shows each endpoint's capabilities). Send "
                   "tool_choice \"none\", or use a model whose catalog entry names a tool-call "
                   "parser.",
        "type": "invalid_request_error", "param": "tools", "code": "tools_unsupported"}
    assert listed["capabilities"]["tools"] is False
    # Refused before the engine and the meter.
    assert [without.status_code, null.status_code, completion.status_code] == [200, 200, 200]
    assert [sent["body"].get("tool_choice", "-") for sent in received(stubs[0])] == [
        "none", None, "-"]
    assert stored(3) and UsageRecord.objects.count() == 3


def test_models_say_which_endpoints_take_tools_and_reasoning(
        gateway: InProcessGateway, parsed: Endpoint, secret: str) -> None:
    listed = gateway.get(secret, "/v1/models/chat").json()

    assert listed["capabilities"] == {"tools": True, "reasoning": True,
                                      "structured_outputs": True}


def test_a_reasoning_model_s_thinking_and_tool_call_reach_the_openai_client(
        gateway: InProcessGateway, parsed: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=secret,
                                http_client=gateway.client)

    async def both() -> tuple[openai.types.chat.ChatCompletion, list]:
        whole = await client.chat.completions.create(
            **chat("think", tools=TOOLS, tool_choice="auto"))
        streamed = await client.chat.completions.create(
            **chat("think", tools=TOOLS, tool_choice="auto"), stream=True,
            stream_options={"include_usage": True})
        return whole, [chunk async for chunk in streamed]

    whole, chunks = gateway.run(both())

    message = whole.choices[0].message
    assert message.reasoning == "".join(THOUGHTS)  # type: ignore[attr-defined]
    assert message.tool_calls[0].function.arguments == TOOL_CALL["function"]["arguments"]
    # Fields beyond OpenAI's reach the client's objects as extra fields.
    assert [(chunk.choices[0].delta.model_extra or {}).get("reasoning") for chunk in chunks
             if chunk.choices] == [*THOUGHTS, None]
    called = [chunk.choices[0].delta.tool_calls for chunk in chunks
              if chunk.choices and chunk.choices[0].delta.tool_calls]
    assert called[0][0].function.name == "get_weather"
    assert chunks[-1].usage.completion_tokens == 12
    # The engine got the tools as the client sent them.
    assert [sent["body"]["tools"] for sent in received(stubs[0])] == [TOOLS, TOOLS]
    # Metered from the engine's usage; the stream's first token was its first thought,
    # although no text ever came.
    assert stored(2)
    records = UsageRecord.objects.order_by("started_at")
    assert [(r.prompt_tokens, r.completion_tokens) for r in records] == [(9, 12), (9, 12)]
    assert records[1].time_to_first_token_ms is not None


def test_an_engine_s_answer_to_a_named_tool_or_a_json_schema_passes_unchanged(
        gateway: InProcessGateway, parsed: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}
    named = {"type": "function", "function": {"name": "get_weather"}}

    responses = [gateway.post(secret, chat("hello", response_format=schema),
                              path="/v1/chat/completions"),
                 gateway.post(secret, chat("hello", tools=TOOLS, tool_choice=named),
                              path="/v1/chat/completions")]

    assert [response.status_code for response in responses] == [200, 200]
    sent = [request["body"] for request in received(stubs[0])]
    assert sent[0]["response_format"] == schema and sent[1]["tool_choice"] == named
