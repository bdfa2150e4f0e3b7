"""Scaling in the dashboard: the endpoint page's settings, and an endpoint at zero in the
list and on its page."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import Organization
from endpoints.models import Endpoint, EndpointEvent, Node, Replica, State
from tests.factories import ready_endpoint

pytestmark = pytest.mark.django_db

SCALING = {"min_replicas": "0", "max_replicas": "3", "scale_to_zero_after_seconds": "600",
           "scaling_metric": "in_flight", "scaling_target": "", "scale_up_window_seconds": "60",
           "scale_down_window_seconds": "300"}


def test_the_scaling_settings_change_from_the_endpoint_page(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    ready_endpoint(org, "chat", ports=[])
    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/")
    assert b"Autoscaling and scale to zero" in page.content

    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/scaling/", SCALING,
                                 follow=True)

    assert b"Scaling changed: 0 to 3 replicas, 1 now." in response.content
    endpoint = Endpoint.objects.get(name="chat")
    assert (endpoint.min_replicas, endpoint.max_replicas, endpoint.scale_to_zero_after_seconds,
            endpoint.scaling_target) == (0, 3, 600, None)
    assert b"scales to zero after 600 s without a request" in response.content


def test_bad_scaling_settings_are_refused_on_the_page_and_change_nothing(
        owner_client: Client, org: Organization, cpu_node: Node) -> None:
    ready_endpoint(org, "chat", ports=[])

    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/scaling/",
                                 {**SCALING, "scale_down_window_seconds": "2"}, follow=True)

    assert b"Choose between 15 s and 86400 s." in response.content
    assert Endpoint.objects.get(name="chat").min_replicas == 1
    assert not EndpointEvent.objects.filter(message__startswith="scaling changed").exists()


def test_a_member_cannot_change_scaling(member_client: Client, org: Organization) -> None:
    ready_endpoint(org, "chat", ports=[])

    response = member_client.post(f"/orgs/{org.slug}/endpoints/chat/scaling/", SCALING,
                                  follow=True)

    assert Endpoint.objects.get(name="chat").min_replicas == 1
    assert b"Scaling changed" not in response.content


def test_an_endpoint_at_zero_says_so_and_when_a_request_would_be_served(
        owner_client: Client, org: Organization) -> None:
    endpoint = ready_endpoint(org, "sleepy", ports=[], state=State.IDLE, min_replicas=0,
                              desired_replicas=0)
    started = timezone.now() - timedelta(hours=1)
    Replica.objects.create(endpoint=endpoint, state=State.STOPPED, created_at=started,
                           ready_at=started + timedelta(seconds=42),
                           node=Node.objects.get(name="stub-node"))

    listing = owner_client.get(f"/orgs/{org.slug}/")
    page = owner_client.get(f"/orgs/{org.slug}/endpoints/sleepy/")

    assert b"scaled to zero; a request wakes it in about 42 s" in listing.content
    assert b"Scaled to zero: no replica runs, none is billed. The next request wakes it and " \
           b"waits about 42 s" in page.content
