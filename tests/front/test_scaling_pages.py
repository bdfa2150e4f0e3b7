"""Scaling in the dashboard: the endpoint page's settings, and an endpoint at zero in the
list and on its page."""

from datetime import datetime, timedelta

import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import Organization
from endpoints.models import Endpoint, EndpointEvent, Node, State
from tests.factories import endpoint_at_zero, ready_endpoint, replica_history

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


@pytest.mark.parametrize(("field", "value", "phrase"), [
    ("scale_down_window_seconds", "2", "Choose between 15 s and 7200 s."),  # the service's
    ("scale_to_zero_after_seconds", str(2**31), "Wait at most 2592000 s (30 days)"),
    ("max_replicas", "17", "Ensure this value is less than or equal to 16."),  # the form's
])
def test_bad_scaling_settings_are_refused_under_their_field_and_change_nothing(
        owner_client: Client, org: Organization, cpu_node: Node, field: str, value: str,
        phrase: str) -> None:
    ready_endpoint(org, "chat", ports=[])

    response = owner_client.post(f"/orgs/{org.slug}/endpoints/chat/scaling/",
                                 {**SCALING, field: value})

    assert response.status_code == 400
    page = response.content.decode()
    assert f'<ul class="errors" id="id_{field}_error" role="alert"><li>{phrase}' in page
    assert f'name="{field}" value="{value}"' in page  # what was sent, to correct
    assert '<details class="kv-policy" id="scaling" open>' in page
    assert Endpoint.objects.get(name="chat").min_replicas == 1
    assert not EndpointEvent.objects.filter(message__startswith="scaling changed").exists()


@pytest.mark.parametrize("sent", [SCALING, {**SCALING, "max_replicas": "99"}])
def test_a_member_cannot_change_scaling(member_client: Client, org: Organization,
                                        sent: dict) -> None:
    ready_endpoint(org, "chat", ports=[])

    response = member_client.post(f"/orgs/{org.slug}/endpoints/chat/scaling/", sent,
                                  follow=True)

    assert Endpoint.objects.get(name="chat").min_replicas == 1
    assert b"Only owners and admins can change endpoints" in response.content


def test_an_endpoint_at_zero_says_so_and_when_a_request_would_be_served(
        owner_client: Client, org: Organization) -> None:
    endpoint_at_zero(org, "sleepy", start_seconds=42)

    listing = owner_client.get(f"/orgs/{org.slug}/")
    page = owner_client.get(f"/orgs/{org.slug}/endpoints/sleepy/")

    assert b"scaled to zero; a request wakes it in about 42 s" in listing.content
    assert b"Scaled to zero: no replica runs, none is billed. The next request wakes it and " \
           b"waits about 42 s" in page.content
    # Scaling by hand from zero starts at one replica, the fewest the form takes.
    assert b'id="id_replicas" min="1" max="1" value="1"' in page.content
    assert b"No engine runs while it is scaled to zero." in page.content
    # The shortest idle time is shown before a submit could be refused for it.
    assert b"At least 60 s." in page.content
    assert b'name="scale_to_zero_after_seconds" value="900" min="60"' in page.content


def test_the_replica_timeline_counts_each_phase_from_the_ledger(
        owner_client: Client, org: Organization) -> None:
    endpoint = ready_endpoint(org, "chat", ports=[], max_replicas=2)
    now = timezone.now()
    Endpoint.objects.filter(id=endpoint.id).update(created_at=now - timedelta(hours=3))

    def ago(minutes: int) -> datetime:
        return now - timedelta(minutes=minutes)

    replica_history(endpoint, [(ago(120), State.STARTING), (ago(119), State.READY),
                               (ago(60), State.STOPPING), (ago(59), State.STOPPED)])
    replica_history(endpoint, [(ago(90), State.LOADING), (ago(88), State.READY)])

    data = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/replicas/").json()

    # From the endpoint's creation, then each change, then now.
    assert [round((now.timestamp() - at) / 60) for at in data["times"]] == [
        180, 120, 119, 90, 88, 60, 59, 0]
    assert data["ready"] == [0, 0, 1, 1, 2, 1, 1, 1]
    assert data["starting"] == [0, 1, 0, 1, 0, 0, 0, 0]
    assert data["stopping"] == [0, 0, 0, 0, 0, 1, 0, 0]
    page = owner_client.get(f"/orgs/{org.slug}/endpoints/chat/")
    assert f'data-url="/orgs/{org.slug}/endpoints/chat/replicas/"'.encode() in page.content


def test_the_replica_timeline_is_the_organisations_own(
        owner_client: Client, org: Organization, other_org: Organization) -> None:
    ready_endpoint(other_org, "theirs", ports=[])

    response = owner_client.get(f"/orgs/{other_org.slug}/endpoints/theirs/replicas/")

    assert response.status_code == 404
