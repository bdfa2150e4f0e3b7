from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone

from accounts.models import Organization, Role
from endpoints.models import (
    Endpoint,
    EndpointEvent,
    GPUType,
    ModelSpec,
    Node,
    NodeState,
    Replica,
    State,
)
from endpoints.policies import EndpointPolicy, EndpointScaling
from endpoints.reconciler import QUIET_MARGIN_SECONDS, reconcile_endpoint
from endpoints.scheduling import free_devices
from endpoints.services import do_create_endpoint, do_load_catalogs
from engine.devices import Device, HostResources
from fleet.reports import do_register_node

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


def h100_node(name: str, busy: list[int] | None = None) -> Node:
    devices = [Device(index=i, name="NVIDIA H100 80GB HBM3", memory_bytes=81559 * 2**20)
               for i in range(8)]
    node = do_register_node(name=name, resources=HostResources(devices=devices, cpu_count=64,
                                                               memory_bytes=2**40))
    if busy:
        filler = make_endpoint(node.gpu_type, name=f"filler-{name}")
        Replica.objects.create(endpoint=filler, node=node, device_indices=busy,
                               state=State.READY)
    return node


_orgs: dict[str, Organization] = {}


def make_endpoint(gpu_type: GPUType, *, name: str = "chat", gpu_count: int = 2,
                  replicas: int = 1) -> Endpoint:
    from tests.factories import organization_with_owner

    org = _orgs.get("org") or organization_with_owner("Recon")
    _orgs["org"] = org
    return do_create_endpoint(
        organization=org, actor_role=Role.OWNER, created_by=None, name=name,
        model=ModelSpec.objects.get(slug="llama-3.1-8b-instruct"), gpu_type=gpu_type,
        gpu_count=gpu_count, policy=EndpointPolicy(context_length=8192, concurrency=8),
        scaling=EndpointScaling(min_replicas=replicas, max_replicas=replicas))


@pytest.fixture(autouse=True)
def _fresh_orgs() -> None:
    _orgs.clear()


def test_it_places_a_replica_where_it_fits_tightest() -> None:
    roomy = h100_node("roomy")
    snug = h100_node("snug", busy=[0, 1, 2, 3, 4, 5])
    endpoint = make_endpoint(roomy.gpu_type)

    reconcile_endpoint(endpoint_id=endpoint.id)

    replica = endpoint.replicas.get()
    assert (replica.node, replica.device_indices, replica.state) == (snug, [6, 7], State.STARTING)
    endpoint.refresh_from_db()
    assert endpoint.state == State.STARTING
    assert [e.state for e in replica.events.order_by("at", "id")] == [
        State.PENDING, State.SCHEDULING, State.STARTING]


def test_a_node_that_holds_the_weights_comes_before_a_tighter_fit() -> None:
    holder = h100_node("holder")
    snug = h100_node("snug", busy=[0, 1, 2, 3, 4, 5])
    endpoint = make_endpoint(holder.gpu_type)
    model = endpoint.model
    ModelSpec.objects.filter(id=model.id).update(hf_commit="a" * 40)
    Node.objects.filter(id=snug.id).update(model_cache=[
        {"repo_id": model.hf_repo, "commit": "b" * 40}])  # another commit of the same model
    Node.objects.filter(id=holder.id).update(model_cache=[
        {"repo_id": model.hf_repo, "commit": "a" * 40}])

    reconcile_endpoint(endpoint_id=endpoint.id)

    assert endpoint.replicas.get().node == holder


def test_it_never_hands_out_a_device_twice() -> None:
    node = h100_node("only")
    first = make_endpoint(node.gpu_type, name="one", gpu_count=4)
    second = make_endpoint(node.gpu_type, name="two", gpu_count=4)
    third = make_endpoint(node.gpu_type, name="three", gpu_count=4)

    for endpoint in (first, second, third):
        reconcile_endpoint(endpoint_id=endpoint.id)

    used = [r.device_indices for r in Replica.objects.filter(node=node, state=State.STARTING)]
    assert sorted(i for indices in used for i in indices) == list(range(8))
    waiting = third.replicas.get()
    assert waiting.state == State.PENDING
    assert "waiting for a node with 4 free" in waiting.stage


def test_a_lost_nodes_replica_is_rescheduled_elsewhere() -> None:
    first = h100_node("first")
    endpoint = make_endpoint(first.gpu_type)
    reconcile_endpoint(endpoint_id=endpoint.id)
    old = endpoint.replicas.get()
    Replica.objects.filter(id=old.id).update(state=State.READY)
    Node.objects.filter(id=first.id).update(state=NodeState.LOST)
    second = h100_node("second")

    reconcile_endpoint(endpoint_id=endpoint.id)

    old.refresh_from_db()
    assert old.state == State.STOPPED
    new = endpoint.replicas.exclude(id=old.id).get()
    assert (new.node, new.state) == (second, State.STARTING)


def test_a_failed_replica_restarts_after_its_backoff() -> None:
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type)
    reconcile_endpoint(endpoint_id=endpoint.id)
    replica = endpoint.replicas.get()
    Replica.objects.filter(id=replica.id).update(
        state=State.FAILED, restarts=1, next_start_at=timezone.now() + timedelta(minutes=1))

    reconcile_endpoint(endpoint_id=endpoint.id)
    assert Replica.objects.get(id=replica.id).state == State.FAILED

    Replica.objects.filter(id=replica.id).update(next_start_at=timezone.now())
    reconcile_endpoint(endpoint_id=endpoint.id)
    assert Replica.objects.get(id=replica.id).state == State.STARTING
    assert endpoint.replicas.count() == 1


def test_too_many_failures_fail_the_endpoint_with_the_engines_words(settings: object) -> None:
    settings.KVRUN_ENGINE_MAX_FAILURES = 3
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type)
    reconcile_endpoint(endpoint_id=endpoint.id)
    Replica.objects.filter(endpoint=endpoint).update(
        state=State.FAILED, restarts=3,
        failure_reason="the engine exited during start-up. Last engine log lines:\nOSError: no "
                       "config.json in /models/broken")

    reconcile_endpoint(endpoint_id=endpoint.id)

    endpoint.refresh_from_db()
    assert endpoint.state == State.FAILED
    assert "failed 3 times in a row" in endpoint.failure_reason
    assert "no config.json" in endpoint.failure_reason
    assert endpoint.replicas.get().state == State.FAILED


def test_stopping_moves_running_replicas_to_stopping_and_pending_ones_to_stopped() -> None:
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type, gpu_count=4, replicas=3)
    reconcile_endpoint(endpoint_id=endpoint.id)  # two placed, the third waits for devices
    Endpoint.objects.filter(id=endpoint.id).update(desired_state="stopped")

    reconcile_endpoint(endpoint_id=endpoint.id)

    states = sorted(endpoint.replicas.values_list("state", flat=True))
    assert states == [State.STOPPED, State.STOPPING, State.STOPPING]
    endpoint.refresh_from_db()
    assert endpoint.state == State.STOPPING


def test_scaling_down_stops_the_newest_replicas() -> None:
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type, gpu_count=2, replicas=2)
    reconcile_endpoint(endpoint_id=endpoint.id)
    Endpoint.objects.filter(id=endpoint.id).update(desired_replicas=1)

    reconcile_endpoint(endpoint_id=endpoint.id)

    assert sorted(endpoint.replicas.values_list("state", flat=True)) == [
        State.STARTING, State.STOPPING]


def quiet_for(replica: Replica, seconds: float) -> None:
    """As if nothing had happened to the replica for `seconds`."""
    EndpointEvent.objects.filter(replica=replica).update(
        at=timezone.now() - timedelta(seconds=seconds))


def test_a_replica_stuck_loading_is_stopped_and_keeps_its_devices_until_stopped(
        settings: object, django_capture_on_commit_callbacks: Callable) -> None:
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type)
    reconcile_endpoint(endpoint_id=endpoint.id)
    replica = endpoint.replicas.get()
    # The agent moved it to loading, then its last transition failed (a database error).
    Replica.objects.filter(id=replica.id).update(state=State.LOADING)
    quiet_for(replica, settings.KVRUN_ENGINE_START_TIMEOUT_SECONDS - 1)

    reconcile_endpoint(endpoint_id=endpoint.id)
    assert Replica.objects.get(id=replica.id).state == State.LOADING  # its agent may still try

    quiet_for(replica, settings.KVRUN_ENGINE_START_TIMEOUT_SECONDS
              + settings.KVRUN_ENGINE_STOP_GRACE_SECONDS + QUIET_MARGIN_SECONDS + 1)
    with django_capture_on_commit_callbacks() as sent:
        reconcile_endpoint(endpoint_id=endpoint.id)

    replica.refresh_from_db()
    assert replica.state == State.STOPPING
    assert "not ready in time" in replica.events.order_by("-at", "-id").first().message
    assert len(sent) == 2  # the stop to the node's agent, and the start of its replacement
    # Its engine may still hold its devices: its replacement is placed on others.
    replacement = endpoint.replicas.exclude(id=replica.id).get()
    assert (replica.device_indices, replacement.device_indices) == ([0, 1], [2, 3])
    assert free_devices(node) == [4, 5, 6, 7]


def test_a_stop_nobody_confirmed_is_sent_again_and_keeps_its_devices(
        settings: object, django_capture_on_commit_callbacks: Callable) -> None:
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type)
    reconcile_endpoint(endpoint_id=endpoint.id)
    replica = endpoint.replicas.get()
    Replica.objects.filter(id=replica.id).update(state=State.READY)
    Endpoint.objects.filter(id=endpoint.id).update(desired_state="stopped")
    reconcile_endpoint(endpoint_id=endpoint.id)
    assert Replica.objects.get(id=replica.id).state == State.STOPPING
    # Its agent's stop timed out, or its transition to stopped hit a deadlock.
    quiet_for(replica, settings.KVRUN_ENGINE_STOP_GRACE_SECONDS + QUIET_MARGIN_SECONDS + 1)

    with django_capture_on_commit_callbacks() as sent:
        reconcile_endpoint(endpoint_id=endpoint.id)

    assert Replica.objects.get(id=replica.id).state == State.STOPPING
    assert "asking its node again" in replica.events.order_by("-at", "-id").first().message
    assert len(sent) == 1
    assert free_devices(node) == [2, 3, 4, 5, 6, 7]

    with django_capture_on_commit_callbacks() as sent_again:
        reconcile_endpoint(endpoint_id=endpoint.id)
    assert sent_again == []  # once per quiet period, not at every pass


def ready_all(endpoint: Endpoint) -> None:
    """As the agent leaves replicas once their engines serve, with the policy they read."""
    for replica in endpoint.replicas.filter(state__in=[State.STARTING, State.LOADING]):
        Replica.objects.filter(id=replica.id).update(
            state=State.READY, policy_version=Endpoint.objects.get(id=endpoint.id).policy_version)
    Replica.objects.filter(endpoint=endpoint, state=State.STOPPING).update(state=State.STOPPED)


def test_a_policy_change_replaces_replicas_one_at_a_time_while_the_rest_serve() -> None:
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type, gpu_count=2, replicas=2)
    reconcile_endpoint(endpoint_id=endpoint.id)
    ready_all(endpoint)
    first, second = endpoint.replicas.order_by("created_at")
    Endpoint.objects.filter(id=endpoint.id).update(policy_version=2)

    reconcile_endpoint(endpoint_id=endpoint.id)

    first.refresh_from_db(), second.refresh_from_db()
    assert (first.state, second.state) == (State.STOPPING, State.READY)
    fresh = endpoint.replicas.exclude(id__in=[first.id, second.id]).get()
    assert fresh.state == State.STARTING  # placed on the devices still free
    reconcile_endpoint(endpoint_id=endpoint.id)  # the new one is not ready: nothing more
    assert endpoint.replicas.filter(state=State.STOPPING).count() == 1
    assert Replica.objects.get(id=second.id).state == State.READY

    ready_all(endpoint)
    reconcile_endpoint(endpoint_id=endpoint.id)

    assert Replica.objects.get(id=second.id).state == State.STOPPING
    assert sorted(endpoint.replicas.exclude(state=State.STOPPED).values_list("state", flat=True)
                  ) == [State.READY, State.STARTING, State.STOPPING]
    ready_all(endpoint)
    reconcile_endpoint(endpoint_id=endpoint.id)
    assert sorted(endpoint.replicas.filter(state=State.READY)
                  .values_list("policy_version", flat=True)) == [2, 2]
    assert not endpoint.replicas.filter(state=State.STOPPING).exists()


def test_a_policy_change_restarts_a_lone_replica_at_once() -> None:
    node = h100_node("n")
    endpoint = make_endpoint(node.gpu_type, gpu_count=2, replicas=1)
    reconcile_endpoint(endpoint_id=endpoint.id)
    ready_all(endpoint)
    Endpoint.objects.filter(id=endpoint.id).update(policy_version=2)

    reconcile_endpoint(endpoint_id=endpoint.id)

    assert sorted(endpoint.replicas.values_list("state", flat=True)) == [
        State.STARTING, State.STOPPING]
