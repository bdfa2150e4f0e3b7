"""Dashboard pages in a real Chromium against Django alone (no engine): form errors next to
their fields, sizing that says what would fit, keys shown once, other organisations' 404s,
and the pages at phone width."""

from collections.abc import Callable

import pytest
from playwright.sync_api import Page, expect

from accounts.models import APIKey, Organization
from endpoints.models import Endpoint, Node, Region
from engine.devices import HostResources
from fleet.reports import do_register_node
from tests.browser.conftest import SCREENSHOTS, choose_the_demo_model, sign_up, wizard_ready
from tests.factories import organization_with_owner, ready_endpoint

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_sign_up_errors_show_next_to_their_fields(live_server: object, page: Page,
                                                  shot: Callable[[str], None]) -> None:
    page.goto(f"{live_server.url}/signup/")
    page.get_by_label("Email").fill("not an email")
    page.get_by_label("Password").fill("too short")
    page.get_by_role("button", name="Sign up").click()

    expect(page.locator(".field.invalid", has=page.get_by_label("Email"))).to_contain_text(
        "valid email")
    expect(page.locator(".field.invalid", has=page.get_by_label("Password"))).to_contain_text(
        "too short")
    shot("signup-errors")


def test_the_wizard_explains_an_impossible_sizing_and_what_would_fit(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    page.get_by_role("link", name="Create your first endpoint").click()
    wizard_ready(page)

    page.get_by_label("Search").fill("llama 3.1 8b")
    expect(page.locator(".model-card:visible")).to_have_count(1)
    page.get_by_text("Llama 3.1 8B Instruct").click()
    advice = page.get_by_test_id("sizing-advice")
    expect(advice).to_contain_text("weights need 16 GB")
    expect(advice).to_contain_text("no NVIDIA L4 24 GB node is online")
    expect(advice).to_contain_text("Models that fit what is online: kvrun demo")
    shot("wizard-advice")

    expect(page.get_by_label("Name", exact=True)).to_have_value("llama-3-1-8b-instruct")
    page.get_by_label("Name", exact=True).fill("My Chat!")
    page.get_by_role("button", name="Launch endpoint").click()  # launched anyway: refused
    expect(page.locator("#id_model_error")).to_contain_text("weights need 16 GB")
    expect(page.locator("#id_name_error")).to_contain_text("letters, digits and hyphens")
    assert not Endpoint.objects.exists()
    shot("wizard-errors")
    wizard_ready(page)

    advice.get_by_role("button", name="kvrun demo").click()  # the fitting model, one click
    expect(page.get_by_label("Context length (tokens)")).to_have_value("2048")  # its longest
    expect(page.get_by_test_id("sizing")).to_contain_text("1 × CPU only")
    expect(page.locator('input[value="kvrun-demo-tiny"]')).to_be_checked()
    shot("wizard-sizing")


def test_the_wizard_offers_the_regions_online_and_launches_in_one(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    eu = Region.objects.create(slug="eu-west", name="EU West")
    Region.objects.create(slug="ap-south", name="AP South")  # nothing online there
    Node.objects.filter(id=laptop.id).update(region=eu)
    choose_the_demo_model(page)

    region = page.get_by_label("Region")
    expect(region.locator("option")).to_have_text(["Any region", "EU West"])
    region.select_option("eu-west")
    expect(page.get_by_test_id("sizing")).to_contain_text("1 × CPU only")
    shot("wizard-region")
    page.get_by_role("button", name="Launch endpoint").click()

    expect(page.locator("main")).to_contain_text("CPU only in EU West")
    assert Endpoint.objects.get().region == eu
    # What its engines take, from the demo model's parsers.
    expect(page.get_by_test_id("capabilities")).to_have_text(
        "Tools: yes, any tool_choice (parser llama3_json) · Reasoning: not split from the "
        "answer · Structured outputs: yes, response_format with a JSON schema")
    shot("endpoint-region")
    page.get_by_test_id("capabilities").locator("..").screenshot(
        path=SCREENSHOTS / "endpoint-capabilities.png")


def test_the_wizard_asks_an_embedding_model_for_its_batch_and_its_page_says_how_to_call_it(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    page.get_by_role("link", name="Create your first endpoint").click()
    wizard_ready(page)

    page.get_by_label("Serves").select_option("embed")
    expect(page.locator(".model-card:visible .model-name")).to_have_text(
        ["BGE small en v1.5 (embeddings)", "kvrun embeddings demo (tiny, random weights)",
         "Qwen3 Embedding 0.6B"])
    page.get_by_text("kvrun embeddings demo").click()
    page.get_by_label("Longest input (tokens)").fill("512")
    page.get_by_label("Inputs per batch").fill("8")

    expect(page.get_by_test_id("batch-facts")).to_contain_text(
        "One batch8 inputs × 512 tokens = 4,096 tokens")
    expect(page.get_by_test_id("sizing")).to_contain_text("for a batch of 8 × 512 tokens")
    expect(page.get_by_text("LoRA adapters: fine-tunes served beside the model")).to_be_hidden()
    expect(page.get_by_label("LoRA adapters on the device at once")).to_be_disabled()
    shot("wizard-embeddings")
    page.get_by_role("button", name="Launch endpoint").click()

    endpoint = Endpoint.objects.get()
    assert (endpoint.model.slug, endpoint.context_length, endpoint.concurrency) == (
        "kvrun-demo-embed", 512, 8)
    expect(page.get_by_test_id("capabilities")).to_contain_text(
        "Serves: embeddings (/v1/embeddings, float or base64)")
    expect(page.locator("#snippet-python")).to_contain_text("client.embeddings.create(")
    expect(page.locator("#snippet-curl")).to_contain_text("/v1/embeddings")
    shot("endpoint-embeddings")


def test_an_owner_enrols_a_node_of_the_organisation_s_own_and_an_endpoint_runs_there_alone(
        live_server: object, page: Page, laptop: Node, shot: Callable[[str], None]) -> None:
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Nodes").click()
    expect(page.locator("main")).to_contain_text("has no node of its own")
    page.get_by_label("Node name").fill("our-box")
    page.get_by_role("button", name="Make a join token").click()
    command = page.get_by_test_id("new-node-token")
    expect(command).to_contain_text("KVRUN_JOIN_TOKEN=kvj_")
    expect(command).to_contain_text("--name our-box")
    shot("nodes-token")

    # The host enrols (its agent would, with that token): a CPU node of the organisation's.
    engines = Organization.objects.get(slug="engines")
    do_register_node(name="our-box", resources=HostResources(devices=[], cpu_count=2,
                                                             memory_bytes=24 * 2**30))
    Node.objects.filter(name="our-box").update(organization=engines)
    page.goto(f"{live_server.url}/orgs/engines/nodes/")  # not a reload: that posts again
    expect(page.get_by_test_id("own-nodes")).to_contain_text("our-box")
    shot("nodes")

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Endpoints").click()
    choose_the_demo_model(page)
    page.get_by_label("On our own nodes only").check()
    expect(page.get_by_test_id("sizing")).to_contain_text("$0.00/hour")
    shot("wizard-own-nodes")
    page.get_by_role("button", name="Launch endpoint").click()

    expect(page.locator("main")).to_contain_text("on your own nodes only")
    assert Endpoint.objects.get().own_nodes_only
    shot("endpoint-own-nodes")


def test_a_key_is_shown_once_copied_and_revoked(live_server: object, page: Page,
                                                shot: Callable[[str], None]) -> None:
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    sign_up(page, live_server.url)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="API keys").click()
    page.get_by_label("Name", exact=True).fill("laptop")
    page.get_by_role("button", name="Create key").click()
    copy = page.get_by_test_id("new-key").locator("button.copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    copied = page.evaluate("navigator.clipboard.readText()")
    shot("keys-created")

    key = APIKey.objects.get(name="laptop")
    assert copied.startswith("kvr_") and key.last_four == copied[-4:]
    page.goto(f"{live_server.url}/orgs/engines/keys/")
    expect(page.get_by_test_id("new-key")).to_have_count(0)
    page.get_by_role("button", name="Revoke").click()
    expect(page.get_by_role("status")).to_contain_text("is revoked")
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_another_organisations_endpoint_is_not_found(live_server: object, page: Page,
                                                     shot: Callable[[str], None]) -> None:
    other = organization_with_owner("Globex")
    ready_endpoint(other, "secret-plans", ports=[])
    sign_up(page, live_server.url)

    response = page.goto(f"{live_server.url}/orgs/{other.slug}/endpoints/secret-plans/")

    assert response.status == 404
    expect(page.locator("body")).not_to_contain_text("secret-plans")


def test_pages_fit_a_phone_and_show_keyboard_focus(live_server: object, page: Page,
                                                   shot: Callable[[str], None]) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    sign_up(page, live_server.url)
    for path in ("", "endpoints/new/", "keys/", "members/"):
        page.goto(f"{live_server.url}/orgs/engines/{path}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"/{path} scrolls sideways at phone width ({width}px)"
        shot(f"phone-{path.strip('/').replace('/', '-') or 'endpoints'}")
    page.keyboard.press("Tab")
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"


def test_buttons_that_need_a_script_wait_for_it(live_server: object, page: Page,
                                                shot: Callable[[str], None]) -> None:
    sign_up(page, live_server.url)
    ready_endpoint(Organization.objects.get(slug="engines"), "chat", ports=[])
    page.route("**/js/*.js", lambda route: None)  # held, until unrouted

    # Pages are usable while their scripts are on their way. A Send clicked then submitted the
    # playground's form itself, putting the message and the CSRF token in the address; a
    # Copy clicked then did nothing.
    page.goto(f"{live_server.url}/orgs/engines/endpoints/chat/playground/",
              wait_until="commit")
    page.get_by_label("Message").fill("Hello")
    send = page.get_by_role("button", name="Send")
    expect(send).to_be_disabled()
    send.click(force=True)
    expect(page.get_by_label("Message")).to_have_value("Hello")  # still here, nothing sent
    page.goto(f"{live_server.url}/orgs/engines/endpoints/chat/", wait_until="commit")
    copy = page.locator("#snippet-python + button")
    expect(copy).to_be_disabled()

    page.unroute("**/js/*.js")  # lets the held scripts through
    expect(copy).to_be_enabled()
    page.goto(f"{live_server.url}/orgs/engines/endpoints/chat/playground/")
    expect(send).to_be_enabled()
    shot("playground-ready")
