"""The organisation's own nodes page: every member sees their health and engines; owners
make join tokens, shown once; nobody sees another organisation's nodes."""

import pytest
from django.test import Client

from accounts.models import Membership, Organization, Role
from endpoints.models import Node, Replica, State
from endpoints.services import do_load_catalogs
from engine.devices import Device, HostResources
from fleet.models import JoinToken
from fleet.reports import do_register_node
from tests.factories import UserFactory, demo_endpoint

pytestmark = pytest.mark.django_db


def own_node(org: Organization, name: str = "acme-gpu") -> Node:
    node = do_register_node(name=name, resources=HostResources(
        devices=[Device(index=i, name="NVIDIA H100 80GB HBM3", memory_bytes=81559 * 2**20)
                 for i in range(2)], cpu_count=32, memory_bytes=2**38, disk_bytes=2**41))
    Node.objects.filter(id=node.id).update(organization=org)
    return node


def test_a_member_sees_the_own_nodes_their_engines_and_free_gpus(
        member_client: Client, org: Organization, other_org: Organization) -> None:
    do_load_catalogs()
    node = own_node(org)
    own_node(other_org, "globex-gpu")
    Replica.objects.create(endpoint=demo_endpoint(org), node=node, state=State.READY,
                           device_indices=[1])

    page = member_client.get(f"/orgs/{org.slug}/nodes/")

    assert page.status_code == 200
    [shown] = page.context["nodes"]
    assert (shown.node.name, shown.free_devices, [r.endpoint.name for r in shown.engines]) == (
        "acme-gpu", 1, ["chat"])
    assert b"globex-gpu" not in page.content
    assert b"Owners enrol the organisation's nodes." in page.content
    assert member_client.get(f"/orgs/{other_org.slug}/nodes/").status_code == 404


def test_an_owner_makes_a_join_token_shown_once(owner_client: Client,
                                                org: Organization) -> None:
    made = owner_client.post(f"/orgs/{org.slug}/nodes/token/", {"node_name": "acme-gpu-2"})

    assert made.status_code == 200
    secret = made.context["created"]["secret"]
    assert f"KVRUN_JOIN_TOKEN={secret}".encode() in made.content
    assert b"--name acme-gpu-2" in made.content
    assert made["Cache-Control"].startswith("max-age=0")
    token = JoinToken.objects.get()
    assert (token.node_name, token.organization, token.region) == ("acme-gpu-2", org, None)
    assert secret not in owner_client.get(f"/orgs/{org.slug}/nodes/").content.decode()


@pytest.mark.parametrize(("form", "field", "message"), [
    ({"node_name": "-bad"}, "node_name", "Use up to 100 letters, digits"),
    ({"node_name": "shared-1"}, "node_name", "A node named shared-1 exists and is not Acme's"),
    ({"node_name": "ok", "zone": "z1"}, "zone", "A zone is within a region"),
])
def test_a_bad_join_token_form_is_refused_and_makes_nothing(
        owner_client: Client, org: Organization, form: dict, field: str, message: str) -> None:
    do_register_node(name="shared-1", resources=HostResources(devices=[], cpu_count=4,
                                                               memory_bytes=2**34))

    refused = owner_client.post(f"/orgs/{org.slug}/nodes/token/", form)

    assert refused.status_code == 400
    assert message in refused.context["form"].errors[field][0]
    assert not JoinToken.objects.exists()


def test_only_an_owner_makes_a_join_token(org: Organization) -> None:
    admin = UserFactory(email="admin@acme.test")
    Membership.objects.create(organization=org, user=admin, role=Role.ADMIN)
    client = Client()
    client.force_login(admin)

    refused = client.post(f"/orgs/{org.slug}/nodes/token/", {"node_name": "acme-gpu"},
                          follow=True)

    assert refused.redirect_chain == [(f"/orgs/{org.slug}/nodes/", 302)]
    assert b"Only owners can enrol the organisation" in refused.content
    assert not JoinToken.objects.exists()
