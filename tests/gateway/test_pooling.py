"""Embeddings, scores and reranking through the gateway (engine.tasks says which endpoint
serves what), against a stand-in engine answering in vLLM's shapes: the same keys, limits
and cache salt as chat, metered as prompt tokens, refused clearly where an endpoint's model
was not made for the call."""

import httpx
import openai
import pytest

from accounts.models import Organization
from bench.seed import ready_endpoint
from billing.models import UsageRecord
from endpoints.models import Endpoint
from tests.gateway.helpers import InProcessGateway, received, stored
from tests.stub_upstream import EMBEDDING


@pytest.fixture
def embedder(org: Organization, stub_ports: list[int]) -> Endpoint:
    return ready_endpoint(org, "embed", stub_ports[:1], model="kvrun-demo-embed")


@pytest.fixture
def reranker(org: Organization, stub_ports: list[int]) -> Endpoint:
    return ready_endpoint(org, "rerank", stub_ports[1:2], model="kvrun-demo-rerank")


def test_embeddings_reach_the_openai_client_metered_as_the_engine_counted(
        gateway: InProcessGateway, embedder: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=secret,
                                http_client=gateway.client)

    one = gateway.run(client.embeddings.create(model="embed", input="the cache holds keys"))
    many = gateway.run(client.embeddings.create(model="embed", input=["a b", "c d e"],
                                                encoding_format="float"))

    assert one.data[0].embedding == EMBEDDING and one.usage.prompt_tokens == 4
    assert [item.embedding for item in many.data] == [EMBEDDING, EMBEDDING]
    # The engine got the tenant's cache salt, as a chat's engine does.
    sent = received(stubs[0])
    assert [request["path"] for request in sent] == ["/v1/embeddings"] * 2
    assert all(request["body"]["cache_salt"] for request in sent)
    assert stored(2)
    assert sorted((r.operation, r.prompt_tokens, r.completion_tokens, r.status_code)
                  for r in UsageRecord.objects.all()) == [("embeddings", 4, 0, 200),
                                                          ("embeddings", 5, 0, 200)]


def test_a_reranker_ranks_and_scores_metered_as_the_engine_counted(
        gateway: InProcessGateway, reranker: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    ranked = gateway.post(secret, {"model": "rerank", "query": "which cache",
                                   "documents": ["the KV cache", "a queue"]}, path="/v1/rerank")
    scored = gateway.post(secret, {"model": "rerank", "text_1": "which cache",
                                   "text_2": ["the KV cache"]}, path="/v1/score")

    assert ranked.status_code == scored.status_code == 200
    assert [(result["index"], result["relevance_score"])
            for result in ranked.json()["results"]] == [(0, 1.0), (1, 0.5)]
    assert scored.json()["data"][0]["score"] == 1.0
    assert stored(2)
    assert sorted((r.operation, r.prompt_tokens) for r in UsageRecord.objects.all()) == [
        ("rerank", 2 * 2 + 3 + 2), ("score", 2 + 3)]


def test_an_embedding_model_s_rerank_is_metered_whole_though_it_reads_both_sides_apart(
        gateway: InProcessGateway, embedder: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    # It embeds the query and the document apart: two inputs of up to its context each.
    Endpoint.objects.filter(id=embedder.id).update(context_length=4)

    ranked = gateway.post(secret, {"model": "embed", "query": "a b c d",
                                   "documents": ["e f g h"]}, path="/v1/rerank")

    assert ranked.json()["usage"]["prompt_tokens"] == 8
    assert stored(1)
    assert UsageRecord.objects.get().prompt_tokens == 8


def test_calls_an_endpoint_s_model_was_not_made_for_are_refused_saying_what_it_serves(
        gateway: InProcessGateway, stub_endpoint: Endpoint, embedder: Endpoint,
        reranker: Endpoint, secret: str, stubs: list[httpx.Client]) -> None:
    embedded_chat = gateway.post(secret, {"model": "chat", "input": "hello"},
                                 path="/v1/embeddings")
    chat_with_embedder = gateway.post(secret, {"model": "embed", "messages": [
        {"role": "user", "content": "hello"}]}, path="/v1/chat/completions")
    embedded_reranker = gateway.post(secret, {"model": "rerank", "input": "hello"},
                                     path="/v1/embeddings")
    # An embedding model ranks by its embeddings' similarity: vLLM serves that.
    ranked_by_embedder = gateway.post(secret, {"model": "embed", "query": "a",
                                               "documents": ["b"]}, path="/v1/rerank")

    assert embedded_chat.status_code == chat_with_embedder.status_code == 400
    assert embedded_reranker.status_code == 400
    assert embedded_chat.json()["error"] == {
        "message": "The endpoint chat serves chat and completions (/v1/chat/completions, "
                   "/v1/completions and /v1/messages), not embeddings: send this request to "
                   "an endpoint whose model is made for it (GET /v1/models lists what each "
                   "serves).",
        "type": "invalid_request_error", "param": "model", "code": "unsupported_operation"}
    assert "serves embeddings (/v1/embeddings" in chat_with_embedder.json()["error"]["message"]
    assert "serves scores (/v1/score and /v1/rerank)" in (
        embedded_reranker.json()["error"]["message"])
    assert ranked_by_embedder.status_code == 200
    listed = {entry["id"]: entry["task"] for entry in gateway.get(secret, "/v1/models").json()[
        "data"]}
    assert listed == {"chat": "generate", "embed": "embed", "rerank": "score"}
    # Only the rerank the embedding model serves reached an engine, and only it is metered.
    assert [request["path"] for stub in stubs for request in received(stub)] == ["/v1/rerank"]
    assert stored(1)
    assert list(UsageRecord.objects.values_list("operation", "status_code")) == [
        ("rerank", 200)]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"model": "embed"}, "input", "A request to embeddings needs 'input'."),
    ({"model": "embed", "input": []}, "input", "A request to embeddings needs 'input'."),
    ({"model": "embed", "input": "a", "encoding_format": "bytes"}, "encoding_format",
     "'encoding_format' must be \"float\" or \"base64\"."),
])
def test_an_embedding_without_its_inputs_is_refused_and_changes_nothing(
        gateway: InProcessGateway, embedder: Endpoint, secret: str,
        stubs: list[httpx.Client], body: dict, param: str, message: str) -> None:
    refused = gateway.post(secret, body, path="/v1/embeddings")

    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == param
    assert refused.json()["error"]["message"] == message
    assert received(stubs[0]) == []
    assert not stored(1, timeout=0.5)


def test_a_rerank_without_documents_and_an_over_long_input_are_refused_as_the_engine_says(
        gateway: InProcessGateway, reranker: Endpoint, secret: str,
        stubs: list[httpx.Client]) -> None:
    missing = gateway.post(secret, {"model": "rerank", "query": "a"}, path="/v1/rerank")
    too_long = gateway.post(secret, {"model": "rerank", "query": "a",
                                     "documents": ["context"]}, path="/v1/rerank")

    assert missing.status_code == too_long.status_code == 400
    assert missing.json()["error"]["message"] == (
        "A request to rerank needs 'query' and 'documents'.")
    assert "maximum context length" in too_long.json()["error"]["message"]
    assert stored(1)
    assert list(UsageRecord.objects.values_list("operation", "status_code", "prompt_tokens")
                ) == [("rerank", 400, 0)]
