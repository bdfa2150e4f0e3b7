"""The gateway's own logic, its ASGI app driven in this process, in front of scripted
stand-in engines (tests.stub_upstream). What needs a web process of its own (SIGTERM) is in
test_web_process.py; the same behaviour against a real vLLM engine is in tests/e2e."""

import asyncio
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from uuid import uuid4

import httpx
import orjson
import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from accounts.models import APIKey, Organization
from accounts.services import do_set_billing_hold
from billing import usage_stream
from billing.models import UsageRecord
from endpoints.models import Endpoint, State
from engine.processes import free_port
from gateway.errors import GatewayError
from gateway.idempotency import MAX_KEPT_BYTES, Claim, Idempotency
from gateway.limits import in_flight_name
from kvrun.digests import engine_api_key
from kvrun.redis import redis_client
from tests.factories import api_key, inference_key, ready_endpoint
from tests.gateway.helpers import InProcessGateway, received, stored, with_redis
from tests.helpers import wait_until
from tests.stub_upstream import LONG_EVENT_TEXT_BYTES

# e2e: the stand-in engines are processes of their own.
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_it_proxies_a_completion_and_records_its_usage(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str,
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
    replica = endpoint.replicas.get()
    assert sent["body"]["cache_salt"] == documented_cache_salt(org.id)
    assert sent["authorization"] == f"Bearer {engine_api_key(replica.id)}"

    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.request_id, record.organization_id, record.endpoint_id, record.replica_id) == (
        request_id, org.id, endpoint.id, replica.id)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (7, 4, 3)
    assert (record.status_code, record.operation, record.stream) == (200, "completions", False)
    assert not record.client_disconnected
    assert APIKey.objects.get(id=record.api_key_id).last_used_at == record.started_at


def test_the_engine_s_time_is_not_the_gateway_s_overhead(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "slow"})  # a second's work

    assert response.status_code == 200
    assert float(response.headers["x-kvrun-overhead-ms"]) < 100
    assert stored(1)
    record = UsageRecord.objects.get()
    assert record.duration_ms >= 1000 and record.gateway_overhead_ms < 100


def test_a_chat_completion_goes_to_the_engine_s_chat_path(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    response = gateway.post(secret, {"model": "chat", "messages": [
        {"role": "user", "content": "hello"}]}, path="/v1/chat/completions")

    assert response.status_code == 200
    assert [sent["path"] for sent in received(stubs[0])] == ["/v1/chat/completions"]
    assert stored(1)
    assert UsageRecord.objects.get().operation == "chat.completions"


def test_a_stream_shows_usage_only_as_the_client_asked(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
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


def documented_cache_salt(organization_id: object, key_id: object = None) -> str:
    """kvrun.digests' formula, worked out here apart from it: the first 32 hex digits of
    HMAC-SHA256(pepper, "cache-salt:<organisation id>"), with ":key:<key id>" after it where
    an endpoint keeps keys apart."""
    message = (f"cache-salt:{organization_id}" + (f":key:{key_id}" if key_id else "")).encode()
    return hmac.new(settings.KVRUN_KEY_PEPPER.encode(), message, hashlib.sha256).hexdigest()[:32]


def test_a_client_cannot_choose_its_cache_salt(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, other_org: Organization,
    secret: str, stub_ports: list[int], stubs: list[httpx.Client]
) -> None:
    ready_endpoint(other_org, "chat", stub_ports[:1])
    _, other_secret = inference_key(other_org)
    for key in (secret, secret, other_secret):
        response = gateway.post(key, {"model": "chat", "prompt": "hello", "cache_salt": "theirs"})
        assert response.status_code == 200

    ours, again, theirs = (sent["body"]["cache_salt"] for sent in received(stubs[0]))
    assert ours == again == documented_cache_salt(org.id)  # the same for every request
    assert theirs == documented_cache_salt(other_org.id) != ours
    # Keyed with the pepper: knowing an organisation's id is not enough to compute its salt.
    assert ours not in (hashlib.sha256(str(org.id).encode()).hexdigest()[:32],
                        str(org.id).replace("-", ""))


def test_it_refuses_missing_wrong_and_misused_keys(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, other_org: Organization,
    secret: str, stubs: list[httpx.Client]
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    restricted = inference_key(org, endpoint_names=["other"])[1]
    ready_endpoint(other_org, "theirs", [free_port()])
    outsider = inference_key(other_org)[1]

    missing = gateway.post(None, body)
    wrong = gateway.post("kvr_" + "x" * 43, body)
    manage = gateway.post(api_key(org)[1], body)
    not_allowed = gateway.post(restricted, body)
    foreign = gateway.post(outsider, body)
    other_way = gateway.post(secret, {"model": "theirs", "prompt": "hello"})

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
    gateway.stop()  # every report the gateway had is written
    assert not stored(1, timeout=0)


@override_settings(KVRUN_TRUSTED_PROXIES=1)
def test_an_address_that_keeps_sending_unknown_keys_is_refused_before_they_are_looked_up(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    flooder = {"X-Forwarded-For": "203.0.113.9"}
    assert gateway.post(secret, body, **flooder).status_code == 200  # a key known here
    _, unseen = inference_key(org)
    allowed = settings.KVRUN_GATEWAY_FAILED_AUTHENTICATIONS_PER_MINUTE
    flood = [gateway.post(f"kvr_{uuid4().hex}", body, **flooder) for _ in range(allowed + 2)]

    known_from_flooder = gateway.post(secret, body, **flooder)
    unseen_from_flooder = gateway.post(unseen, body, **flooder)
    unseen_elsewhere = gateway.post(unseen, body, **{"X-Forwarded-For": "198.51.100.7"})

    assert [r.status_code for r in flood] == [401] * allowed + [429, 429]
    assert "from your address; retry in" in flood[-1].json()["error"]["message"]
    assert 1 <= int(flood[-1].headers["retry-after"]) <= 60
    # Keys this gateway already holds go on (clients behind one NAT or proxy); the address
    # looks up no new key until its minute is over.
    assert known_from_flooder.status_code == 200
    assert unseen_from_flooder.status_code == 429
    assert unseen_elsewhere.status_code == 200


def test_messages_or_a_prompt_of_the_wrong_type_are_a_400(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    for body, param in (({"model": "chat", "messages": 1}, "messages"),
                        ({"model": "chat", "prompt": {"text": "hi"}}, "prompt")):
        response = gateway.post(secret, body, path="/v1/chat/completions")

        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


def test_a_request_is_admitted_when_its_body_has_arrived_not_when_it_began(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str
) -> None:
    admitted_at: list[float] = []

    async def watch_the_slot() -> bool:
        admitted_at.extend(score for _, score in await gateway.app.redis.zrange(
            in_flight_name(org.id), 0, -1, withscores=True))
        return bool(admitted_at)

    gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "slow"},
                           upload_seconds=1.0, leave_when=watch_the_slot))

    assert stored(1)
    began_ms = UsageRecord.objects.get().started_at.timestamp() * 1000
    assert admitted_at[0] - began_ms >= 1000


def test_it_refuses_bad_input_without_reaching_an_engine(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    auth = {"Authorization": f"Bearer {secret}"}
    cases = {
        "invalid_json": gateway.post(secret, b"{not json"),
        "no model": gateway.post(secret, {"prompt": "hello"}),
        "bad stream": gateway.post(secret, {"model": "chat", "prompt": "x", "stream": "yes"}),
        "bad stream_options": gateway.post(secret, {"model": "chat", "prompt": "x",
                                                    "stream_options": [1]}),
        "too large": gateway.post(secret, {"model": "chat",
                                           "prompt": "x" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE}),
        "wrong method": gateway.run(gateway.client.get("/v1/completions", headers=auth)),
        "engine metrics": gateway.run(gateway.client.get("/v1/metrics", headers=auth)),
    }

    statuses = {name: response.status_code for name, response in cases.items()}
    assert statuses == {"invalid_json": 400, "no model": 400, "bad stream": 400,
                        "bad stream_options": 400, "too large": 413, "wrong method": 405,
                        "engine metrics": 404}
    assert cases["invalid_json"].json()["error"]["code"] == "invalid_json"
    assert cases["no model"].json()["error"]["param"] == "model"
    assert cases["too large"].json()["error"]["message"] == (
        f"The request body is larger than the limit of {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} "
        "bytes; send a smaller body.")
    assert cases["wrong method"].headers["allow"] == "POST"
    assert "vllm" not in cases["engine metrics"].text.lower()
    assert received(stubs[0]) == []


def test_an_endpoint_that_is_not_ready_says_what_it_is_doing(
    gateway: InProcessGateway, org: Organization, secret: str
) -> None:
    loading = ready_endpoint(org, "warming", [free_port()], state=State.LOADING)
    loading.replicas.update(stage="loading weights", progress_percent=50)
    ready_endpoint(org, "resting", [], state=State.STOPPED)

    starting = gateway.post(secret, {"model": "warming", "prompt": "hello"})
    stopped = gateway.post(secret, {"model": "resting", "prompt": "hello"})

    assert starting.status_code == 503 and starting.headers["retry-after"] == "5"
    assert starting.json()["error"]["message"] == (
        "Endpoint 'warming' is loading (loading weights, 50%); retry in a few seconds.")
    assert stopped.status_code == 503
    assert stopped.json()["error"]["message"] == (
        "Endpoint 'resting' is stopped; start it (Start on its page in the dashboard, or POST "
        f"/api/v1/organizations/{org.slug}/endpoints/resting/start/) and retry.")
    assert gateway.get(secret, "/v1/models").json() == {"object": "list", "data": []}


def test_a_refused_connection_is_retried_on_another_replica(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    dead_port = free_port()
    endpoint = ready_endpoint(org, "sturdy", [dead_port, stub_ports[0]], prefix_affinity=False)
    live = endpoint.replicas.get(port=stub_ports[0])
    dead = endpoint.replicas.get(port=dead_port)

    statuses = [gateway.post(secret, {"model": "sturdy", "prompt": "hello"}).status_code
                for _ in range(4)]

    assert statuses == [200] * 4
    assert len(received(stubs[0])) == 4
    # Tried once, and then last for the next few seconds: no request paid for it again.
    assert gateway.upstreams(org.id)[str(dead.id)].served == 1
    assert stored(4)
    assert set(UsageRecord.objects.values_list("replica_id", flat=True)) == {live.id}


def test_no_replica_accepting_is_a_503_that_says_to_retry(
    gateway: InProcessGateway, org: Organization, secret: str
) -> None:
    ready_endpoint(org, "gone", [free_port(), free_port()])

    response = gateway.post(secret, {"model": "gone", "prompt": "hello"})

    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert stored(1)
    assert (UsageRecord.objects.get().status_code, UsageRecord.objects.get().replica_id) == (
        503, None)
    gateway.stop()
    assert nothing_held(gateway, org)


def test_requests_go_to_the_replica_with_the_fewest_in_flight(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "pair", stub_ports, prefix_affinity=False)

    async def quick_ones_beside_a_long_stream() -> list[int]:
        long = asyncio.ensure_future(gateway.send(secret, {"model": "pair", "prompt": "slow",
                                                           "stream": True}))
        routes = await gateway.app.directory.routes(org.id)
        while not any(upstream.in_flight for upstream in routes["pair"].upstreams):
            await asyncio.sleep(0.01)
        quick = [await gateway.send(secret, {"model": "pair", "prompt": "hello"})
                 for _ in range(3)]
        return [response.status_code for response in [*quick, await long]]

    assert gateway.run(quick_ones_beside_a_long_stream()) == [200] * 4
    # Round-robin would have sent a quick one to the replica busy with the stream.
    prompts = sorted([sent["body"]["prompt"] for sent in received(stub)] for stub in stubs)
    assert prompts == [["hello"] * 3, ["slow"]]


CHAT = "/v1/chat/completions"


def with_system_prompt(system: str, user: str) -> dict:
    return {"model": "pair", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": user}]}


def test_requests_that_share_a_prefix_go_to_one_replica_and_prefixes_spread(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "pair", stub_ports)
    handbook = "You answer questions about the staff handbook. " * 30  # ~1,400 characters

    for question in ("Holidays?", "Sick leave?", "Expenses?", "Parking?", "Pensions?"):
        assert gateway.post(secret, with_system_prompt(handbook, question), CHAT).status_code == 200
    by_replica = [len(received(stub)) for stub in stubs]
    assert sorted(by_replica) == [0, 5]

    for stub in stubs:
        stub.delete("/_requests")
    for tenant in range(16):
        prompt = with_system_prompt(f"Tenant {tenant}'s own assistant. " * 40, "Hello")
        assert gateway.post(secret, prompt, CHAT).status_code == 200
    # Sixteen prefixes on two replicas: all on one would happen once in 32,768 runs.
    assert all(received(stub) for stub in stubs)


def test_a_hot_prefix_spills_to_another_replica_past_its_load_bound(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "pair", stub_ports)
    shared = "One very popular system prompt. " * 40

    async def at_once() -> list[int]:
        # "slow": the stand-in engine takes a second, so all four are in flight together.
        sent = [gateway.send(secret, with_system_prompt(shared, "slow"), CHAT)
                for _ in range(4)]
        return [response.status_code for response in await asyncio.gather(*sent)]

    spills = {"organization": org.slug, "endpoint": "pair"}
    assert gateway.run(at_once()) == [200] * 4
    # Bounded at 1.25 × the average in flight: the second replica takes the third request.
    assert sorted(len(received(stub)) for stub in stubs) == [1, 3]
    assert REGISTRY.get_sample_value("kvrun_gateway_affinity_spills_total", spills) == 1


def test_an_endpoint_may_keep_each_key_s_cache_apart(
    gateway: InProcessGateway, org: Organization, secret: str, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "solo", stub_ports[:1], cache_isolation="key")
    first = APIKey.objects.get(organization=org)
    second, second_secret = inference_key(org)

    for key in (secret, second_secret):
        assert gateway.post(key, {"model": "solo", "prompt": "hello"}).status_code == 200

    salts = [sent["body"]["cache_salt"] for sent in received(stubs[0])]
    assert salts == [documented_cache_salt(org.id, key_id=first.id),
                     documented_cache_salt(org.id, key_id=second.id)]
    assert documented_cache_salt(org.id) not in salts


def test_a_stream_that_breaks_ends_with_an_error_frame_and_done(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "drop", "stream": True})

    frames = events(response)
    assert response.status_code == 200
    assert [orjson.loads(frame)["choices"][0]["text"] for frame in frames[:2]] == [" t0", " t1"]
    assert orjson.loads(frames[2])["error"]["code"] == "engine_error"
    assert frames[3:] == ["[DONE]"]
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.error_code, record.completion_tokens) == (
        502, "engine_error", 2)


@override_settings(KVRUN_GATEWAY_MAX_ANSWER_BYTES=256 * 1024)
def test_an_answer_over_the_limit_is_a_502_with_its_prompt_recorded(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
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
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
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
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
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
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "context"})

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "context_length_exceeded", "input_tokens")
    assert stored(1)
    assert UsageRecord.objects.get().error_code == "context_length_exceeded"


def test_a_key_has_a_request_limit_per_minute(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization
) -> None:
    _, secret = inference_key(org, requests_per_minute=2)

    responses = [gateway.post(secret, {"model": "chat", "prompt": "hello"}) for _ in range(3)]

    assert [r.status_code for r in responses] == [200, 200, 429]
    refused = responses[2]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "2 requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert responses[0].headers["x-ratelimit-remaining-requests"] == "1"
    gateway.stop()
    assert stored(2)
    assert UsageRecord.objects.count() == 2  # the refused one ran nowhere and is not billed


def test_limits_hold_across_two_gateways_under_concurrent_requests(
    gateway: InProcessGateway, gateway_loop: asyncio.AbstractEventLoop, endpoint: Endpoint,
    org: Organization, stubs: list[httpx.Client]
) -> None:
    _, secret = inference_key(org, requests_per_minute=10)
    second = InProcessGateway(gateway_loop)  # another web process: its own memory and Redis
    body = {"model": "chat", "prompt": "hello"}

    async def burst() -> list[httpx.Response]:
        return await asyncio.gather(*(app.send(secret, body) for app in (gateway, second)
                                      for _ in range(15)))
    try:
        statuses = [response.status_code for response in gateway.run(burst())]
    finally:
        second.stop()

    assert (statuses.count(200), statuses.count(429)) == (10, 20)
    assert len(received(stubs[0])) == 10


def test_a_key_has_a_token_limit_per_minute(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization
) -> None:
    _, secret = inference_key(org, tokens_per_minute=10)

    first = gateway.post(secret, {"model": "chat", "prompt": "hello"})  # 7 + 4 tokens
    assert first.status_code == 200
    # The tokens are counted once the sink has sent the request's release.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "x"}).status_code
                      == 429, 5)
    refused = gateway.post(secret, {"model": "chat", "prompt": "hello"})

    assert refused.json()["error"]["type"] == "tokens"
    assert "10 tokens per minute" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


def test_streams_that_are_still_running_count_against_the_token_limit(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, stubs: list[httpx.Client]
) -> None:
    _, secret = inference_key(org, tokens_per_minute=50)
    body = {"model": "chat", "prompt": "slow", "stream": True, "max_tokens": 20}
    running = [gateway.submit(gateway.send(secret, body)) for _ in range(2)]
    assert wait_until(lambda: len(received(stubs[0])) == 2, 5, interval=0.02)

    # Each reserved its prompt (one token) and its 20: 42 of the 50.
    refused = gateway.post(secret, body)

    assert refused.status_code == 429, refused.text
    assert "has room for 8 now, and this request may use 21" in refused.json()["error"]["message"]
    assert [call.result(10).status_code for call in running] == [200, 200]
    assert len(received(stubs[0])) == 2


@override_settings(KVRUN_GATEWAY_LEASE_SECONDS=0.6)  # renewed every 0.1 s
def test_a_running_request_s_trace_is_renewed_with_its_usage_and_cleared_at_its_end(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    gateway.post(secret, {"model": "chat", "prompt": "hello"})  # the sink now renews often
    running = gateway.submit(gateway.send(secret, {"model": "chat", "prompt": "slow",
                                                   "stream": True}))

    def stream_traces() -> list[dict]:
        traces = map(orjson.loads, redis_client().hvals(usage_stream.ADMITTED))
        return [trace for trace in traces if trace["stream"]]
    assert wait_until(lambda: any(trace["completion_tokens"] >= 3 for trace in stream_traces()),
                      5, interval=0.05)
    [trace] = stream_traces()
    response = running.result(10)

    assert (trace["status_code"], trace["error_code"]) == (502, "gateway_interrupted")
    assert trace["request_id"] == response.headers["x-request-id"]
    assert trace["prompt_tokens"] == 7  # the engine's figure, once it has sent one
    assert stored(2)
    assert redis_client().hlen(usage_stream.ADMITTED) == 0
    assert redis_client().zcard(usage_stream.ADMITTED_SEEN) == 0
    assert UsageRecord.objects.get(request_id=trace["request_id"]).status_code == 200


def test_an_organisation_has_a_limit_on_requests_in_flight(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, stubs: list[httpx.Client]
) -> None:
    Organization.objects.filter(id=org.id).update(max_concurrent_requests=1)
    _, secret = inference_key(org)
    slow = gateway.submit(gateway.send(secret, {"model": "chat", "prompt": "slow"}))
    assert wait_until(lambda: received(stubs[0]), 5, interval=0.02)  # admitted, at the engine

    refused = gateway.post(secret, {"model": "chat", "prompt": "hello"})
    assert slow.result(10).status_code == 200
    # The slot comes back once the sink has sent the slow request's release.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"})
                      .status_code == 200, 5)

    assert refused.status_code == 429
    assert "1 requests in flight" in refused.json()["error"]["message"]


def test_a_repeated_idempotency_key_does_not_run_again(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    body = {"model": "chat", "prompt": "hello"}
    first = gateway.post(secret, body, **{"Idempotency-Key": "order-1"})
    again = gateway.post(secret, body, **{"Idempotency-Key": "order-1"})
    failed = gateway.post(secret, {"model": "chat", "prompt": "context"},
                          **{"Idempotency-Key": "order-2"})
    retried = gateway.post(secret, {"model": "chat", "prompt": "context"},
                           **{"Idempotency-Key": "order-2"})

    assert (first.status_code, again.status_code) == (200, 200)
    assert again.content == first.content
    assert again.headers["x-kvrun-idempotent-replay"] == "true"
    assert (failed.status_code, retried.status_code) == (400, 400)  # a failure frees the key
    assert len(received(stubs[0])) == 3
    gateway.stop()
    assert stored(3)
    assert UsageRecord.objects.count() == 3
    assert UsageRecord.objects.filter(idempotency_key="order-1").count() == 1


def test_an_idempotency_key_in_use_or_streamed_is_a_conflict(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    key = {"Idempotency-Key": "job-7"}
    slow = gateway.submit(gateway.send(secret, {"model": "chat", "prompt": "slow"}, **key))
    assert wait_until(lambda: received(stubs[0]), 5, interval=0.02)  # running at the engine
    clash = gateway.post(secret, {"model": "chat", "prompt": "slow"}, **key)
    assert slow.result(10).status_code == 200
    streamed = gateway.post(secret, {"model": "chat", "prompt": "hello", "stream": True},
                            **{"Idempotency-Key": "job-8"})
    again = gateway.post(secret, {"model": "chat", "prompt": "hello", "stream": True},
                         **{"Idempotency-Key": "job-8"})
    too_long = gateway.post(secret, {"model": "chat", "prompt": "hello"},
                            **{"Idempotency-Key": "k" * 256})

    assert clash.status_code == 409
    assert clash.json()["error"]["code"] == "idempotency_key_reused"
    assert "still running" in clash.json()["error"]["message"]
    assert streamed.status_code == 200
    assert again.status_code == 409 and "was streamed" in again.json()["error"]["message"]
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "Idempotency-Key"


def test_an_idempotency_key_belongs_to_the_api_key_and_the_endpoint_it_was_sent_with(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str,
    stub_ports: list[int], stubs: list[httpx.Client]
) -> None:
    ready_endpoint(org, "second", stub_ports[1:])
    _, other_secret = inference_key(org, endpoint_names=["chat"])
    key = {"Idempotency-Key": "order-1"}
    first = gateway.post(secret, {"model": "chat", "prompt": "hello"}, **key)

    other_key = gateway.post(other_secret, {"model": "chat", "prompt": "hello"}, **key)
    other_endpoint = gateway.post(secret, {"model": "second", "prompt": "hello"}, **key)

    assert first.status_code == other_key.status_code == other_endpoint.status_code == 200
    assert "x-kvrun-idempotent-replay" not in other_key.headers
    assert "x-kvrun-idempotent-replay" not in other_endpoint.headers
    assert len(received(stubs[0])) == 2 and len(received(stubs[1])) == 1


def test_an_idempotency_key_sent_again_with_another_body_is_refused(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    key = {"Idempotency-Key": "order-1"}
    first = gateway.post(secret, {"model": "chat", "prompt": "hello"}, **key)

    changed = gateway.post(secret, {"model": "chat", "prompt": "goodbye"}, **key)

    assert (first.status_code, changed.status_code) == (200, 422)
    error = changed.json()["error"]
    assert error["code"] == "idempotency_key_reused" and "different body" in error["message"]
    assert first.headers["x-request-id"] in error["message"]
    assert len(received(stubs[0])) == 1


def test_a_request_refused_by_a_limit_or_left_by_its_client_frees_its_idempotency_key(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, stub_ports: list[int],
    stubs: list[httpx.Client]
) -> None:
    _, secret = inference_key(org, requests_per_minute=1)
    _, other = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200
    body = {"model": "chat", "prompt": "slow"}

    refused = [gateway.post(secret, body, **{"Idempotency-Key": "limited"}) for _ in range(2)]
    gateway.run(raw_client(gateway, other, body, leave_when=engine_received(stub_ports[0], 2),
                           headers={"idempotency-key": "left"}))
    retried = gateway.post(other, body, **{"Idempotency-Key": "left"})

    # Refused twice by the limit, never by the key: the first refusal freed it.
    assert [response.status_code for response in refused] == [429, 429]
    assert retried.status_code == 200 and "x-kvrun-idempotent-replay" not in retried.headers
    assert len(received(stubs[0])) == 3


def test_a_request_the_engine_failed_frees_its_idempotency_key_for_the_retry(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str, stubs: list[httpx.Client]
) -> None:
    body, key = {"model": "chat", "prompt": "crash"}, {"Idempotency-Key": "order-1"}

    failed = gateway.post(secret, body, **key)
    retried = gateway.post(secret, body, **key)

    assert (failed.status_code, retried.status_code) == (502, 502)
    assert retried.json()["error"]["code"] == "engine_error"  # ran again, not a 409
    assert len(received(stubs[0])) == 2


@override_settings(KVRUN_GATEWAY_LEASE_SECONDS=0.5)
def test_the_idempotency_key_of_a_request_whose_gateway_died_is_free_within_its_lease(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str
) -> None:
    key = APIKey.objects.get(organization=org)
    body = orjson.dumps({"model": "chat", "prompt": "hello"})
    # What a gateway killed in the middle of the request left behind.
    claim = Claim.of(api_key_id=key.id, endpoint_id=str(endpoint.id), key="order-1",
                     body=body, request_id="req_dead")
    redis_client().set(claim.name, claim.running(), px=500)

    clash = gateway.post(secret, body, **{"Idempotency-Key": "order-1"})

    assert clash.status_code == 409 and "req_dead" in clash.json()["error"]["message"]
    assert wait_until(lambda: gateway.post(secret, body, **{"Idempotency-Key": "order-1"})
                      .status_code == 200, 2, interval=0.1)


def test_a_request_whose_lease_lapsed_does_not_settle_the_retry_s_key() -> None:
    first = Claim.of(api_key_id="k", endpoint_id="e", key="order-1", body=b"{}",
                     request_id="req_first")
    retry = Claim.of(api_key_id="k", endpoint_id="e", key="order-1", body=b"{}",
                     request_id="req_retry")

    async def lapse_then_settle(redis: Redis) -> bytes | None:
        store = Idempotency(redis, ttl_seconds=60)
        assert await store.reserve(first) is None
        await redis.delete(first.name)  # its lease ran out while it ran
        assert await store.reserve(retry) is None
        await store.settle(first, succeeded=False, answer=None)
        return await redis.get(retry.name)

    assert asyncio.run(with_redis(lapse_then_settle)) == retry.running()


def test_an_answer_too_large_to_keep_is_not_replayed() -> None:
    claim = Claim.of(api_key_id="k", endpoint_id="e", key="order-1", body=b"{}",
                     request_id="req_large")

    async def settle_then_repeat(redis: Redis) -> str:
        store = Idempotency(redis, ttl_seconds=60)
        assert await store.reserve(claim) is None
        await store.settle(claim, succeeded=True, answer=b"x" * (MAX_KEPT_BYTES + 1))
        with pytest.raises(GatewayError) as repeat:
            await store.reserve(claim)
        return f"{repeat.value.status} {repeat.value.message}"

    assert asyncio.run(with_redis(settle_then_repeat)).startswith("409 A request with this "
                                                        "Idempotency-Key (req_large) answered "
                                                        "more than 64 KiB")


def test_a_key_revoked_through_kvrun_is_refused_at_once(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, owner_api: object
) -> None:
    key, secret = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200

    assert owner_api.delete(f"/api/v1/organizations/{org.slug}/api-keys/{key.id}/"
                            ).status_code == 204

    # Every gateway hears of the revocation; give the message a moment to arrive.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"}
                                           ).status_code == 401, 1.0, interval=0.05)


def test_a_key_revoked_behind_kvrun_s_back_is_refused_within_the_cache_ttl(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization
) -> None:
    key, secret = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200

    APIKey.objects.filter(id=key.id).update(revoked_at=timezone.now())  # no message sent
    revoked_at = time.monotonic()

    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"}
                                           ).status_code == 401,
                      settings.KVRUN_API_KEY_CACHE_SECONDS + 1, interval=0.2)
    assert time.monotonic() - revoked_at <= settings.KVRUN_API_KEY_CACHE_SECONDS + 0.5


def engine_received(port: int, count: int) -> Callable[[], Awaitable[bool]]:
    """Whether the stand-in engine on `port` has been sent `count` requests (for raw_client's
    leave_when)."""
    async def reached() -> bool:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as stub:
            return len((await stub.get("/_requests")).json()) >= count
    return reached


async def raw_client(gateway: InProcessGateway, secret: str, body: dict, *,
                     after_frames: int | None = None,
                     leave_when: Callable[[], Awaitable[bool]] | None = None,
                     reading_seconds: float = 0.0, upload_seconds: float = 0.0,
                     headers: dict[str, str] | None = None,
                     on_frame: Callable[[dict], Awaitable[None]] | None = None) -> list[bytes]:
    """Call the app as a client that takes `upload_seconds` to send its body, disconnects
    after `after_frames` body frames or once `leave_when()` is true, and takes
    `reading_seconds` to read each frame (a server's send blocks while its client does not
    read), calling `on_frame` with each message as it arrives; returns the body frames it
    got. httpx's transport can do none of it."""
    gone = asyncio.Event()
    frames: list[bytes] = []
    request = [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]

    async def receive() -> dict:
        if request:
            await asyncio.sleep(upload_seconds)
            return request.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set():
            return  # as a server does: nothing reaches a client that has left
        if on_frame is not None:
            await on_frame(message)
        if message["type"] == "http.response.body" and message.get("body"):
            await asyncio.sleep(reading_seconds)
            frames.append(message["body"])
            if after_frames is not None and len(frames) >= after_frames:
                gone.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"authorization", f"Bearer {secret}".encode()),
                         *((name.encode(), value.encode())
                           for name, value in (headers or {}).items())]}
    call = asyncio.ensure_future(gateway.app(scope, receive, send))
    if leave_when is not None:
        while not await leave_when():
            await asyncio.sleep(0.01)
        gone.set()
    await call
    return frames


def test_a_client_that_reads_slowly_is_not_the_gateway_s_overhead(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    frames = gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "hello",
                                                      "stream": True}, reading_seconds=0.3))

    assert len(frames) == 5  # four chunks, then [DONE]
    assert stored(1)
    record = UsageRecord.objects.get()
    assert record.duration_ms >= 1500
    # The gateway's own work on a request is about a millisecond.
    assert record.gateway_overhead_ms < 100


@override_settings(KVRUN_GATEWAY_TRACE_LAG_TOKENS=3)
def test_a_stream_s_trace_holds_what_its_client_has_received_before_it_has_it(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    seen = []  # at each event with a token: tokens received, tokens traced, whether the last

    async def watch(redis: Redis) -> list[bytes]:
        request_id = b""

        async def on_frame(message: dict) -> None:
            nonlocal request_id
            if message["type"] == "http.response.start":
                request_id = dict(message["headers"])[b"x-request-id"]
            elif b'"choices":[{' in message.get("body", b""):
                trace = await redis.hget(usage_stream.ADMITTED, request_id)
                seen.append((len(seen) + 1, orjson.loads(trace)["completion_tokens"],
                             b'"finish_reason":"length"' in message["body"]))
        return await raw_client(gateway, secret, {"model": "chat", "prompt": "steady",
                                                  "stream": True}, on_frame=on_frame)

    gateway.run(with_redis(watch))

    assert len(seen) == 200 and seen[-1] == (200, 200, True)
    assert all(received - 3 <= traced <= received for received, traced, _ in seen), seen
    # Written once two tokens behind (half the lag, without waiting), or at three: not with
    # each token.
    assert 40 <= len({traced for _, traced, _ in seen}) <= 110


@override_settings(KVRUN_GATEWAY_GATHER_SECONDS=5)  # the record is written 5 s later
def test_an_answer_is_in_its_trace_before_its_client_has_it(
    gateway: InProcessGateway, endpoint: Endpoint, secret: str
) -> None:
    response = gateway.post(secret, {"model": "chat", "prompt": "hello"})

    # What a crash now would bill: the whole answer, there before the answer left.
    trace = orjson.loads(redis_client().hget(usage_stream.ADMITTED,
                                             response.headers["x-request-id"]))
    assert (trace["prompt_tokens"], trace["completion_tokens"], trace["cached_tokens"]) == (
        7, 4, 3)
    assert redis_client().xlen(usage_stream.STREAM) == 0  # the record is on its way


def nothing_held(gateway: InProcessGateway, organization: Organization) -> bool:
    """No request of the organisation still counts as in flight, in Redis or in the
    gateway's own count per replica (call once the gateway has stopped)."""
    held = redis_client().zcard(in_flight_name(organization.id))
    return held == 0 and not any(gateway.upstreams_in_flight(organization.id).values())


def test_a_client_that_leaves_mid_stream_is_recorded_with_what_it_got(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str
) -> None:
    frames = gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "slow",
                                                       "stream": True}, after_frames=3))

    assert len(frames) == 3
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.client_disconnected) == (499, True)
    assert 3 <= record.completion_tokens < 20 and record.prompt_tokens == 7
    gateway.stop()
    assert nothing_held(gateway, org)


def test_a_client_that_leaves_before_any_usage_is_billed_for_its_prompt(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str,
    stub_ports: list[int], stubs: list[httpx.Client]
) -> None:
    frames = gateway.run(raw_client(gateway, secret, {"model": "chat", "prompt": "slow"},
                                     leave_when=engine_received(stub_ports[0], 1)))

    assert frames == []  # gone before the slow answer was ready
    assert stored(1)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.client_disconnected) == (499, True)
    # No usage came back, so the engine's tokenizer counted the prompt.
    assert (record.prompt_tokens, record.completion_tokens) == (1, 0)
    gateway.stop()
    assert nothing_held(gateway, org)


def test_models_lists_the_ready_endpoints_a_key_may_call(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization, secret: str
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
                          "created": int(endpoint.created_at.timestamp())}
    assert missing.status_code == 404
    assert posted.status_code == 405 and posted.headers["allow"] == "GET"


def test_an_organisation_held_by_its_budget_is_refused_with_the_budget_s_message(
    gateway: InProcessGateway, endpoint: Endpoint, org: Organization
) -> None:
    _, secret = inference_key(org)
    assert gateway.post(secret, {"model": "chat", "prompt": "hello"}).status_code == 200
    reason = (f"This organisation's monthly budget of $1.00 is reached; raise it under Usage "
              f"& billing (/orgs/{org.slug}/billing/).")

    do_set_billing_hold(organization_id=org.id, reason=reason)

    # Within the key cache's lifetime, as for any change to the key's organisation.
    assert wait_until(lambda: gateway.post(secret, {"model": "chat", "prompt": "hello"}
                                           ).status_code == 402,
                      settings.KVRUN_API_KEY_CACHE_SECONDS + 1, interval=0.2)
    refused = gateway.post(secret, {"model": "chat", "prompt": "hello"}).json()["error"]
    assert (refused["message"], refused["code"], refused["type"]) == (
        reason, "billing_hold", "insufficient_quota")
