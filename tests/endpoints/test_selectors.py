"""What other parts read about endpoints every few seconds."""

import pytest

from accounts.models import Organization
from endpoints.models import Replica, State
from endpoints.selectors import endpoints_for_gateway
from tests.factories import ready_endpoint

pytestmark = pytest.mark.django_db


def test_the_gateway_reads_an_endpoint_s_live_replicas_not_its_history(
        org: Organization, django_assert_num_queries: object) -> None:
    endpoint = ready_endpoint(org, "chat", [8001])
    node = endpoint.replicas.get().node
    Replica.objects.bulk_create(
        [Replica(endpoint=endpoint, node=node, state=State.STOPPED) for _ in range(50)]
        + [Replica(endpoint=endpoint, node=node, state=State.FAILED),
           Replica(endpoint=endpoint, node=node, state=State.LOADING)])

    # Endpoints, their unended replicas, their ready ones, their adapters: however many rows.
    with django_assert_num_queries(4):
        [read] = endpoints_for_gateway(organization_id=org.id)
        states = sorted(replica.state for replica in read.replicas.all())

    assert states == [State.LOADING, State.READY]
    assert [replica.port for replica in read.ready_replicas] == [8001]
