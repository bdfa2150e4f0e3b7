"""Where kvrun takes payment, GPU endpoints wait for a payment method or an operator's
approval; CPU endpoints, bounded by the quotas, need neither."""

from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from accounts.models import Organization
from billing.payments import do_attach_card
from endpoints.models import Endpoint, GPUType, Node
from tests.factories import enrolled_node

pytestmark = pytest.mark.usefixtures("stripe_on", "cpu_node")  # cpu_node: the catalogs

GPU = {"name": "gpu", "model": "llama-3.1-8b-instruct", "context_length": 8192,
       "concurrency": 4, "gpu_type": "h100-80gb"}
CPU = {"name": "cpu", "model": "kvrun-demo-tiny", "context_length": 2048, "concurrency": 4}
CARD = {"number": "4242424242424242", "exp_month": 12, "exp_year": 2031, "cvc": "123"}
NO_CARD = "GPU endpoints need a payment method on file: add a card on the organisation's " \
          "billing page"


def url(org: Organization) -> str:
    return f"/api/v1/organizations/{org.slug}/endpoints/"


def test_a_gpu_endpoint_without_a_payment_method_is_refused_and_a_cpu_one_is_not(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    refused = owner_api.post(url(org), GPU, format="json")

    assert refused.status_code == 400
    assert NO_CARD in refused.json()["error"]["message"]
    assert owner_api.post(url(org), CPU, format="json").status_code == 201
    assert list(Endpoint.objects.values_list("name", flat=True)) == ["cpu"]


def test_a_card_on_file_lets_gpu_endpoints_run(owner_api: APIClient, org: Organization) -> None:
    do_attach_card(organization=org, card=CARD)

    response = owner_api.post(url(org), GPU, format="json")
    assert response.status_code == 201, response.json()
    assert Endpoint.objects.get().gpu_type.slug == "h100-80gb"


def test_an_operator_s_approval_stands_for_a_card(owner_api: APIClient,
                                                   org: Organization) -> None:
    Organization.objects.filter(id=org.id).update(gpus_approved=True)

    assert owner_api.post(url(org), GPU, format="json").status_code == 201


def test_a_stopped_gpu_endpoint_does_not_start_again_without_a_payment_method(
        owner_api: APIClient, org: Organization, settings: object) -> None:
    Organization.objects.filter(id=org.id).update(gpus_approved=True)
    owner_api.post(url(org), GPU, format="json")
    owner_api.post(f"{url(org)}gpu/stop/")
    Organization.objects.filter(id=org.id).update(gpus_approved=False)

    response = owner_api.post(f"{url(org)}gpu/start/")

    assert response.status_code == 400
    assert NO_CARD in response.json()["error"]["message"]
    assert Endpoint.objects.get().desired_state == "stopped"


def test_a_gpu_endpoint_on_the_organisation_s_own_nodes_needs_no_card_while_they_cost_nothing(
        owner_api: APIClient, org: Organization) -> None:
    enrolled_node("acme-gpu", owner=org)
    own = {**GPU, "own_nodes_only": True}

    response = owner_api.post(url(org), own, format="json")
    assert response.status_code == 201, response.json()
    GPUType.objects.filter(slug="h100-80gb").update(own_node_price_usd=Decimal("1.2000"))
    refused = owner_api.post(url(org), {**own, "name": "priced"}, format="json")
    assert refused.status_code == 400
    assert NO_CARD in refused.json()["error"]["message"]
