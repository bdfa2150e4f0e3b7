"""The operators' console for the fleet, in a real browser: a join token shown once, and a
node revoked."""

from collections.abc import Callable

import pytest
from playwright.sync_api import Page, expect
from rest_framework.test import APIClient

from accounts.models import User
from endpoints.models import Node, NodeState, Region
from endpoints.services import do_load_catalogs
from fleet.models import NodeCredential
from tests.factories import organization_with_owner
from tests.fleet.helpers import host

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_operator_enrols_a_node_with_a_join_token_and_revokes_it(
        live_server: object, page: Page, shot: Callable[[str], None]) -> None:
    do_load_catalogs()
    User.objects.create_superuser(email="operator@example.com", password="console 2026 pass")
    page.goto(f"{live_server.url}/admin/login/?next=/admin/fleet/jointoken/add/")
    page.get_by_label("Email").fill("operator@example.com")
    page.get_by_label("Password").fill("console 2026 pass")
    page.get_by_role("button", name="Log in").click()

    eu = Region.objects.create(slug="eu-west", name="EU West")
    acme = organization_with_owner("Acme")
    page.reload()
    page.get_by_label("Node name").fill("gpu-node-7")
    page.get_by_label("Region").select_option(label="EU West")
    page.get_by_label("Zone").fill("eu-west-1a")
    page.get_by_label("Organization").select_option(label="Acme")
    page.get_by_label("Minutes").fill("30")
    shot("console-join-token-add")
    page.get_by_role("button", name="Save", exact=True).click()

    shown = page.locator(".messagelist .warning")
    expect(shown).to_contain_text("Join token for node gpu-node-7 (shown once")
    shot("console-join-token-shown")
    token = next(word.rstrip(".") for word in shown.inner_text().split()
                 if word.startswith("kvj_"))
    enrolled = APIClient().post("/node/v1/enrol", {"join_token": token, "name": "gpu-node-7",
                                                   **host()}, format="json")
    assert enrolled.status_code == 201
    node = Node.objects.get(name="gpu-node-7")
    assert (node.region, node.zone, node.organization) == (eu, "eu-west-1a", acme)
    page.reload()  # shown once: gone on the next page
    expect(page.locator(".messagelist")).to_have_count(0)
    expect(page.locator("#result_list tbody tr td.field-used_at")).not_to_have_text("-")

    page.goto(f"{live_server.url}/admin/endpoints/node/")
    expect(page.locator("#result_list tbody tr td.field-region")).to_have_text("EU West")
    expect(page.locator("#result_list tbody tr td.field-owner")).to_have_text("acme")
    shot("console-nodes-region")

    page.goto(f"{live_server.url}/admin/billing/gpuprice/add/")
    page.get_by_label("Gpu type").select_option(label="NVIDIA H100 80 GB")
    page.get_by_label("Region").select_option(label="EU West")
    shot("console-gpu-price-regional")

    page.goto(f"{live_server.url}/admin/fleet/nodecredential/")
    page.locator("#result_list tbody input[type=checkbox]").first.check()
    page.get_by_label("Action:").select_option("revoke_nodes")
    page.get_by_role("button", name="Go").click()
    expect(page.locator(".messagelist .success")).to_contain_text(
        "Revoked 1 node(s); 0 replica(s) are moving to other nodes.")
    shot("console-node-credentials-revoked")
    assert Node.objects.get(name="gpu-node-7").state == NodeState.REVOKED
    assert NodeCredential.objects.get().revoked_at is not None
