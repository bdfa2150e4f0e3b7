"""Embedding and reranking endpoints end to end: the official `openai` client, plain HTTP
and the playground in a real Chromium → web process → real vLLM engines on the pooling
runner, provisioned by the node agent (the demo model converted to embed, and the demo's
body under a classifier's head of one label), with usage ingested by the real worker and
metered exactly as each engine counted.

The module's engines serve all its tests, so it commits its own data and flushes once at
the end, as tests/e2e/test_gateway.py does.
"""

import base64
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from django.core.management import call_command
from playwright.sync_api import Page, expect

from accounts.models import Organization, Role, User
from accounts.services import do_create_organization
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy
from endpoints.services import do_create_endpoint, do_delete_endpoint, do_load_catalogs
from engine.metrics import engine_token_totals
from tests.factories import PASSWORD, UserFactory, inference_key
from tests.helpers import SuiteAgent, api_servers, drive, engine_client, records_for, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


@dataclass(frozen=True)
class Pooled:
    web: str
    owner: User
    organization: Organization
    embedder: Endpoint
    reranker: Endpoint

    def prompt_tokens(self, endpoint: Endpoint) -> float:
        """The prompt tokens `endpoint`'s engine has read since it started."""
        replica = Replica.objects.get(endpoint=endpoint, state=State.READY)
        with engine_client(replica) as engine:
            return engine_token_totals(engine.get("/metrics").text)["prompt"]


@pytest.fixture(scope="module")
def pooled(django_db_blocker: object, agent: SuiteAgent, web: str) -> Iterator[Pooled]:
    with django_db_blocker.unblock():
        agent.enrolled()
        do_load_catalogs()
        assert wait_until(lambda: Node.objects.filter(name="e2e-a", state="online",
                                                      gpu_type__slug="cpu").exists(), 60)
        owner = UserFactory()
        organization = do_create_organization(user=owner, name="Hooli")
        endpoints = [do_create_endpoint(
            organization=organization, actor_role=Role.OWNER, created_by=None, name=name,
            model=ModelSpec.objects.get(slug=slug), gpu_type=GPUType.objects.get(slug="cpu"),
            policy=EndpointPolicy(context_length=512, concurrency=8))
            for name, slug in (("embed", "kvrun-demo-embed"), ("rerank", "kvrun-demo-rerank"))]
        assert drive(lambda: all(Endpoint.objects.get(id=endpoint.id).state == State.READY
                                 for endpoint in endpoints), 240)
        yield Pooled(web=web, owner=owner, organization=organization, embedder=endpoints[0],
                     reranker=endpoints[1])
        for endpoint in endpoints:
            do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
        assert drive(lambda: not api_servers("embed") and not api_servers("rerank")
                     and not Replica.objects.filter(endpoint__in=endpoints).exclude(
                         state=State.STOPPED).exists(), 60)
        call_command("flush", interactive=False, verbosity=0)


def test_the_openai_client_s_embeddings_are_metered_as_the_engine_counted(
        pooled: Pooled) -> None:
    client = openai.OpenAI(base_url=f"{pooled.web}/v1", api_key=inference_key(
        pooled.organization)[1], max_retries=0)
    before = pooled.prompt_tokens(pooled.embedder)

    floats = client.embeddings.with_raw_response.create(
        model="embed", input=["The KV cache holds keys.", "Decode reads the cache."],
        encoding_format="float")
    # The client asks for base64 unless told, and decodes it.
    decoded = client.embeddings.with_raw_response.create(model="embed",
                                                         input="The KV cache holds keys.")
    raw = httpx.post(f"{pooled.web}/v1/embeddings", headers={
        "Authorization": f"Bearer {inference_key(pooled.organization)[1]}"}, json={
        "model": "embed", "input": "The KV cache holds keys.", "encoding_format": "base64"})
    after = pooled.prompt_tokens(pooled.embedder)

    vectors = [item.embedding for item in floats.parse().data]
    assert len(vectors) == 2 and len(vectors[0]) == 128  # the demo's hidden size
    assert math.isclose(math.fsum(v * v for v in vectors[0]), 1.0, rel_tol=1e-3)  # normalised
    assert decoded.parse().data[0].embedding == pytest.approx(vectors[0], abs=1e-2)
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(
        vectors[0], abs=1e-2)
    records = records_for([floats.headers["x-request-id"], decoded.headers["x-request-id"],
                           raw.headers["x-request-id"]])
    assert {(r.operation, r.status_code, r.completion_tokens) for r in records} == {
        ("embeddings", 200, 0)}
    # Each request's usage is the engine's own count.
    assert [r.prompt_tokens for r in sorted(records, key=lambda r: r.started_at)] == [
        floats.parse().usage.prompt_tokens, decoded.parse().usage.prompt_tokens,
        raw.json()["usage"]["prompt_tokens"]]
    assert sum(r.prompt_tokens for r in records) == after - before


def test_a_reranker_orders_documents_with_scores_metered_as_the_engine_counted(
        pooled: Pooled) -> None:
    headers = {"Authorization": f"Bearer {inference_key(pooled.organization)[1]}"}
    documents = ["The KV cache holds keys.", "Decode reads the cache.", "Tokens per hour."]
    before = pooled.prompt_tokens(pooled.reranker)

    ranked = httpx.post(f"{pooled.web}/v1/rerank", headers=headers, json={
        "model": "rerank", "query": "What holds keys?", "documents": documents, "top_n": 2})
    scored = httpx.post(f"{pooled.web}/v1/score", headers=headers, json={
        "model": "rerank", "text_1": "What holds keys?", "text_2": documents})
    embedded = httpx.post(f"{pooled.web}/v1/embeddings", headers=headers, json={
        "model": "rerank", "input": "hello"})
    after = pooled.prompt_tokens(pooled.reranker)

    assert ranked.status_code == scored.status_code == 200
    results = ranked.json()["results"]
    scores = [item["score"] for item in scored.json()["data"]]
    # The two best, best first, with the scores the score API gives the same pairs.
    assert len(results) == 2
    assert [r["relevance_score"] for r in results] == sorted(scores, reverse=True)[:2]
    assert [r["document"]["text"] for r in results] == [
        documents[scores.index(r["relevance_score"])] for r in results]
    assert embedded.status_code == 400
    assert embedded.json()["error"]["code"] == "unsupported_operation"
    records = records_for([ranked.headers["x-request-id"], scored.headers["x-request-id"]])
    assert sorted((r.operation, r.prompt_tokens) for r in records) == sorted([
        ("rerank", ranked.json()["usage"]["prompt_tokens"]),
        ("score", scored.json()["usage"]["prompt_tokens"])])
    assert sum(r.prompt_tokens for r in records) == after - before


def test_the_playground_compares_two_texts_and_ranks_documents(
        pooled: Pooled, page: Page, shot: Callable[[str], None]) -> None:
    page.goto(f"{pooled.web}/login/")
    page.get_by_label("Email").fill(pooled.owner.email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    slug = pooled.organization.slug

    page.goto(f"{pooled.web}/orgs/{slug}/endpoints/embed/playground/")
    page.get_by_label("First text").fill("The KV cache holds keys.")
    page.get_by_label("Second text").fill("The KV cache holds keys.")
    page.get_by_role("button", name="Embed and compare").click()
    facts = page.get_by_test_id("embedding-facts")
    expect(facts).to_contain_text("Dimensions128")
    expect(facts).to_contain_text("Cosine similarity1.0000")  # a text and itself
    shot("playground-embeddings")

    page.goto(f"{pooled.web}/orgs/{slug}/endpoints/rerank/playground/")
    page.get_by_label("Query").fill("What holds keys?")
    page.get_by_label("Documents, one a line").fill(
        "The KV cache holds keys.\nDecode reads the cache.\nTokens per hour.")
    page.get_by_role("button", name="Rank").click()
    rows = page.get_by_test_id("ranking").locator("tbody tr")
    expect(rows).to_have_count(3)
    scores = [float(rows.nth(n).locator("td").nth(1).inner_text()) for n in range(3)]
    assert scores == sorted(scores, reverse=True)  # best first
    shot("playground-rerank")
