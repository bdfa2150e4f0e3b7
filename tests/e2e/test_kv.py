"""KV policy end to end on real vLLM engines: prefix-affinity routing across two replicas,
and a policy change (prefix caching off) rolled over them while they serve.

Two engines serve the whole module, so its rows must outlive each test: the module commits
its own data and flushes once at the end. Its tests run in file order.
"""

import os
import re
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.core.management import call_command

from accounts.models import Organization, Role
from accounts.services import do_create_organization
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.services import (
    do_change_endpoint_policy,
    do_create_endpoint,
    do_delete_endpoint,
    do_load_catalogs,
)
from engine.metrics import totals
from fleet.certificates import engine_address
from gateway.affinity import Ring, prefix_key
from gateway.directory import Upstream
from kvrun.common.digests import cache_salt
from telemetry.models import EngineSample
from tests.factories import UserFactory, api_key, inference_key
from tests.helpers import (
    ANSWER_WITHIN,
    ENGINE_READY_WITHIN,
    WEB_METRICS_TOKEN,
    SuiteAgent,
    api_servers,
    drive,
    engine_client,
    records_for,
    story_of,
    wait_until,
)

pytestmark = [pytest.mark.e2e]

# Well past the 1,024 characters that pick a replica, and over two 128-token CPU blocks.
PREFIX_REPEATS = 40


@dataclass(frozen=True)
class Pair:
    web: str
    endpoint: Endpoint
    organization: Organization
    secret: str

    def complete(self, prompt: str, **options: object) -> httpx.Response:
        response = httpx.post(f"{self.web}/v1/completions", timeout=ANSWER_WITHIN,
                              headers={"Authorization": f"Bearer {self.secret}"},
                              json={"model": "pair", "prompt": prompt, "max_tokens": 1,
                                    **options})
        assert response.status_code == 200, response.text
        return response

    def hits_by_replica(self) -> dict:
        """Each ready replica's prefix-cache hits so far, from its engine's /metrics."""
        found = {}
        for replica in Replica.objects.filter(endpoint=self.endpoint, state=State.READY):
            with engine_client(replica) as engine:
                text = engine.get("/metrics").text
            found[replica.id] = totals(text)["vllm:prefix_cache_hits_total"]
        return found


@pytest.fixture(scope="module")
def pair(django_db_blocker: object, agent: SuiteAgent, web: str) -> Iterator[Pair]:
    with django_db_blocker.unblock():
        agent.enrolled()
        do_load_catalogs()
        assert wait_until(lambda: Node.objects.filter(name="e2e-a", state="online").exists(),
                          ANSWER_WITHIN)
        organization = do_create_organization(user=UserFactory(), name="Hooli")
        endpoint = do_create_endpoint(
            organization=organization, actor_role=Role.OWNER, created_by=None, name="pair",
            model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
            gpu_type=GPUType.objects.get(slug="cpu"),  # sized for the CPU node, late or not
            policy=EndpointPolicy(context_length=2048, concurrency=2),
            scaling=EndpointScaling(min_replicas=2, max_replicas=2))
        assert drive(lambda: Replica.objects.filter(endpoint=endpoint,
                                                    state=State.READY).count() == 2,
                     ENGINE_READY_WITHIN), (
            story_of(endpoint.id))
        yield Pair(web=web, endpoint=endpoint, organization=organization,
                   secret=inference_key(organization)[1])
        do_delete_endpoint(endpoint=endpoint, actor_role=Role.OWNER)
        assert drive(lambda: not api_servers("pair") and not Replica.objects.filter(
            endpoint=endpoint).exclude(state=State.STOPPED).exists(), 90)
        call_command("flush", interactive=False, verbosity=0)


def document() -> str:
    return f"{uuid.uuid4()} " + "A tenant's long shared document, read again. " * PREFIX_REPEATS


def test_a_tenant_s_repeated_prefix_lands_on_one_replica_and_hits(pair: Pair) -> None:
    shared = document()
    before = pair.hits_by_replica()

    ids = [pair.complete(f"{shared} Question {n}?").headers["x-request-id"] for n in range(5)]

    records = records_for(ids)
    assert len({record.replica_id for record in records}) == 1
    assert all(record.cached_tokens >= 128 for record in records
               if record.request_id != ids[0])
    after = pair.hits_by_replica()
    gained = {replica: after[replica] - before[replica] for replica in after}
    assert sorted(gained.values())[0] == 0 and sorted(gained.values())[1] >= 4 * 128


def test_the_agent_reads_each_engine_s_metrics_and_the_api_charts_their_rates(
        pair: Pair) -> None:
    _, manage = api_key(pair.organization)
    url = (f"{pair.web}/api/v1/organizations/{pair.organization.slug}/endpoints/pair/metrics/"
           "?window=15m")

    def charted() -> list[dict]:
        points = httpx.get(url, headers={"Authorization": f"Bearer {manage}"},
                           timeout=ANSWER_WITHIN).json()["points"]
        return [point for point in points if (point["prefix_hit_rate"] or 0) > 0]

    # Every ready engine is read (its first sample is the baseline of the rates)...
    assert wait_until(lambda: EngineSample.objects.filter(endpoint=pair.endpoint).values(
        "replica_id").distinct().count() == 2, ANSWER_WITHIN)
    # ...and requests that hit the cache show in a step, as hits over lookups in that step.
    shared = document()
    for n in range(3):
        pair.complete(f"{shared} Question {n}?")
    assert wait_until(charted, ANSWER_WITHIN, interval=1.0)
    point = charted()[0]
    assert 0 < point["prefix_hit_rate"] <= 1 and point["prompt_tokens_per_s"] > 0
    assert point["kv_cache_usage"] is not None and point["ttft_p50_s"] is not None
    scraped = set(EngineSample.objects.filter(endpoint=pair.endpoint)
                  .values_list("replica_id", flat=True))
    assert scraped == set(Replica.objects.filter(endpoint=pair.endpoint, state=State.READY)
                          .values_list("id", flat=True))


def in_flight(pair: Pair) -> dict[str, float]:
    """The shared web process's requests in flight to each replica of the pair, as its
    /metrics says."""
    text = httpx.get(f"{pair.web}/metrics", timeout=ANSWER_WITHIN,
                     headers={"Authorization": f"Bearer {WEB_METRICS_TOKEN}"}).text
    return {replica: float(value) for replica, value in re.findall(
        r'^kvrun_gateway_replica_requests_in_flight\{[^}]*endpoint="pair"[^}]*'
        r'replica="([^"]+)"\} (\S+)$', text, re.M)}


def test_a_saturated_replica_spills_to_the_other(pair: Pair) -> None:
    # The replica the prefix belongs to is held still (its engine stopped) while two of its
    # requests wait on it: that fills it (its concurrency is 2, and its load bound, 1.25
    # times the average in flight over two replicas counting the next request, is 2 too).
    # The third request with the prefix goes to the other replica, and is answered there.
    shared = document()
    prompt = f"{shared} Tell me more."
    replicas = list(Replica.objects.filter(endpoint=pair.endpoint, state=State.READY))
    ring = Ring.of([Upstream(replica_id=str(replica.id), address=engine_address(replica=replica))
                    for replica in replicas])
    owner = ring.owner(prefix_key({"prompt": prompt}, salt=cache_salt(pair.organization.id)))
    [held] = [replica for replica in replicas if str(replica.id) == owner.replica_id]
    [engine] = [pid for pid in api_servers("pair") if held.port == engine_port(pid)]
    os.kill(engine, signal.SIGSTOP)
    try:
        waiting = [threading.Thread(target=pair.complete, args=(prompt,)) for _ in range(2)]
        for thread in waiting:
            thread.start()
        assert wait_until(lambda: in_flight(pair).get(owner.replica_id) == 2, ANSWER_WITHIN,
                          interval=0.05)
        spilled = pair.complete(prompt).headers["x-request-id"]
    finally:
        os.kill(engine, signal.SIGCONT)
    for thread in waiting:
        thread.join(60)

    [record] = records_for([spilled])
    assert record.replica_id != held.id


def engine_port(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--port") + 1])


def test_prefix_caching_off_rolls_both_replicas_while_they_serve_and_then_never_hits(
        pair: Pair) -> None:
    old = set(Replica.objects.filter(endpoint=pair.endpoint, state=State.READY)
              .values_list("id", flat=True))
    rollout = do_change_endpoint_policy(endpoint=pair.endpoint, actor_role=Role.OWNER,
                                        changes={"prefix_caching": False})
    assert "restart one at a time" in rollout
    failures: list[str] = []
    sent = 0

    def rolled() -> bool:
        nonlocal sent
        response = httpx.post(f"{pair.web}/v1/completions", timeout=ANSWER_WITHIN,
                              headers={"Authorization": f"Bearer {pair.secret}"},
                              json={"model": "pair", "prompt": "Still there?", "max_tokens": 1})
        sent += 1
        if response.status_code != 200:
            failures.append(f"{response.status_code} {response.text[:200]}")
        ready = set(Replica.objects.filter(endpoint=pair.endpoint, state=State.READY)
                    .values_list("id", flat=True))
        return len(ready) == 2 and not ready & old

    # One replica at a time: two engine starts.
    assert drive(rolled, 2 * ENGINE_READY_WITHIN), "the replicas were not replaced"
    assert failures == [] and sent > 10
    assert set(Replica.objects.filter(endpoint=pair.endpoint, state=State.READY)
               .values_list("policy_version", flat=True)) == {2}

    shared = document()
    before = pair.hits_by_replica()
    ids = [pair.complete(f"{shared} Question {n}?").headers["x-request-id"] for n in range(3)]
    assert all(record.cached_tokens == 0 for record in records_for(ids))
    assert pair.hits_by_replica() == before
