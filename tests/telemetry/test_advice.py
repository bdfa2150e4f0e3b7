from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import Organization, Role
from endpoints.models import Endpoint, EndpointEvent, GPUType, ModelSpec, Replica, State
from endpoints.planning import largest_concurrency_on
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.services import do_create_endpoint, do_load_catalogs
from engine.metrics import EngineSnapshot
from telemetry.advice import do_advise_endpoint
from telemetry.models import Advice, AdviceKind
from telemetry.services import do_apply_advice, do_record_engine_samples

pytestmark = pytest.mark.django_db


def snapshot(*, usage: float = 0.2, preemptions: int = 0, requests: int = 0,
             prompts: dict | None = None, max_tokens: dict | None = None, queries: int = 0,
             hits: int = 0) -> EngineSnapshot:
    return EngineSnapshot(kv_cache_usage=usage, running=1, waiting=0, prefix_queries=queries,
                          prefix_hits=hits, external_queries=None, external_hits=None,
                          preemptions=preemptions, prompt_tokens=0, generation_tokens=0,
                          requests=requests, prompt_buckets=prompts or {},
                          max_tokens_buckets=max_tokens or {})


@pytest.fixture
def llama_on_h100(org: Organization) -> Endpoint:
    """Llama 3.1 8B on one H100 with 32k of context: where the advice has numbers to give."""
    do_load_catalogs()
    endpoint = do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name="chat",
        model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"),
        gpu_type=GPUType.objects.get(slug="h100-80gb"), gpu_count=1,
        policy=EndpointPolicy(context_length=32768, concurrency=8),
        scaling=EndpointScaling(min_replicas=1, max_replicas=2))
    Replica.objects.create(endpoint=endpoint, state=State.READY)
    return endpoint


def record(endpoint: Endpoint, samples: list[tuple[int, EngineSnapshot]]) -> None:
    """Samples `seconds ago` of the endpoint's replica."""
    replica = endpoint.replicas.get()
    now = timezone.now()
    do_record_engine_samples(samples=[(replica.id, endpoint.id, now - timedelta(seconds=ago),
                                       shot) for ago, shot in samples])


def test_a_sustained_full_cache_is_cache_bound_advice_with_what_each_change_gives(
        llama_on_h100: Endpoint) -> None:
    record(llama_on_h100, [(ago, snapshot(usage=0.95, preemptions=60 - ago // 10,
                                     queries=1000 * (600 - ago), hits=100 * (600 - ago)))
                      for ago in range(5, 300, 5)])

    [advice] = do_advise_endpoint(endpoint=llama_on_h100, now=timezone.now())

    assert advice.kind == AdviceKind.CACHE_BOUND
    assert advice.figures["kv_cache_high_share"] == 1.0 and advice.figures["preemptions"] > 0
    assert "at least 90 % full in 100% of the last 10 minutes' samples" in advice.message
    held = llama_on_h100.sizing["max_concurrency_at_context"]
    fp8 = largest_concurrency_on(model=llama_on_h100.model, context_length=32768,
                                 kv_cache_dtype="fp8", gpu_type=llama_on_h100.gpu_type, gpu_count=1)
    assert fp8 >= 2 * held
    assert f"fp8 KV cache: room for {fp8:,} requests of 32,768 tokens at once per replica " \
           f"instead of {held:,}" in advice.message
    assert f"another replica: {2 * held:,} at once in all, for $4.50/h more" in advice.message
    assert "a 64 GiB host tier: 524,288 more tokens" in advice.message  # hit rate 10 %
    assert advice.change == {"kv_cache_dtype": "fp8"}
    assert EndpointEvent.objects.filter(endpoint=llama_on_h100,
                                        message__startswith="advice: Cache-bound").count() == 1


def test_advice_opens_once_and_resolves_when_the_figures_recover(llama_on_h100: Endpoint) -> None:
    record(llama_on_h100, [(ago, snapshot(usage=0.97)) for ago in range(400, 600, 5)])
    first_pass = timezone.now() - timedelta(seconds=200)

    do_advise_endpoint(endpoint=llama_on_h100, now=first_pass)
    do_advise_endpoint(endpoint=llama_on_h100, now=first_pass)  # again: the same single advice
    assert Advice.objects.filter(resolved_at=None).count() == 1
    record(llama_on_h100, [(ago, snapshot(usage=0.3)) for ago in range(5, 300, 5)])
    assert do_advise_endpoint(endpoint=llama_on_h100, now=timezone.now()) == []

    assert Advice.objects.get().resolved_at is not None
    assert EndpointEvent.objects.filter(message__startswith="advice:").count() == 1


# 400 requests in the last day, 99 % of them with prompts of at most 1,000 tokens.
PROMPTS_BEFORE = {"500": 0.0, "1000": 0.0, "2000": 0.0, "+Inf": 0.0}
PROMPTS_AFTER = {"500": 300.0, "1000": 398.0, "2000": 400.0, "+Inf": 400.0}


def test_a_context_budget_far_above_the_requests_advises_a_smaller_one(
        llama_on_h100: Endpoint) -> None:
    # ... each asking at most 500 tokens of answer.
    answers_after = {"100": 200.0, "500": 400.0, "+Inf": 400.0}
    record(llama_on_h100, [(80_000, snapshot(prompts=PROMPTS_BEFORE, max_tokens={})),
                      (60, snapshot(requests=400, prompts=PROMPTS_AFTER,
                                    max_tokens=answers_after))])

    [advice] = do_advise_endpoint(endpoint=llama_on_h100, now=timezone.now())

    assert advice.kind == AdviceKind.CONTEXT_OVERSIZED
    # The 99th percentiles within their buckets: 500 + 500 × 96 / 98, 100 + 400 × 196 / 200.
    assert (advice.figures["prompt_tokens_p99"], advice.figures["max_tokens_p99"]) == (990, 492)
    assert advice.change == {"context_length": 2048}
    assert ("is 22 × what a request takes: the 99th percentile prompt (990 tokens) plus the "
            "99th percentile max_tokens (492), over 400 requests in 24 h") in advice.message


@pytest.mark.parametrize(("answers_after", "changes"), [
    # Short prompts, long answers: up to 2,000 tokens asked, p99 1,980; with the prompt's
    # 990, 4,096 holds them (a budget of twice the prompt, 2,048, would refuse most).
    ({"2000": 400.0, "+Inf": 400.0}, [{"context_length": 4096}]),
    ({"32768": 400.0, "+Inf": 400.0}, []),  # max_tokens not asked: what the context left
    (None, []),  # an engine that does not report max_tokens
])
def test_no_smaller_context_is_advised_that_would_refuse_the_answers_asked_for(
        llama_on_h100: Endpoint, answers_after: dict | None, changes: list) -> None:
    record(llama_on_h100, [(80_000, snapshot(prompts=PROMPTS_BEFORE, max_tokens={})),
                      (60, snapshot(requests=400, prompts=PROMPTS_AFTER,
                                    max_tokens=answers_after))])

    advice = do_advise_endpoint(endpoint=llama_on_h100, now=timezone.now())

    assert [item.change for item in advice] == changes


def test_applying_advice_changes_the_policy_and_needs_a_one_click_change(
        llama_on_h100: Endpoint, owner_api: APIClient, org: Organization) -> None:
    record(llama_on_h100, [(ago, snapshot(usage=0.95)) for ago in range(5, 300, 5)])
    [advice] = do_advise_endpoint(endpoint=llama_on_h100, now=timezone.now())
    url = f"/api/v1/organizations/{org.slug}/endpoints/chat/advice/"

    listed = owner_api.get(url)
    applied = owner_api.post(f"{url}{advice.id}/apply/", format="json")

    assert listed.status_code == 200 and listed.json()[0]["kind"] == "cache_bound"
    assert applied.status_code == 200, applied.content
    assert "Its one replica restarts" in applied.json()["rollout"]
    llama_on_h100.refresh_from_db()
    assert (llama_on_h100.kv_cache_dtype, llama_on_h100.policy_version) == ("fp8", 2)
    assert Advice.objects.get().resolved_at is not None
    assert owner_api.post(f"{url}{advice.id}/apply/", format="json").status_code == 400
    with pytest.raises(ValidationError):
        do_apply_advice(advice=Advice.objects.get(), actor_role=Role.OWNER)
