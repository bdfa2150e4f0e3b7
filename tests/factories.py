import functools
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from uuid import uuid4

import factory
import time_machine
from django.contrib.auth.hashers import make_password
from django.utils import timezone

from accounts.models import APIKey, Organization, Scope, User
from accounts.services import do_create_organization
from bench import seed
from bench.seed import ready_endpoint  # the shape the tests share with bench/
from billing.usage_stream import UsageReport
from endpoints.lifecycle import do_transition_replica
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Region, Replica, State
from engine.devices import Device, HostResources
from fleet.enrolment import do_create_join_token, do_enrol_node

PASSWORD = "correct horse battery"


@functools.cache
def password_hash() -> str:
    """PASSWORD's argon2 hash, made once: each hash takes about 0.16 s, and almost every test
    creates users who only need to be able to sign in."""
    return make_password(PASSWORD)


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User

    email = factory.Sequence(lambda n: f"user{n}@example.com")
    name = factory.Faker("name")
    password = factory.LazyFunction(password_hash)
    email_verified_at = factory.LazyFunction(timezone.now)


def organization_with_owner(name: str = "Acme", owner: User | None = None) -> Organization:
    return do_create_organization(user=owner or UserFactory(), name=name)


def api_key(organization: Organization, *, scope: str = Scope.MANAGE,
            expires_at: datetime | None = None, name: str = "test key") -> tuple[APIKey, str]:
    return seed.key(organization, scope=scope, name=name, expires_at=expires_at)


def inference_key(organization: Organization, **limits: object) -> tuple[APIKey, str]:
    """An inference key; `limits` may set requests_per_minute, tokens_per_minute,
    endpoint_names and expires_at."""
    return seed.key(organization, name="inference", **limits)


def endpoint_at_zero(organization: Organization, name: str, *, start_seconds: float,
                     **fields: object) -> Endpoint:
    """An endpoint scaled to zero whose model started once, an hour ago, in `start_seconds`
    on this kind of node: the history a wake's ETA is drawn from."""
    endpoint = ready_endpoint(organization, name, [], state=State.IDLE, min_replicas=0,
                              desired_replicas=0, **fields)
    started = timezone.now() - timedelta(hours=1)
    Replica.objects.create(endpoint=endpoint, state=State.STOPPED, created_at=started,
                           ready_at=started + timedelta(seconds=start_seconds),
                           stopped_at=timezone.now(), node=Node.objects.get(name="stub-node"))
    return endpoint


def demo_endpoint(org: Organization, *, name: str = "chat",
                  model: str = "kvrun-demo-tiny") -> Endpoint:
    """An endpoint of the demo model (or another built-in one) on the CPU, as created,
    without the reconciler pass a create asks for: these tests move its replicas themselves,
    and a control worker running for other tests of the session must not move them too."""
    return Endpoint.objects.create(
        organization=org, name=name, model=ModelSpec.objects.get(slug=model),
        context_length=2048, concurrency=4, gpu_type=GPUType.objects.get(slug="cpu"),
        gpu_count=1, hourly_price_usd=GPUType.objects.get(slug="cpu").hourly_price_usd)


WAY_UP = [State.PENDING, State.SCHEDULING, State.STARTING, State.LOADING, State.READY]


def moves_to(from_state: str, to_state: str) -> list[str]:
    """The states a replica passes through from `from_state` to `to_state`: on the way up, the
    ones a test's history leaves out (at the same instant, which bills nothing more: scheduling
    and starting are one billed phase, pending none); any other move as it is."""
    if from_state in WAY_UP and to_state in WAY_UP[WAY_UP.index(from_state) + 1:]:
        return WAY_UP[WAY_UP.index(from_state) + 1:WAY_UP.index(to_state) + 1]
    return [to_state]


def replica_history(endpoint: Endpoint, moves: list[tuple[datetime, str]]) -> Replica:
    """A replica of `endpoint` taken through `moves` (when, to which state) by the lifecycle's
    own transitions, so that its events and GPU-time ledger are the ones they write."""
    replica = Replica.objects.create(endpoint=endpoint, state=State.PENDING,
                                     created_at=moves[0][0])
    state = State.PENDING
    for at, to_state in moves:
        with time_machine.travel(at, tick=False):
            for step in moves_to(state, to_state):
                assert do_transition_replica(replica_id=replica.id, from_states=[state],
                                             to_state=step)
                state = step
    return replica


USAGE_STARTED = datetime(2026, 12, 2, 12, 0, 0, 123000, tzinfo=UTC)


def usage_report(endpoint: Endpoint, key: APIKey, **fields: object) -> UsageReport:
    """A finished request's report, as a gateway sends it, with `fields` changed."""
    return UsageReport(**{
        "request_id": f"req_{uuid4().hex}", "idempotency_key": "",
        "organization_id": str(endpoint.organization_id), "endpoint_id": str(endpoint.id),
        "replica_id": str(endpoint.replicas.get().id), "api_key_id": str(key.id),
        "operation": "completions", "stream": False, "prompt_tokens": 7, "completion_tokens": 4,
        "cached_tokens": 0, "status_code": 200, "error_code": "", "client_disconnected": False,
        "started_at": USAGE_STARTED,
        "time_to_first_token_ms": None, "duration_ms": 12,
        "gateway_overhead_ms": Decimal("0.412"), **fields})


H100 = "NVIDIA H100 80GB HBM3"


def gpu_host(count: int, device: str = H100) -> HostResources:
    """What a host with `count` GPUs of `device` reports."""
    return HostResources(devices=[Device(index=i, name=device, memory_bytes=81559 * 2**20)
                                  for i in range(count)], cpu_count=64, memory_bytes=2**40)


def enrolled_node(name: str, *, owner: Organization | None = None, count: int = 8,
                  device: str = H100, region: Region | None = None) -> Node:
    """A node enrolled by a join token of `owner` (None: the operator's, a shared node)."""
    _, secret = do_create_join_token(node_name=name, organization=owner, region=region)
    enrolled, _ = do_enrol_node(join_token=secret, name=name, resources=gpu_host(count, device),
                                address="127.0.0.1", model_cache_bytes=0)
    return enrolled
