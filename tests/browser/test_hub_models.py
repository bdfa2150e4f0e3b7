"""A gated model at a pinned revision, added in the wizard with its access token, in a real
Chromium: refused without a granted token, then added, pinned and sized; the token is kept
sealed and never shown again. Nothing starts: the hub is the one on loopback."""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from bench.hub_server import Hub
from endpoints.models import ModelSpec, Node
from engine import demo_model
from engine.devices import HostResources
from fleet.reports import do_register_node
from kvrun.common.sealing import unseal
from tests.browser.conftest import wizard_ready
from tests.conftest import TEST_BUILD

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TOKEN = "hf_granted_reader_7731"


def test_a_gated_model_at_a_revision_is_added_in_the_wizard_with_a_granted_token(
        live_server: object, page: Page, laptop: Node, hub: Hub, hub_url: str,
        shot: Callable[[str], None], tmp_path: Path) -> None:
    # The laptop's vLLM build read and its model cache given: a model is added only where a
    # node online can fetch and run it.
    do_register_node(name=laptop.name, resources=HostResources(
        devices=[], cpu_count=2, memory_bytes=24 * 2**30), build=TEST_BUILD,
        model_cache_bytes=100 * 2**30)
    folder = shutil.copytree(demo_model.build(tmp_path / "demo"), tmp_path / "gated")
    tagged = hub.publish("acme/gated-tiny", folder, gated=True, readers=(TOKEN,),
                         tags=("v1",))
    (folder / "generation_config.json").write_text('{"temperature": 0.5}')
    hub.publish("acme/gated-tiny", folder, gated=True, readers=(TOKEN,))
    page.get_by_role("link", name="Create your first endpoint").click()
    wizard_ready(page)
    page.get_by_text("Not in the catalog? Paste a Hugging Face id").click()
    page.get_by_label("Hugging Face id").fill("acme/gated-tiny")
    page.get_by_label("Revision (optional)").fill("v1")

    page.get_by_role("button", name="Add and size it").click()
    expect(page.get_by_role("alert").first).to_contain_text(
        "acme/gated-tiny is gated: request access on its hub page, then add an access token")
    assert not ModelSpec.objects.filter(hf_repo="acme/gated-tiny").exists()
    shot("models-gated-refused")

    page.get_by_label("Access token (optional)").fill(TOKEN)
    # The parsers offered are those of the nodes' vLLM; the family's is the default.
    parser = page.get_by_label("Tool-call parser")
    expect(parser.locator("option")).to_have_text([
        "Its family's", "None", "hermes", "llama3_json"])
    parser.select_option("none")
    shot("models-parsers-chosen")
    page.get_by_role("button", name="Add and size it").click()

    expect(page.get_by_text(f"Added acme/gated-tiny, pinned at commit {tagged[:12]}")
           ).to_be_visible()
    wizard_ready(page)
    model = ModelSpec.objects.get(hf_repo="acme/gated-tiny")
    assert (model.hf_revision, model.hf_commit) == ("v1", tagged)
    assert (model.tool_call_parser, model.reasoning_parser) == ("", "")
    assert unseal(model.hf_token_sealed) == TOKEN
    expect(page.locator(f'input[name="model"][value="{model.slug}"]')).to_be_checked()
    expect(page.get_by_test_id("sizing")).to_contain_text("1 × CPU only")
    assert TOKEN not in page.content()
    shot("models-gated-added")
