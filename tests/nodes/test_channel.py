"""The agent's end of the node channel (nodes.channel) against the control plane of this
process: the credential it keeps, and what it is refused."""

import stat
from pathlib import Path

import httpx
import pytest

from endpoints.models import Node, State
from fleet.enrolment import do_ask_rotation, do_create_join_token, do_revoke_node
from fleet.models import NodeCredential
from nodes.channel import ChannelRefused, NodeChannel, NodeRevoked
from tests.nodes.helpers import ControlPlane, channel_of, demo_replica

pytestmark = pytest.mark.django_db

REPORT = {"resources": {"devices": [], "cpu_count": 2, "memory_bytes": 2**34,
                        "disk_bytes": 2**40},
          "address": "127.0.0.1", "model_cache_bytes": 2**30}


def opened(credential_file: Path) -> NodeChannel:
    return NodeChannel(url="http://testserver", credential_file=credential_file,
                       transport=httpx.WSGITransport(app=ControlPlane()), retry_for=0)


def test_the_credential_a_join_token_buys_is_kept_for_the_agent_alone_and_used_after(
        cpu_node: Node, tmp_path: Path) -> None:
    channel_of(cpu_node, tmp_path)
    kept = tmp_path / "credential"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert kept.read_text().startswith("kvn_")

    restarted = opened(kept)  # the agent started again: no token this time
    assert restarted.join(name="cpu-1", join_token="", report=REPORT)["node"]["name"] == "cpu-1"
    assert restarted.heartbeat(engines=[]) == set()


def test_a_spent_join_token_is_refused_with_what_to_do(cpu_node: Node, tmp_path: Path) -> None:
    _, token = do_create_join_token(node_name="cpu-9")
    opened(tmp_path / "a").join(name="cpu-9", join_token=token, report=REPORT)

    with pytest.raises(ChannelRefused) as refused:
        opened(tmp_path / "b").join(name="cpu-9", join_token=token, report=REPORT)

    assert refused.value.status == 403
    assert not (tmp_path / "b").exists()


def test_a_revoked_node_is_told_so_and_let_back_only_with_a_new_join_token(
        cpu_node: Node, tmp_path: Path) -> None:
    channel = channel_of(cpu_node, tmp_path)
    do_revoke_node(node_id=cpu_node.id)

    with pytest.raises(NodeRevoked):
        channel.heartbeat(engines=[])
    with pytest.raises(NodeRevoked):
        opened(tmp_path / "credential").join(name="cpu-1", join_token="", report=REPORT)
    _, token = do_create_join_token(node_name="cpu-1")
    let_back = opened(tmp_path / "credential").join(name="cpu-1", join_token=token,
                                                   report=REPORT)
    assert let_back["node"]["state"] == "online"


def test_another_node_s_replica_is_none_of_its_business(
        cpu_node: Node, channel: NodeChannel, tmp_path: Path) -> None:
    theirs = demo_replica(Node.objects.create(name="cpu-2", address="10.0.0.2", cpu_count=2,
                                              memory_bytes=2**34), State.STARTING)

    assert channel.replica(theirs.id) is None
    assert not channel.move(theirs.id, from_states=[State.STARTING], to_state=State.LOADING,
                            message="mine now", port=8000, policy_version=1)
    assert channel.replicas() == []


def test_a_rotation_an_operator_asks_for_is_done_at_the_next_heartbeat(
        cpu_node: Node, channel: NodeChannel, tmp_path: Path) -> None:
    before = (tmp_path / "cpu-1" / "credential").read_text()
    do_ask_rotation(node_ids=[cpu_node.id])

    assert channel.heartbeat(engines=[]) == set()  # which carries the request, and rotates

    after = (tmp_path / "cpu-1" / "credential").read_text()
    assert after != before and after.startswith("kvn_")
    assert channel.heartbeat(engines=[]) == set()  # the new one's first use
    assert NodeCredential.objects.get(revoked_at=None).rotation_asked_at is None
    (tmp_path / "copied").write_text(before)  # the one it held, as a thief copied it
    with pytest.raises(NodeRevoked):
        opened(tmp_path / "copied").heartbeat(engines=[])
