"""The OpenAI-compatible gateway end to end: the official `openai` client → web process →
a real vLLM engine provisioned by the node agent, with usage ingested by the real worker.

One engine serves the whole module, so its rows must outlive each test: the module commits
its own data (no test transaction, no flush between its tests) and flushes once at the end.
It runs the prefill-heavy bench model, whose decode step is milliseconds: a long answer
then takes seconds, so a client leaves, and a web process dies, while the engine is
certainly still generating (the demo model's whole 2,000 tokens took under a second).
"""

import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import anthropic
import httpx
import jsonschema
import openai
import orjson
import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from accounts.models import Organization, Role
from accounts.services import do_create_organization, do_revoke_api_key, do_set_billing_hold
from billing.ingestion import do_ingest_usage
from billing.models import UsageRecord
from billing.tasks import ingest_usage
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy
from endpoints.services import do_create_endpoint, do_delete_endpoint, do_load_catalogs
from engine.metrics import engine_token_totals, totals
from engine.processes import free_port
from tests.factories import UserFactory, inference_key
from tests.helpers import (
    PATIENT,
    SuiteAgent,
    api_servers,
    drive,
    engine_client,
    records_for,
    start_web,
    stop,
    wait_until,
)

pytestmark = [pytest.mark.e2e]


@dataclass(frozen=True)
class Served:
    web: str
    endpoint: Endpoint
    first: Organization
    second: Organization

    def client(self, secret: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.web}/v1", api_key=secret, max_retries=0)

    def metrics(self) -> dict[str, float]:
        return totals(self.engine_metrics())

    def engine_metrics(self) -> str:
        replica = Replica.objects.get(endpoint=self.endpoint, state=State.READY)
        with engine_client(replica) as engine:
            return engine.get("/metrics").text


@pytest.fixture(scope="module")
def served(django_db_blocker: object, agent: SuiteAgent, web: str) -> Iterator[Served]:
    with django_db_blocker.unblock():
        agent.enrolled()
        do_load_catalogs()
        assert wait_until(lambda: Node.objects.filter(name="e2e-a", state="online",
                                                      gpu_type__slug="cpu").exists(), 60)
        first = do_create_organization(user=UserFactory(), name="Initech")
        second = do_create_organization(user=UserFactory(), name="Umbrella")
        endpoint = do_create_endpoint(
            organization=first, actor_role=Role.OWNER, created_by=None, name="chat",
            model=ModelSpec.objects.get(slug="kvrun-bench-prefill"),
            gpu_type=GPUType.objects.get(slug="cpu"),  # sized for the CPU node, late or not
            policy=EndpointPolicy(context_length=2048, concurrency=8))
        assert drive(lambda: Endpoint.objects.get(id=endpoint.id).state == State.READY, 180)
        yield Served(web=web, endpoint=endpoint, first=first, second=second)
        do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
        assert drive(lambda: not api_servers("chat") and not Replica.objects.filter(
            endpoint=endpoint).exclude(state=State.STOPPED).exists(), 60)
        call_command("flush", interactive=False, verbosity=0)


def test_the_openai_client_works_against_kvrun(served: Served) -> None:
    client = served.client(inference_key(served.first)[1])

    assert [model.id for model in client.models.list()] == ["chat"]
    chat = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "Say hello"}], max_tokens=5)
    completion = client.completions.create(model="chat", prompt="Once upon a time",
                                           max_tokens=5)
    streamed = list(client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Count"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}))
    plain_stream = list(client.completions.create(model="chat", prompt="Hello", max_tokens=4,
                                                  stream=True))

    assert chat.headers["x-request-id"].startswith("req_")
    assert float(chat.headers["x-kvrun-overhead-ms"]) >= 0  # its size: bench/gateway.py
    assert chat.parse().usage.completion_tokens == 5
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text
    assert streamed[-1].usage.completion_tokens == 6 and streamed[-1].choices == []
    assert all(chunk.usage is None for chunk in streamed[:-1])
    assert all(chunk.usage is None for chunk in plain_stream)
    assert sum(bool(chunk.choices) for chunk in plain_stream) == len(plain_stream)
    records = records_for([chat.headers["x-request-id"]])
    assert (records[0].prompt_tokens, records[0].completion_tokens) == (
        chat.parse().usage.prompt_tokens, 5)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
# Bounded by a pattern: guided decoding's plain string admits control characters, which
# random weights then write raw (JSON parsers refuse them).
ANSWER = {"type": "object", "properties": {"answer": {"type": "string",
                                                      "pattern": "^[a-z]{1,8}$"},
                                           "score": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


def test_an_agent_s_tools_and_structured_outputs_work_with_the_openai_client(
        served: Served) -> None:
    """The catalog gives the model a tool-call parser, so its engine takes any tool_choice.
    Guided decoding holds a named call and a JSON schema to their schemas even with random
    weights, which sample whitespace inside the grammar for a while: a seed makes each run
    the same (all seeds tried ended in under 100 tokens)."""
    client = served.client(inference_key(served.first)[1])
    asked = {"model": "chat", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    named = {"type": "function", "function": {"name": "get_weather"}}

    listed = client.models.retrieve("chat")
    auto = client.chat.completions.with_raw_response.create(
        **asked, tools=[WEATHER], tool_choice="auto", max_tokens=8)
    called = client.chat.completions.with_raw_response.create(
        **asked, tools=[WEATHER], tool_choice=named, max_tokens=1000, seed=0)
    streamed = list(client.chat.completions.create(
        **asked, tools=[WEATHER], tool_choice=named, max_tokens=1000, seed=1, stream=True,
        stream_options={"include_usage": True}))
    shaped = client.chat.completions.with_raw_response.create(
        **asked, max_tokens=1000, seed=0, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                   "strict": True}})

    assert (listed.model_extra or {})["capabilities"] == {
        "tools": True, "reasoning": False, "structured_outputs": True}
    # "auto" is taken (a refusal raises): random weights then write text or a call.
    assert auto.parse().usage.prompt_tokens > 0
    call = called.parse().choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(orjson.loads(call.function.arguments), WEATHER["function"]["parameters"])
    deltas = [delta for chunk in streamed if chunk.choices
              for delta in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    jsonschema.validate(orjson.loads("".join(d.function.arguments or "" for d in deltas)),
                        WEATHER["function"]["parameters"])
    jsonschema.validate(orjson.loads(shaped.parse().choices[0].message.content), ANSWER)
    # Each metered as the engine counted it, tool definitions in the prompt included.
    answers = {answer.headers["x-request-id"]: answer.parse().usage
               for answer in (auto, called, shaped)}
    assert {r.request_id: (r.prompt_tokens, r.completion_tokens)
            for r in records_for(list(answers))} == {
        request_id: (usage.prompt_tokens, usage.completion_tokens)
        for request_id, usage in answers.items()}
    # The chat template writes the tools into the prompt.
    assert shaped.parse().usage.prompt_tokens < auto.parse().usage.prompt_tokens


def test_anthropic_s_client_works_against_kvrun_metered_as_the_engine_counted(
        served: Served) -> None:
    """Anthropic's Messages API, which the engine serves: plain, streamed and with tools,
    with the key in x-api-key as the SDK sends it; each refusal in Anthropic's shape."""
    secret = inference_key(served.first)[1]
    client = anthropic.Anthropic(base_url=served.web, api_key=secret, max_retries=0)
    asked = {"model": "chat", "max_tokens": 6,
             "messages": [{"role": "user", "content": "Say hello"}]}
    before = engine_token_totals(served.engine_metrics())

    plain = client.messages.with_raw_response.create(**asked)
    with client.messages.stream(**asked) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
        streamed_id = stream.response.headers["x-request-id"]
    tooled = client.messages.with_raw_response.create(
        **asked, tool_choice={"type": "auto"}, tools=[{
            "name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}])
    after = engine_token_totals(served.engine_metrics())

    assert plain.parse().usage.output_tokens == 6 and plain.parse().content[0].type == "text"
    assert streamed.usage.output_tokens == 6 and streamed_text.strip()
    def prompt(usage: anthropic.types.Usage) -> int:  # vLLM splits it three ways
        return (usage.input_tokens + (usage.cache_read_input_tokens or 0)
                + (usage.cache_creation_input_tokens or 0))
    assert prompt(tooled.parse().usage) > prompt(plain.parse().usage)  # its tools written in
    records = records_for([plain.headers["x-request-id"], streamed_id,
                           tooled.headers["x-request-id"]])
    assert {r.operation for r in records} == {"messages"}
    assert sum(r.prompt_tokens for r in records) == after["prompt"] - before["prompt"]
    assert sum(r.completion_tokens for r in records) == (
        after["generation"] - before["generation"])

    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        anthropic.Anthropic(base_url=served.web, api_key="kvr_" + "0" * 43,
                            max_retries=0).messages.create(**asked)
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(**{**asked, "messages": [
            {"role": "user", "content": "lorem ipsum " * 3000}]})
    held = do_create_organization(user=UserFactory(), name="Held Corp")
    do_set_billing_hold(organization_id=held.id, reason="The monthly budget is reached.")
    with pytest.raises(anthropic.APIStatusError) as budget:
        anthropic.Anthropic(base_url=served.web, api_key=inference_key(held)[1],
                            max_retries=0).messages.create(**asked)
    assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert too_long.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "maximum context length is 2048" in too_long.value.message
    assert budget.value.status_code == 402
    assert budget.value.body["error"] == {  # type: ignore[index]
        "type": "billing_error", "message": "The monthly budget is reached."}


def test_openai_errors_come_as_the_client_expects(served: Served) -> None:
    client = served.client(inference_key(served.first)[1])
    limited = served.client(inference_key(served.first, requests_per_minute=1)[1])

    with pytest.raises(openai.AuthenticationError) as bad_key:
        served.client("kvr_" + "0" * 43).models.list()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-endpoint", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="chat", prompt="lorem ipsum " * 3000, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as invalid:
        client.chat.completions.create(model="chat", max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"temperature": "hot", "top_p": "high"})
    limited.completions.create(model="chat", prompt="Hi there", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as exhausted:
        limited.completions.create(model="chat", prompt="Hi there", max_tokens=2)

    assert bad_key.value.code == "invalid_api_key"
    assert unknown.value.code == "model_not_found"
    assert too_long.value.code == "context_length_exceeded"
    assert "maximum context length is 2048" in too_long.value.message
    assert "(parameter=" not in too_long.value.message
    # vLLM's validation errors, read as fields and what is wrong with each.
    assert "Invalid request: temperature: Input should be a valid number" in invalid.value.message
    assert "; top_p: Input should be a valid number" in invalid.value.message
    assert exhausted.value.code == "rate_limit_exceeded"
    assert int(exhausted.value.response.headers["retry-after"]) >= 1
    assert exhausted.value.response.headers["x-ratelimit-limit-requests"] == "1"


def test_one_organisation_s_cached_prefixes_never_serve_another(served: Served) -> None:
    """Endpoints are dedicated, so to put two organisations' traffic on one engine the test
    hands the endpoint from one to the other, as a shared engine would see it."""
    prompt = f"{uuid.uuid4()} " + "The quick brown fox jumps over the lazy dog. " * 40
    first = served.client(inference_key(served.first)[1])
    second = served.client(inference_key(served.second)[1])

    def cached(client: openai.OpenAI) -> tuple[int, float]:
        before = served.metrics()["vllm:prefix_cache_hits_total"]
        usage = client.completions.create(model="chat", prompt=prompt, max_tokens=1).usage
        hits = served.metrics()["vllm:prefix_cache_hits_total"] - before
        return usage.prompt_tokens_details.cached_tokens, hits

    assert first.completions.create(model="chat", prompt=prompt, max_tokens=1).usage \
        .prompt_tokens > 256
    first_again = cached(first)
    Endpoint.objects.filter(id=served.endpoint.id).update(organization=served.second)
    try:
        second_cold = cached(second)
        second_again = cached(second)
    finally:
        Endpoint.objects.filter(id=served.endpoint.id).update(organization=served.first)

    assert first_again[0] >= 128 and first_again[1] >= 128  # the same tenant hits
    assert second_cold == (0, 0)  # the same prompt from another tenant does not
    assert second_again[0] >= 128 and second_again[1] >= 128


def generating(served: Served) -> bool:
    return served.metrics()["vllm:num_requests_running"] >= 1


def test_a_client_that_leaves_mid_stream_stops_the_engine_and_pays_for_what_it_got(
    served: Served
) -> None:
    secret = inference_key(served.first)[1]
    max_tokens = 2000
    before = served.metrics()["vllm:generation_tokens_total"]
    with httpx.stream("POST", f"{served.web}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "chat", "prompt": "Tell me everything", "stream": True,
                            "max_tokens": max_tokens, "ignore_eos": True}) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # gone at the first chunk
    [record] = records_for([request_id])
    # Once the engine runs no request, what it generated is final.
    assert wait_until(lambda: not generating(served), 30)
    generated = served.metrics()["vllm:generation_tokens_total"] - before

    assert record.client_disconnected and record.status_code == 499
    assert generated < max_tokens, "the engine kept generating for a client that had left"
    assert 1 <= record.completion_tokens <= generated
    assert record.prompt_tokens > 0


def test_a_client_that_leaves_before_a_whole_answer_stops_the_engine(served: Served) -> None:
    key, secret = inference_key(served.first)
    max_tokens = 2000
    # Named, so that its record is found without the answer that carries its id.
    named = f"leave-{uuid.uuid4()}"
    body = orjson.dumps({"model": "chat", "prompt": "Write a long story",
                         "max_tokens": max_tokens, "ignore_eos": True})
    host, port = served.web.removeprefix("http://").split(":")
    before = served.metrics()["vllm:generation_tokens_total"]
    # A non-streamed answer comes only when it is whole: the client sends its request and
    # hangs up once the engine is generating it, seconds before the end.
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvrun\r\n"
                       b"Content-Type: application/json\r\n"
                       + f"Authorization: Bearer {secret}\r\nIdempotency-Key: {named}\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: generating(served), 30, interval=0.05)
    assert wait_until(lambda: not generating(served), 30)
    generated = served.metrics()["vllm:generation_tokens_total"] - before
    assert 0 < generated < max_tokens, "the engine kept generating for a client that had left"

    def recorded() -> bool:
        ingest_usage.delay()
        return UsageRecord.objects.filter(api_key=key, idempotency_key=named).exists()
    assert wait_until(recorded, 30, interval=0.5)
    record = UsageRecord.objects.get(api_key=key, idempotency_key=named)
    assert (record.status_code, record.client_disconnected) == (499, True)
    # No usage came back: the engine's own tokenizer counted the prompt.
    assert record.prompt_tokens == served.client(secret).completions.create(
        model="chat", prompt="Write a long story", max_tokens=1).usage.prompt_tokens


def test_metered_tokens_equal_what_the_engine_counted(served: Served) -> None:
    secret = inference_key(served.first)[1]
    client = served.client(secret)
    before = engine_token_totals(served.engine_metrics())
    ids = []
    for prompt in ("Alpha", "Beta gamma delta", "Epsilon " * 20):
        ids.append(client.completions.with_raw_response.create(
            model="chat", prompt=prompt, max_tokens=7).headers["x-request-id"])
    ids.append(client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "Zeta"}], max_tokens=9,
    ).headers["x-request-id"])
    for body in ({"prompt": "Eta", "stream": True},
                 {"prompt": "Theta", "stream": True, "stream_options": {"include_usage": True}},
                 {"messages": [{"role": "user", "content": "Iota"}], "stream": True}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = httpx.post(f"{served.web}{path}", timeout=30,
                              headers={"Authorization": f"Bearer {secret}"},
                              json={"model": "chat", "max_tokens": 5, **body})
        assert response.text.rstrip().endswith("data: [DONE]")
        ids.append(response.headers["x-request-id"])
    after = engine_token_totals(served.engine_metrics())

    records = records_for(ids)
    assert sum(record.prompt_tokens for record in records) == after["prompt"] - before["prompt"]
    assert sum(record.completion_tokens for record in records) == (
        after["generation"] - before["generation"])
    assert {record.stream for record in records} == {True, False}


def test_a_revoked_key_stops_working_within_the_key_cache_ttl(served: Served) -> None:
    key, secret = inference_key(served.first)
    client = served.client(secret)
    client.completions.create(model="chat", prompt="Hello", max_tokens=1)

    do_revoke_api_key(key=key, actor_role=Role.OWNER)

    def refused() -> bool:
        try:
            client.completions.create(model="chat", prompt="Hello", max_tokens=1)
        except openai.AuthenticationError:
            return True
        return False
    assert wait_until(refused, settings.KVRUN_API_KEY_CACHE_SECONDS, interval=0.1)


# The web processes killed below and this test's ingestion agree on a short lease, so that
# their requests are recorded within seconds.
LEASE_SECONDS = 3
LONG_ANSWER = 1900  # tokens, as in the trial that found streams billed as nothing


def streamed_tokens(base: str, secret: str, *, max_tokens: int, got: dict[str, int],
                    on_token: Callable[[int, bool], None], statuses: list[object]) -> None:
    """Stream a completion, keeping in `got` by request id the completion tokens received
    (the engine's running usage, which the client asks to see); `on_token(tokens, last)` at
    each whole event with a token. Its status, or what failed before one came, goes in
    `statuses`. It waits for its answer however long the engine queues it."""
    body = {"model": "chat", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    answered = False
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body,
                          timeout=httpx.Timeout(10, read=None),
                          headers={"Authorization": f"Bearer {secret}"}) as response:
            statuses.append(response.status_code)
            answered = True
            request_id = response.headers["x-request-id"]
            got[request_id] = 0
            for line in response.iter_lines():
                try:
                    event = orjson.loads(line[6:]) if line.startswith("data: {") else {}
                except orjson.JSONDecodeError:
                    continue  # an event the kill cut short never reached the client
                if event.get("choices"):
                    got[request_id] = event["usage"]["completion_tokens"]
                    on_token(got[request_id],
                             any(choice["finish_reason"] for choice in event["choices"]))
    except httpx.TransportError as exc:
        if not answered:
            statuses.append(repr(exc))


def billed_after_the_lease(request_ids: Iterable[str]) -> dict[str, int]:
    """Each request's completion tokens once the dead web process's traces are stored."""
    request_ids = set(request_ids)
    with override_settings(KVRUN_GATEWAY_LEASE_SECONDS=LEASE_SECONDS):
        assert wait_until(lambda: do_ingest_usage() == 0 and UsageRecord.objects.filter(
            request_id__in=request_ids).count() == len(request_ids), LEASE_SECONDS + 20,
            interval=0.5)
    return dict(UsageRecord.objects.filter(request_id__in=request_ids).values_list(
        "request_id", "completion_tokens"))


def test_a_web_process_killed_mid_stream_bills_each_stream_what_its_client_received(
        served: Served) -> None:
    _, secret = inference_key(served.first)
    port = free_port()
    web = start_web(port, KVRUN_GATEWAY_LEASE_SECONDS=str(LEASE_SECONDS), **PATIENT)
    got: dict[str, int] = {}
    statuses: list[object] = []
    half_way = threading.Event()

    def note(tokens: int, last: bool) -> None:
        # Half-way through one stream, once each of the six has had a token: a stream the
        # engine started late would otherwise be cut with nothing to bill.
        if tokens >= LONG_ANSWER // 2 and len(got) == 6 and all(got.values()):
            half_way.set()

    try:
        # Its key and routes read, and its connections open, before the streams race for them.
        warm = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {secret}"},
                          json={"model": "chat", "prompt": "Once", "max_tokens": 1})
        assert warm.status_code == 200, warm.text
        clients = [threading.Thread(target=streamed_tokens, args=(
            f"http://127.0.0.1:{port}", secret), kwargs={
                "max_tokens": LONG_ANSWER, "got": got, "on_token": note, "statuses": statuses})
            for _ in range(6)]
        for client in clients:
            client.start()
        assert half_way.wait(120), (got, statuses)
        web.send_signal(signal.SIGKILL)
        for client in clients:
            client.join(60)
    finally:
        stop(web)
    billed = billed_after_the_lease(got)

    assert statuses == [200] * 6, statuses
    assert len(got) == 6 and all(0 < tokens < LONG_ANSWER for tokens in got.values()), got
    # At least all but the lag; at most the event the process died sending, which may hold
    # several tokens (vLLM merges them for a client that falls behind).
    lag = settings.KVRUN_GATEWAY_TRACE_LAG_TOKENS
    assert all(got[request] - lag <= billed[request] <= LONG_ANSWER for request in got), (
        got, billed)


def test_a_web_process_killed_the_instant_a_stream_ends_bills_all_of_it(
        served: Served) -> None:
    _, secret = inference_key(served.first)
    got: dict[str, int] = {}
    statuses: list[object] = []
    for _ in range(3):
        port = free_port()
        web = start_web(port, KVRUN_GATEWAY_LEASE_SECONDS=str(LEASE_SECONDS), **PATIENT)

        def kill_at_the_end(tokens: int, last: bool, web: subprocess.Popen = web) -> None:
            if last:
                web.send_signal(signal.SIGKILL)

        try:
            streamed_tokens(f"http://127.0.0.1:{port}", secret, max_tokens=300, got=got,
                            on_token=kill_at_the_end, statuses=statuses)
            web.wait(10)
        finally:
            stop(web)

    assert statuses == [200] * 3 and set(got.values()) == {300}, (statuses, got)
    assert billed_after_the_lease(got) == got
