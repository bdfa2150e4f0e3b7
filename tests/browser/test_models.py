"""A model of one's own, in a real Chromium on the real stack: paste a Hugging Face id in the
wizard, see it sized with room for LoRA adapters, launch it, watch its weights download, add
an adapter on its page and chat with the model and the adapter in the playground. The hub is
the one on loopback (bench/hub_server.py)."""

import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from bench.hub_server import Hub
from billing.models import UsageRecord
from billing.rollup import do_roll_up_usage
from billing.tasks import ingest_usage
from endpoints.models import Endpoint, ModelSpec, Node, State
from engine import demo_model, lora
from tests.browser.conftest import sign_up, wizard_ready
from tests.helpers import drive, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

READY_WITHIN = 240


def test_a_pasted_hugging_face_id_is_sized_launched_downloaded_and_chatted_with_an_adapter(
        web: str, web_mail: Path, ready_node: Node, hub: Hub, page: Page,
        shot: Callable[[str], None], tmp_path: Path) -> None:
    folder = shutil.copytree(hub.root / "kvrun/demo" / hub.commit_of("kvrun/demo", "main"),
                             tmp_path / "demo")
    (folder / "generation_config.json").write_text(f'{{"run": "{uuid.uuid4()}"}}')
    repo = f"acme/tiny-{uuid.uuid4().hex[:6]}"  # never downloaded before: the cache outlives runs
    commit = hub.publish(repo, folder)
    sign_up(page, web, organization="Own models", mail_dir=web_mail)
    page.get_by_role("link", name="Create your first endpoint").click()
    wizard_ready(page)

    page.get_by_text("Not in the catalog? Paste a Hugging Face id").click()
    page.get_by_label("Hugging Face id").fill("acme/not-there")
    page.get_by_role("button", name="Add and size it").click()
    expect(page.get_by_role("alert").first).to_contain_text(
        "No repository acme/not-there on the hub, or it is private")
    shot("models-01-refused")
    page.get_by_label("Hugging Face id").fill(repo)
    page.get_by_role("button", name="Add and size it").click()

    expect(page.get_by_text(f"Added {repo}, pinned at commit {commit[:12]}")).to_be_visible()
    wizard_ready(page)
    model = ModelSpec.objects.get(hf_repo=repo)
    expect(page.locator(f'input[name="model"][value="{model.slug}"]')).to_be_checked()
    expect(page.get_by_text("your organisation's")).to_be_visible()
    sizing = page.get_by_test_id("sizing")
    expect(sizing).to_contain_text("1 × CPU only")
    page.get_by_label("Context length (tokens)").fill("2048")
    page.get_by_label("Hardware").select_option("cpu")  # not the catalog's, were the node late
    page.get_by_text("LoRA adapters: fine-tunes served beside the model").click()
    page.get_by_label("LoRA adapters on the device at once").fill("2")
    page.get_by_label("Largest adapter rank").select_option("8")
    expect(sizing).to_contain_text("2 adapter(s) of rank 8")
    expect(page.locator(".memory").first).to_have_attribute("aria-label",
                                                            re.compile("LoRA adapters"))
    page.get_by_label("Name", exact=True).fill("mine")
    shot("models-02-sized")
    hub.rate_bytes_per_second = 128 * 1024  # about twelve seconds: long enough to watch
    try:
        page.get_by_role("button", name="Launch endpoint").click()
        expect(page.get_by_role("heading", level=1)).to_have_text("mine")
        expect(page.get_by_test_id("progress")).to_contain_text("downloading weights:",
                                                                timeout=60_000)
        shot("models-03-downloading")
    finally:
        hub.rate_bytes_per_second = None
    assert drive(lambda: Endpoint.objects.get(name="mine").state == State.READY, READY_WITHIN)
    expect(page.get_by_test_id("state")).to_have_text("ready", timeout=10_000)

    # An adapter of this model, added on its page, reaches the running replica.
    hub.publish(f"{repo}-legal", lora.build_demo_adapter(
        tmp_path / "legal", seed=7, base_model=repo, shape=demo_model.lora_shape()))
    page.get_by_text("Add an adapter from Hugging Face").click()
    page.locator("#adapter-hub").get_by_label("Adapter name").fill("legal")
    page.locator("#adapter-hub").get_by_label("Hugging Face id").fill(f"{repo}-legal")
    page.get_by_role("button", name="Add adapter").click()
    expect(page.locator(".flash.success")).to_contain_text("Adapter legal added from")
    # A second one, uploaded from its two files.
    support = lora.build_demo_adapter(tmp_path / "support", seed=8, base_model=repo,
                                      shape=demo_model.lora_shape())
    page.get_by_text("Upload an adapter").click()
    upload = page.locator("#adapter-upload")
    upload.get_by_label("Adapter name").fill("support")
    upload.get_by_label(lora.CONFIG_FILE).set_input_files(support / lora.CONFIG_FILE)
    upload.get_by_label(lora.WEIGHTS_FILE).set_input_files(support / lora.WEIGHTS_FILE)
    page.get_by_role("button", name="Upload adapter").click()
    expect(page.locator(".flash.success")).to_contain_text("Adapter support added from")
    endpoint = Endpoint.objects.get(name="mine")
    assert drive(lambda: endpoint.replicas.filter(state=State.READY,
                                                  adapters=["legal", "support"]).exists(), 30)
    page.reload()
    expect(page.locator("#adapters tbody tr")).to_have_count(3)
    expect(page.locator("#adapters")).not_to_contain_text("0 of 1 ready replica")
    shot("models-04-adapters")

    page.get_by_role("link", name="Open the playground").click()
    page.get_by_label("Message").fill("Hello, model of my own")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".message.assistant .stats")).to_contain_text("TTFT", timeout=60_000)
    assert page.locator(".message.assistant .content").inner_text().strip()
    page.get_by_label("Model", exact=True).select_option("legal")
    page.get_by_label("Message").fill("Hello, fine-tuned model")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".message.assistant .stats").nth(1)).to_contain_text("TTFT",
                                                                             timeout=60_000)
    assert page.locator(".message.assistant .content").nth(1).inner_text().strip()
    page.get_by_label("Model", exact=True).select_option("support")
    page.get_by_label("Message").fill("Hello, support")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".message.assistant .stats").nth(2)).to_contain_text("TTFT",
                                                                             timeout=60_000)
    shot("models-05-playground")

    # Usage per adapter, on the usage page.
    def recorded() -> bool:
        ingest_usage.delay()
        return UsageRecord.objects.filter(endpoint=endpoint, status_code=200).values(
            "adapter").distinct().count() == 3
    assert wait_until(recorded, 30, interval=0.5)
    do_roll_up_usage()
    page.get_by_role("link", name="Usage & billing").click()
    tokens = page.locator("section", has=page.get_by_role("heading", name=re.compile(
        "by endpoint and adapter")))
    for model in ("mine", "mine:legal", "mine:support"):
        expect(tokens.get_by_role("cell", name=model, exact=True)).to_be_visible()
    shot("models-06-usage")
