import pytest
from django.test import Client

from accounts.models import Membership, Organization, Role, User
from tests.factories import UserFactory


@pytest.fixture
def owner_client(client: Client, owner: User) -> Client:
    client.force_login(owner)
    return client


@pytest.fixture
def member_client(org: Organization) -> Client:
    member = UserFactory(email="member@acme.test")
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    client = Client()
    client.force_login(member)
    return client
