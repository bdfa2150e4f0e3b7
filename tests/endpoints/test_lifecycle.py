import threading
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.utils import timezone

from accounts.models import Role
from endpoints.lifecycle import backoff_until, do_transition_replica
from endpoints.models import Endpoint, ModelSpec, Node, Replica, State
from endpoints.policies import EndpointPolicy
from endpoints.services import do_create_endpoint, do_load_catalogs
from tests.factories import organization_with_owner
from tests.helpers import wait_until


def waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0] > 0


@pytest.mark.django_db(transaction=True)
def test_an_agent_s_transition_and_a_reconciler_pass_never_deadlock(cpu_node: Node) -> None:
    endpoint = do_create_endpoint(
        organization=organization_with_owner("Acme"), actor_role=Role.OWNER, created_by=None,
        name="chat", model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
        policy=EndpointPolicy(context_length=2048, concurrency=4))
    replica = Replica.objects.create(endpoint=endpoint, node=cpu_node, state=State.LOADING)
    holding, go_on = threading.Event(), threading.Event()
    errors: list[Exception] = []
    agent_moved: list[bool] = []

    def reconciler_pass() -> None:
        # What a pass does: hold the endpoint's row, then move one of its replicas.
        try:
            with transaction.atomic():
                Endpoint.objects.select_for_update().get(id=endpoint.id)
                holding.set()
                go_on.wait(30)
                do_transition_replica(replica_id=replica.id, from_states=[State.LOADING],
                                      to_state=State.STOPPING, message="scaled down")
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    def agent() -> None:
        try:
            agent_moved.append(do_transition_replica(
                replica_id=replica.id, from_states=[State.LOADING], to_state=State.READY,
                message="ready"))
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=reconciler_pass), threading.Thread(target=agent)]
    threads[0].start()
    assert holding.wait(10)
    threads[1].start()
    assert wait_until(waiting_on_a_lock, 10), "the agent's transition never waited for the pass"
    go_on.set()
    for thread in threads:
        thread.join(30)

    assert errors == []  # PostgreSQL aborted neither side as a deadlock
    assert agent_moved == [False]  # the pass came first; the agent's transition is refused
    assert Replica.objects.get(id=replica.id).state == State.STOPPING


@pytest.mark.parametrize(("failures", "seconds"), [
    (1, 5), (2, 10), (3, 20), (4, 40), (6, 160), (7, 300), (12, 300),
])
def test_restart_backoff_doubles_from_its_first_delay_up_to_five_minutes(
    failures: int, seconds: int, settings: object
) -> None:
    settings.KVRUN_ENGINE_BACKOFF_SECONDS = 5
    before = timezone.now()

    until = backoff_until(failures)

    assert timedelta(seconds=seconds) <= until - before <= timedelta(seconds=seconds + 1)


@pytest.mark.django_db
@pytest.mark.parametrize(("context_length", "phrase"), [
    (127, "Ask for at least 128 tokens of context."),
    (2049, "supports at most 2,048 tokens of context"),
])
def test_the_service_refuses_a_context_out_of_the_contract_whoever_calls_it(
        context_length: int, phrase: str) -> None:
    do_load_catalogs()
    organization = organization_with_owner("Acme")

    with pytest.raises(ValidationError) as refused:
        do_create_endpoint(
            organization=organization, actor_role=Role.OWNER, created_by=None, name="chat",
            model=ModelSpec.objects.get(slug="kvrun-demo-tiny"),
            policy=EndpointPolicy(context_length=context_length, concurrency=4))

    assert phrase in " ".join(refused.value.message_dict["context_length"])
    assert not Endpoint.objects.filter(organization=organization).exists()
