import functools
from datetime import datetime

import factory
from django.contrib.auth.hashers import make_password
from django.utils import timezone

from accounts.models import APIKey, Organization, Role, Scope, User
from accounts.services import do_create_api_key, do_create_organization
from endpoints.models import Endpoint, GPUType, ModelSpec, Node, Replica, State
from endpoints.services import do_load_catalogs

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


def organization_with_owner(name: str = "Acme", owner: User | None = None) -> Organization:
    return do_create_organization(user=owner or UserFactory(), name=name)


def api_key(organization: Organization, *, scope: str = Scope.MANAGE,
            expires_at: datetime | None = None, name: str = "test key") -> tuple[APIKey, str]:
    return do_create_api_key(organization=organization, name=name, scope=scope,
                             actor_role=Role.OWNER, created_by=None, expires_at=expires_at)


def inference_key(organization: Organization, **limits: object) -> tuple[APIKey, str]:
    """An inference key; `limits` may set requests_per_minute, tokens_per_minute,
    endpoint_names and expires_at."""
    return do_create_api_key(organization=organization, name="inference", scope=Scope.INFERENCE,
                             actor_role=Role.OWNER, created_by=None, **limits)


def ready_endpoint(organization: Organization, name: str, ports: list[int],
                   state: str = State.READY) -> Endpoint:
    """An endpoint whose replicas are ready at 127.0.0.1 on `ports`, as the reconciler leaves
    one once its engines serve; here the engines are test stand-ins."""
    do_load_catalogs()
    cpu = GPUType.objects.get(slug="cpu")
    node, _ = Node.objects.get_or_create(name="stub-node", defaults=dict(
        gpu_type=cpu, cpu_count=2, memory_bytes=2**30))
    endpoint = Endpoint.objects.create(
        organization=organization, name=name, model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        context_length=2048, concurrency=8, gpu_type=cpu, gpu_count=1, hourly_price_usd=0,
        state=state)
    for port in ports:
        Replica.objects.create(endpoint=endpoint, node=node, state=state, port=port,
                               ready_at=timezone.now())
    return endpoint
