import pytest
from django.test import Client

from accounts.models import Organization, Role, User
from endpoints.models import Node
from endpoints.services import do_load_catalogs
from engine.devices import HostResources
from nodes.services import do_register_node
from tests.factories import UserFactory


@pytest.fixture
def owner_client(client: Client, owner: User) -> Client:
    client.force_login(owner)
    return client


@pytest.fixture
def member_client(org: Organization) -> Client:
    from accounts.models import Membership

    member = UserFactory(email="member@acme.test")
    Membership.objects.create(organization=org, user=member, role=Role.MEMBER)
    client = Client()
    client.force_login(member)
    return client


@pytest.fixture
def cpu_node(db: None) -> Node:
    """What `make run` has on a machine without a GPU: the catalog and one CPU node online."""
    do_load_catalogs()
    return do_register_node(name="cpu-1", resources=HostResources(
        devices=[], cpu_count=2, memory_bytes=24 * 2**30))
