"""The rows the benchmarks start from, made through kvrun's own services where there is one:
an organisation with its owner, keys, and endpoints whose replicas serve on given ports. Every
target seeds from here (and the tests' factories build ready endpoints with it), so that a
benchmark imports nothing from tests/. Import it once Django is set up."""

import time
from pathlib import Path

from django.utils import timezone

from accounts.models import APIKey, Organization, Role, Scope, User
from accounts.services import do_create_api_key, do_create_organization
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Replica, State
from endpoints.services import do_load_catalogs
from engine import tls
from fleet.certificates import do_sign_engine_certificate


def owner() -> User:
    """A user of its own for one run, with a confirmed address that is new each time."""
    return User.objects.create_user(email=f"bench-{time.time_ns()}@example.com",
                                    email_verified_at=timezone.now())


def organization(name: str, *, owned_by: User | None = None) -> Organization:
    return do_create_organization(user=owned_by or owner(), name=name)


def key(organization: Organization, *, scope: str = Scope.INFERENCE, name: str = "bench",
        **limits: object) -> tuple[APIKey, str]:
    """A key and its secret; `limits` may set requests_per_minute, tokens_per_minute,
    endpoint_names and expires_at."""
    return do_create_api_key(organization=organization, name=name, scope=scope,
                             actor_role=Role.OWNER, created_by=None, **limits)


def ready_endpoint(organization: Organization, name: str, ports: list[int],
                   state: str = State.READY, model: str = "kvrun-demo-tiny",
                   **policy: object) -> Endpoint:
    """An endpoint whose replicas are ready at 127.0.0.1 on `ports`, as the reconciler leaves
    one once its engines serve, on the catalog's `model` (the demo's by default); the engines
    are whatever the caller runs there. `policy` sets KV policy fields (cache_isolation,
    prefix_affinity, ...)."""
    do_load_catalogs()
    cpu = GPUType.objects.get(slug="cpu")
    node, _ = Node.objects.get_or_create(name="stub-node", defaults=dict(
        gpu_type=cpu, cpu_count=2, memory_bytes=2**30))
    endpoint = Endpoint.objects.create(
        organization=organization, name=name, model=ModelSpec.objects.get(slug=model),
        context_length=2048, concurrency=8, gpu_type=cpu, gpu_count=1, hourly_price_usd=0,
        state=state, **policy)
    for port in ports:  # each engine started with the model's parsers, as an agent starts it
        Replica.objects.create(endpoint=endpoint, node=node, state=state, port=port,
                               ready_at=timezone.now(),
                               tool_call_parser=endpoint.model.tool_call_parser,
                               reasoning_parser=endpoint.model.reasoning_parser)
    return endpoint


def certify(replica: Replica, folder: Path) -> tuple[Path, Path]:
    """A key for the replica's engine and its certificate, signed as its agent has one
    signed (the replica is at its loading step for that moment), written into `folder`:
    gateways then reach it over TLS, as they reach every engine an agent starts. Returns
    the key's and the certificate's paths."""
    was = replica.state
    Replica.objects.filter(id=replica.id).update(state=State.LOADING)
    key_pem, request_pem = tls.new_key_and_request()
    certificate = do_sign_engine_certificate(replica=Replica.objects.get(id=replica.id),
                                             request_pem=request_pem)
    Replica.objects.filter(id=replica.id).update(state=was)
    return tls.write_key_and_certificate(folder, key_pem=key_pem, certificate_pem=certificate)
