from datetime import datetime

import factory

from accounts.models import APIKey, Organization, Role, Scope, User
from accounts.services import do_create_api_key, do_create_organization


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    email = factory.Sequence(lambda n: f"user{n}@example.com")
    name = factory.Faker("name")
    password = factory.PostGenerationMethodCall("set_password", "correct horse battery")

    @factory.post_generation
    def saved(obj: User, create: bool, extracted: object, **kwargs: object) -> None:
        if create:
            obj.save()


def organization_with_owner(name: str = "Acme", owner: User | None = None) -> Organization:
    return do_create_organization(user=owner or UserFactory(), name=name)


def api_key(organization: Organization, *, scope: str = Scope.MANAGE,
            expires_at: datetime | None = None, name: str = "test key") -> tuple[APIKey, str]:
    return do_create_api_key(organization=organization, name=name, scope=scope,
                             actor_role=Role.OWNER, created_by=None, expires_at=expires_at)


PASSWORD = "correct horse battery"
