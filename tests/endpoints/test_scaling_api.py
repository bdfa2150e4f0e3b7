"""PATCH .../endpoints/<name>/scaling/: how an endpoint scales, validated and recorded."""

import pytest
from rest_framework.test import APIClient

from accounts.models import Organization
from endpoints.models import Endpoint, EndpointEvent, Node
from endpoints.services import do_load_catalogs
from tests.factories import organization_with_owner

pytestmark = pytest.mark.django_db

DEMO = {"name": "demo", "model": "kvrun-demo-tiny", "context_length": 2048, "concurrency": 4}


@pytest.fixture(autouse=True)
def catalogs(db: None) -> None:
    do_load_catalogs()


def url(org: Organization) -> str:
    return f"/api/v1/organizations/{org.slug}/endpoints/demo/scaling/"


def test_it_changes_how_an_endpoint_scales_and_records_it(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {**DEMO, "min_replicas": 2,
                                                                     "max_replicas": 3},
                   format="json")

    response = owner_api.patch(url(org), {
        "min_replicas": 0, "max_replicas": 2, "scale_to_zero_after_seconds": 600,
        "scaling_metric": "waiting", "scaling_target": 2, "scale_up_window_seconds": 30},
        format="json")

    assert response.status_code == 200, response.content
    assert response.json()["scaling_metric"] == "waiting"
    endpoint = Endpoint.objects.get(name="demo")
    assert (endpoint.min_replicas, endpoint.max_replicas, endpoint.desired_replicas) == (0, 2, 2)
    assert (endpoint.scale_to_zero_after_seconds, endpoint.scaling_target,
            endpoint.scale_up_window_seconds, endpoint.scale_down_window_seconds) == (
        600, 2.0, 30, 300)
    assert endpoint.events.filter(message="scaling changed: min replicas 0, max replicas 2, "
                                          "scale to zero after seconds 600, scaling metric "
                                          "waiting, scaling target 2, scale up window seconds "
                                          "30").exists()


def test_a_narrower_range_moves_the_replicas_asked_for_into_it(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {**DEMO, "min_replicas": 3},
                   format="json")

    response = owner_api.patch(url(org), {"min_replicas": 1, "max_replicas": 2}, format="json")

    assert response.status_code == 200 and response.json()["desired_replicas"] == 2
    assert EndpointEvent.objects.filter(message__endswith="; 2 replica(s) now").exists()


@pytest.mark.parametrize(("change", "field", "phrase"), [
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas", "Choose between 3"),
    ({"min_replicas": -1}, "min_replicas", "Run at least 0 replicas"),
    ({"scale_to_zero_after_seconds": 5}, "scale_to_zero_after_seconds", "Wait at least 60 s"),
    ({"scale_down_window_seconds": 7201}, "scale_down_window_seconds", "and 7200 s"),
    ({"scaling_target": 0}, "scaling_target", "Set a target above 0"),
    ({"scale_down_window_seconds": 5}, "scale_down_window_seconds", "between 15 s and"),
    ({"scaling_metric": "vibes"}, "scaling_metric", "not a valid choice"),
    ({"max_replicas": None}, "max_replicas", "may not be null"),
])
def test_bad_scaling_input_says_what_to_change_and_changes_nothing(
        owner_api: APIClient, org: Organization, cpu_node: Node, change: dict, field: str,
        phrase: str) -> None:
    assert owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", DEMO,
                          format="json").status_code == 201, "created"
    before = Endpoint.objects.values().get(name="demo")
    events = EndpointEvent.objects.count()

    response = owner_api.patch(url(org), change, format="json")

    assert response.status_code == 400
    assert phrase in " ".join(response.json()["error"]["fields"][field])
    assert Endpoint.objects.values().get(name="demo") == before
    assert EndpointEvent.objects.count() == events


def test_a_minimum_of_one_set_at_zero_starts_a_replica(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {**DEMO, "min_replicas": 0},
                   format="json")
    Endpoint.objects.filter(name="demo").update(desired_replicas=0)  # scaled to zero

    response = owner_api.patch(url(org), {"min_replicas": 1}, format="json")

    assert response.status_code == 200 and response.json()["desired_replicas"] == 1
    assert EndpointEvent.objects.filter(message="scaling changed: min replicas 1; "
                                                "1 replica(s) now").exists()


def test_scaling_by_hand_below_min_replicas_is_refused_and_changes_nothing(
        owner_api: APIClient, org: Organization, cpu_node: Node) -> None:
    owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {**DEMO, "min_replicas": 2,
                                                                     "max_replicas": 3},
                   format="json")

    response = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/demo/scale/",
                              {"replicas": 1}, format="json")

    assert response.status_code == 400
    assert "Choose between 2 and 3, the most replicas (max_replicas); to run fewer, lower the " \
           "fewest replicas (min_replicas)" in " ".join(
        response.json()["error"]["fields"]["replicas"])
    assert Endpoint.objects.get(name="demo").desired_replicas == 2


def test_a_higher_max_replicas_is_held_to_the_organisation_s_quota(
        owner_api: APIClient, org: Organization, cpu_node: Node, settings: object) -> None:
    settings.KVRUN_ORG_MAX_REPLICAS = 2
    assert owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", DEMO,
                          format="json").status_code == 201, "created"

    response = owner_api.patch(url(org), {"max_replicas": 3}, format="json")

    assert response.status_code == 400
    assert "may have 2 replica(s) at most" in response.json()["error"]["message"]
    assert Endpoint.objects.get(name="demo").max_replicas == 1


def test_it_validates_ownership(owner_api: APIClient, cpu_node: Node) -> None:
    other = organization_with_owner("Initech")

    response = owner_api.patch(url(other), {"max_replicas": 2}, format="json")

    assert response.status_code in (403, 404)
