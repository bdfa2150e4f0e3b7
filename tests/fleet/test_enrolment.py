"""Enrolment: an operator's join token, exchanged once for a node's own credential; rotating
and revoking that credential."""

import re
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone
from pytest_django import DjangoCaptureOnCommitCallbacks
from rest_framework.test import APIClient

from accounts.models import Organization
from endpoints.models import Node, NodeState, Region, State
from endpoints.reconciler import reconcile_endpoint
from endpoints.selectors import endpoints_for_gateway
from engine.devices import Device, HostResources
from fleet.enrolment import do_create_join_token, do_revoke_node
from fleet.models import JoinToken, NodeCredential
from fleet.reports import NodeRevoked, do_record_node_heartbeat, do_register_node
from tests.factories import UserFactory
from tests.fleet.helpers import as_node, host, placed_replica

pytestmark = pytest.mark.django_db

def enrol(token: str, name: str = "gpu-1", **report: object) -> tuple[int, dict]:
    response = APIClient().post("/node/v1/enrol", {
        "join_token": token, "name": name, **host(), **report}, format="json")
    if response.status_code == 201:
        assert "no-store" in response["Cache-Control"]  # no cache may keep the credential
    return response.status_code, response.json()


def join_token(name: str = "gpu-1") -> str:
    out = StringIO()
    call_command("node_join_token", name, stdout=out, stderr=StringIO())
    return out.getvalue().strip()


def test_a_join_token_enrols_its_node_once_and_the_credential_opens_the_channel() -> None:
    token = join_token("gpu-1")
    assert token.startswith("kvj_")

    status, body = enrol(token)

    assert status == 201
    assert body["node"] == {"name": "gpu-1", "state": "online", "gpu_type": "h100-80gb"}
    node = Node.objects.get(name="gpu-1")
    assert (node.address, len(node.devices), node.cpu_count) == ("10.0.0.7", 8, 64)
    assert JoinToken.objects.get().used_at is not None
    credential = body["credential"]
    assert credential.startswith("kvn_")
    # Only a digest is kept, of either secret.
    assert not NodeCredential.objects.filter(digest=credential).exists()
    assert token not in JoinToken.objects.values_list("digest", flat=True)
    beat = as_node(credential).post("/node/v1/heartbeat", {"engines": []}, format="json")
    assert (beat.status_code, beat.json()) == (200, {"stop": [], "rotate": False})
    used = NodeCredential.objects.get()
    assert used.first_used_at is not None and used.last_used_at == used.first_used_at

    # Spent: a second enrolment with it is refused and makes nothing.
    status, body = enrol(token)
    assert status == 403
    assert "unknown, used or expired" in body["error"]["message"]
    assert NodeCredential.objects.count() == 1


def test_an_expired_or_unknown_join_token_makes_nothing() -> None:
    token, secret = do_create_join_token(node_name="gpu-1", valid_for=timedelta(minutes=1))
    JoinToken.objects.filter(id=token.id).update(expires_at=timezone.now())

    for attempt in [secret, "kvj_" + "x" * 43]:
        status, body = enrol(attempt)
        assert (status, body["error"]["type"]) == (403, "permission_denied")
    assert not Node.objects.exists()
    assert not NodeCredential.objects.exists()
    assert JoinToken.objects.get().used_at is None


@pytest.mark.parametrize("name, minutes, says", [
    ("gpu 1", 15, "not a node name"), ("gpu/1", 15, "not a node name"),
    ("gpu-1", 0, "at most a day"), ("gpu-1", 60 * 24 + 1, "at most a day"),
])
def test_a_join_token_needs_a_host_name_and_a_lifetime_of_at_most_a_day(
        name: str, minutes: int, says: str) -> None:
    with pytest.raises(CommandError, match=says):
        call_command("node_join_token", name, "--minutes", str(minutes), stdout=StringIO())
    assert not JoinToken.objects.exists()


def test_a_node_is_in_the_region_and_zone_its_join_token_names_and_cannot_move() -> None:
    eu = Region.objects.create(slug="eu-west", name="EU West")
    out = StringIO()
    call_command("node_join_token", "gpu-1", "--region", "eu-west", "--zone", "eu-west-1a",
                 stdout=out, stderr=StringIO())

    status, body = enrol(out.getvalue().strip())

    assert status == 201
    node = Node.objects.get(name="gpu-1")
    assert (node.region, node.zone) == (eu, "eu-west-1a")
    # Registering again keeps it; a node that names a region of its own is refused.
    credential = body["credential"]
    again = as_node(credential).post("/node/v1/register", host(), format="json")
    assert again.status_code == 200
    assert Node.objects.get(name="gpu-1").region == eu
    claimed = as_node(credential).post("/node/v1/register", {**host(), "region": "us-east"},
                                       format="json")
    assert claimed.status_code == 400
    assert Node.objects.get(name="gpu-1").region == eu


@pytest.mark.parametrize("arguments, says", [
    (["--region", "mars-1"], "No region 'mars-1' (regions: none yet)"),
    (["--zone", "a"], "'a' is not a zone: a zone is within a region"),
])
def test_a_join_token_names_a_known_region_and_a_zone_only_within_one(
        arguments: list[str], says: str) -> None:
    with pytest.raises(CommandError, match=re.escape(says)):
        call_command("node_join_token", "gpu-1", *arguments, stdout=StringIO())
    assert not JoinToken.objects.exists()


def test_a_join_token_enrols_only_the_node_it_was_made_for() -> None:
    token = join_token("gpu-1")

    status, body = enrol(token, name="gpu-2")  # a host given another's token

    assert status == 403
    assert body["error"]["message"] == (
        "This join token is for node gpu-1, not gpu-2: start the agent with --name gpu-1, "
        "or ask an operator for a token for gpu-2.")
    assert not Node.objects.exists() and JoinToken.objects.get().used_at is None
    assert enrol(token, name="gpu-1")[0] == 201


def test_an_enrolment_with_a_bad_report_is_refused_and_spends_nothing() -> None:
    token = join_token()
    status, body = enrol(token, address="not an address")

    assert status == 400
    assert set(body["error"]["fields"]) == {"address"}
    assert JoinToken.objects.get().used_at is None
    assert enrol(token)[0] == 201


def beat(credential: str) -> int:
    return as_node(credential).post("/node/v1/heartbeat", {"engines": []},
                                    format="json").status_code


def test_a_rotated_credential_replaces_the_old_one_once_it_is_used() -> None:
    _, body = enrol(join_token())
    old = body["credential"]

    rotated = as_node(old).post("/node/v1/credential")
    assert rotated.status_code == 201
    assert "no-store" in rotated["Cache-Control"]
    new = rotated.json()["credential"]
    # The answer may be lost on the way: until the new one is used, the old one still works.
    assert beat(old) == 200
    # Whoever else held the old one mints one of their own meanwhile...
    minted = as_node(old).post("/node/v1/credential").json()["credential"]

    assert beat(new) == 200
    # ...and the new one's first use revokes both.
    refused = as_node(old).post("/node/v1/heartbeat", {"engines": []}, format="json")
    assert refused.status_code == 401
    assert "unknown or revoked" in refused.json()["error"]["message"]
    assert beat(minted) == 401
    assert NodeCredential.objects.filter(revoked_at=None).count() == 1


def test_a_node_holds_at_most_three_new_credentials_unused() -> None:
    _, body = enrol(join_token())
    node = as_node(body["credential"])

    answers = [node.post("/node/v1/credential").status_code for _ in range(4)]

    assert answers == [201, 201, 201, 409]
    assert NodeCredential.objects.count() == 4
    assert beat(body["credential"]) == 200  # refused a fourth, it keeps working


def test_enrolling_a_node_anew_revokes_its_live_credentials() -> None:
    _, first = enrol(join_token("gpu-1"))
    assert beat(first["credential"]) == 200

    status, second = enrol(join_token("gpu-1"))

    assert status == 201
    assert (beat(first["credential"]), beat(second["credential"])) == (401, 200)
    assert Node.objects.count() == 1


def test_a_revoked_node_is_refused_at_once_and_its_replicas_move(
        django_capture_on_commit_callbacks: DjangoCaptureOnCommitCallbacks) -> None:
    _, body = enrol(join_token("gpu-1"))
    node = Node.objects.get(name="gpu-1")
    replica = placed_replica(node)

    spare = join_token("gpu-1")  # made before the revocation, never used
    with django_capture_on_commit_callbacks() as reconciles:
        assert do_revoke_node(node_id=node.id) == 1
    assert len(reconciles) == 1
    # Settled at once: no gateway that reads its routes now finds the replica.
    replica.refresh_from_db()
    assert replica.state == State.STOPPED
    [endpoint] = endpoints_for_gateway(organization_id=replica.endpoint.organization_id)
    assert endpoint.ready_replicas == []

    refused = as_node(body["credential"]).post("/node/v1/heartbeat", {"engines": []},
                                               format="json")
    assert refused.status_code == 401
    assert Node.objects.get(id=node.id).state == NodeState.REVOKED
    # Neither its agent's reports nor a registration bring it back.
    assert do_record_node_heartbeat(name="gpu-1", engines=[str(replica.id)]) is None
    with pytest.raises(NodeRevoked):
        do_register_node(name="gpu-1", resources=node_resources(node))
    assert Node.objects.get(id=node.id).state == NodeState.REVOKED

    reconcile_endpoint(endpoint_id=replica.endpoint_id)
    assert replica.endpoint.events.filter(
        message__contains="node gpu-1 was revoked; rescheduling").exists()
    # Its replacement waits for another node: the revoked one takes none.
    replacement = replica.endpoint.replicas.exclude(id=replica.id).get()
    assert (replacement.state, replacement.node) == (State.PENDING, None)

    # Only a join token made after the revocation lets it back, with a new credential; the
    # old credential stays refused.
    assert enrol(spare)[0] == 403
    status, again = enrol(join_token("gpu-1"))
    assert status == 201
    assert Node.objects.get(id=node.id).state == NodeState.ONLINE
    assert as_node(body["credential"]).post("/node/v1/heartbeat", {"engines": []},
                                            format="json").status_code == 401
    assert as_node(again["credential"]).post("/node/v1/heartbeat", {"engines": []},
                                             format="json").status_code == 200


def node_resources(node: Node) -> HostResources:
    return HostResources(devices=[Device(**device) for device in node.devices],
                         cpu_count=node.cpu_count, memory_bytes=node.memory_bytes)


def test_the_console_makes_a_join_token_shown_once_and_revokes_a_node(client: Client) -> None:
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    for name in ["gpu 9", "gpu/9"]:
        refused = client.post("/admin/fleet/jointoken/add/", {"node_name": name, "minutes": 30})
        assert refused.status_code == 200 and refused.context["adminform"].form.errors
    assert not JoinToken.objects.exists()
    response = client.post("/admin/fleet/jointoken/add/", {"node_name": "gpu-9", "minutes": 30},
                           follow=True)
    assert response.status_code == 200
    shown = [str(message) for message in response.context["messages"]]
    secret = next(word.rstrip(".") for message in shown for word in message.split()
                  if word.startswith("kvj_"))
    token = JoinToken.objects.get()
    assert (token.node_name, token.created_by.is_superuser) == ("gpu-9", True)
    assert timedelta(minutes=29) < token.expires_at - timezone.now() <= timedelta(minutes=30)

    assert enrol(secret, name="gpu-9")[0] == 201
    credential = NodeCredential.objects.get()
    # Rotation, asked here, is carried by the node's next heartbeat.
    response = client.post("/admin/fleet/nodecredential/", {
        "action": "rotate_credentials", "_selected_action": [credential.id]}, follow=True)
    assert response.status_code == 200
    assert NodeCredential.objects.get().rotation_asked_at is not None
    response = client.post("/admin/fleet/nodecredential/", {
        "action": "revoke_nodes", "_selected_action": [credential.id]}, follow=True)
    assert response.status_code == 200
    assert Node.objects.get(name="gpu-9").state == NodeState.REVOKED
    assert NodeCredential.objects.get().revoked_at is not None


def test_an_operator_makes_a_join_token_for_an_organisation_s_own_node(
        client: Client, org: Organization) -> None:
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    do_register_node(name="shared-1", resources=HostResources(devices=[], cpu_count=4,
                                                               memory_bytes=2**34))
    taken = client.post("/admin/fleet/jointoken/add/", {
        "node_name": "shared-1", "organization": org.id, "minutes": 30})
    assert taken.context["adminform"].form.errors == {"node_name": [
        "A node named shared-1 exists and is not Acme's; choose another name."]}
    assert not JoinToken.objects.exists()

    made = client.post("/admin/fleet/jointoken/add/", {
        "node_name": "acme-1", "organization": org.id, "minutes": 30}, follow=True)
    assert made.status_code == 200
    assert JoinToken.objects.get().organization == org
    out = StringIO()
    call_command("node_join_token", "acme-2", "--organization", org.slug, stdout=out,
                 stderr=StringIO())
    assert enrol(out.getvalue().strip(), name="acme-2")[0] == 201
    assert Node.objects.get(name="acme-2").organization == org
    with pytest.raises(CommandError, match="No organisation 'nobody'"):
        call_command("node_join_token", "x", "--organization", "nobody", stdout=StringIO(),
                     stderr=StringIO())
