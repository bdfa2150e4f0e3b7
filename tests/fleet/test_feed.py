"""The node channel's long poll of a node's work (fleet.feed): what a node reads there, and
that a change wakes it."""

import threading

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import AsyncClient

from endpoints.dispatch import request_pull
from endpoints.lifecycle import do_stop_replica
from endpoints.models import Node, Replica, State
from fleet import feed
from tests.fleet.helpers import enrolled, placed_replica

pytestmark = pytest.mark.django_db(transaction=True)  # the view reads on a thread of its own


def poll(credential: str, **query: object) -> tuple[int, dict]:
    answer = async_to_sync(AsyncClient().get)(
        "/node/v1/work", query, headers={"Authorization": f"Bearer {credential}"})
    return answer.status_code, answer.json()


def test_a_node_reads_its_own_replicas_and_pulls_and_nothing_of_another_s(
        credential: str) -> None:
    replica = placed_replica(Node.objects.get(name="gpu-1"))
    Replica.objects.filter(id=replica.id).update(state=State.STARTING)
    request_pull(model_id=replica.endpoint.model_id, node=replica.node)

    status, work = poll(credential, seen="")

    assert status == 200
    assert [(item["id"], item["state"]) for item in work["replicas"]] == [
        (str(replica.id), "starting")]
    assert work["pulls"] == [replica.endpoint.model_id]
    assert poll(enrolled("gpu-2"), wait=0)[1]["replicas"] == []  # another node's: not there


def test_an_unchanged_poll_waits_and_answers_the_same(credential: str) -> None:
    _, work = poll(credential)

    status, again = poll(credential, seen=work["version"], wait=0)

    assert status == 200 and again == work


def test_a_change_wakes_the_poll_at_once(credential: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the poll's wait, were it not woken: only the wake can end it with the change.
    monkeypatch.setattr(feed, "LOOK_AGAIN_SECONDS", 60.0)
    replica = placed_replica(Node.objects.get(name="gpu-1"))
    _, before = poll(credential)
    def stop() -> None:
        try:
            do_stop_replica(replica=replica, reason="scaled down")
        finally:
            connection.close()  # this thread's own

    changed = threading.Timer(1.0, stop)
    changed.start()

    _, after = poll(credential, seen=before["version"], wait=feed.WAIT_MOST_SECONDS)

    changed.join()
    assert [item["state"] for item in after["replicas"]] == ["stopping"]


@pytest.mark.parametrize("header", ["Bearer kvn_unknown", "Bearer ", "Basic a3Zu"])
def test_a_poll_without_a_live_credential_is_refused(header: str) -> None:
    answer = async_to_sync(AsyncClient().get)("/node/v1/work",
                                              headers={"Authorization": header})

    assert answer.status_code == 401
    assert "enrol the node anew" in answer.json()["error"]["message"]


@pytest.mark.parametrize("wait", ["soon", "nan", "inf"])
def test_a_wait_that_is_not_a_number_of_seconds_is_refused(credential: str, wait: str) -> None:
    assert poll(credential, wait=wait) == (400, {"error": {
        "type": "invalid", "message": "wait is a number of seconds.", "fields": {}}})
