"""Regions on the real stack: two node agents on this machine, each in the region its join
token names; an endpoint that requires one runs on that region's node, and the sizing and
the wizard offer what is online in each region. An organisation's own node, enrolled by the
token its page makes, runs its endpoint that requires its own nodes."""

from pathlib import Path

import pytest
from django.test import Client
from rest_framework.test import APIClient

from accounts.models import Organization, User
from endpoints.models import Node, Region, Replica, ReplicaInterval, State
from tests.e2e.test_provisioning import delete_and_settle, ready_replica, state_of
from tests.helpers import drive, start_agent, stop_agent, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

READY_WITHIN = 180


def test_an_endpoint_that_requires_a_region_runs_on_that_region_s_node(
        ready_node: Node, web: str, owner: User, owner_api: APIClient, org: Organization,
        engine_logs: Path) -> None:
    eu = Region.objects.create(slug="eu-west", name="EU West")
    us = Region.objects.create(slug="us-east", name="US East")
    Node.objects.filter(id=ready_node.id).update(region=us)  # the suite's node, in the US
    other = start_agent("e2e-eu", engine_logs, web=web, region=eu)
    try:
        assert wait_until(lambda: Node.objects.filter(name="e2e-eu", state="online",
                                                      region=eu).exists(), 60)
        listed = owner_api.get("/api/v1/regions/").json()["results"]
        assert [(row["slug"], row["online_gpu_types"]) for row in listed] == [
            ("eu-west", ["cpu"]), ("us-east", ["cpu"])]
        # The wizard offers both regions, each with what is online there.
        browser = Client()
        browser.force_login(owner)
        page = browser.get(f"/orgs/{org.slug}/endpoints/new/?model=kvrun-demo-tiny")
        assert '<option value="eu-west">EU West</option>' in page.content.decode()
        sized = browser.post(f"/orgs/{org.slug}/endpoints/new/sizing/", {
            "model": "kvrun-demo-tiny", "context_length": 2048, "concurrency": 4,
            "kv_cache_dtype": "auto", "region": "eu-west"})
        assert "1 × CPU only" in sized.content.decode()

        created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
            "name": "euro", "model": "kvrun-demo-tiny", "context_length": 2048,
            "concurrency": 4, "region": "eu-west"}, format="json")
        assert created.status_code == 201, created.content

        assert drive(lambda: state_of("euro") == State.READY, READY_WITHIN)
        replica = ready_replica("euro")
        assert replica.node.name == "e2e-eu"
        assert not Replica.objects.filter(endpoint__name="euro", node=ready_node).exists()
        delete_and_settle(owner_api, org, "euro")
    finally:
        stop_agent(other, "e2e-eu")


def test_an_organisation_s_own_node_enrolled_from_its_page_runs_its_endpoint_alone(
        ready_node: Node, web: str, owner: User, owner_api: APIClient, org: Organization,
        engine_logs: Path) -> None:
    browser = Client()
    browser.force_login(owner)
    made = browser.post(f"/orgs/{org.slug}/nodes/token/", {"node_name": "e2e-own"})
    own = start_agent("e2e-own", engine_logs, web=web,
                      join_token=made.context["created"]["secret"])
    try:
        assert wait_until(lambda: Node.objects.filter(name="e2e-own", state="online",
                                                      organization=org).exists(), 60)
        assert "e2e-own" in browser.get(f"/orgs/{org.slug}/nodes/").content.decode()
        created = owner_api.post(f"/api/v1/organizations/{org.slug}/endpoints/", {
            "name": "ours", "model": "kvrun-demo-tiny", "context_length": 2048,
            "concurrency": 4, "own_nodes_only": True}, format="json")
        assert created.status_code == 201, created.content

        assert drive(lambda: state_of("ours") == State.READY, READY_WITHIN)
        replica = ready_replica("ours")
        assert replica.node.name == "e2e-own"
        page = browser.get(f"/orgs/{org.slug}/nodes/").content.decode()
        assert "ours</a> <span class=\"muted\">ready" in page
        delete_and_settle(owner_api, org, "ours")
        assert set(ReplicaInterval.objects.filter(endpoint__name="ours")
                   .values_list("own_node", flat=True)) == {True}
    finally:
        stop_agent(own, "e2e-own")
