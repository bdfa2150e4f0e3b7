"""The whole journey a newcomer makes, in a real Chromium on the real stack: the web process
(dashboard and gateway), PostgreSQL, Redis, the control worker, a node agent and a real vLLM
CPU engine.

sign up → confirm the address from the mail → create an endpoint in the wizard → the progress
bar reaches ready → the playground streams an answer → the charts show the request → create an
API key → the copied Python snippet, run as a script, gets an answer → a budget below the
month's cost stops the endpoint and the gateway refuses the snippet with the budget's message →
revoke the key → the snippet is refused.
"""

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from accounts.models import APIKey, KeyPurpose
from billing.invoicing import month_bounds, month_of
from billing.models import GPUPrice, TokenHour, UsageRecord
from billing.tasks import ingest_usage, roll_up_usage
from endpoints.models import Endpoint, Node, Replica, State
from tests.browser.conftest import choose_the_demo_model, confirm_email
from tests.helpers import api_servers, drive, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

READY_WITHIN = 180


def run_snippet(code: str, secret: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env={"KVRUN_API_KEY": secret, "PATH": "/usr/bin:/bin"})


def test_a_newcomer_goes_from_sign_up_to_a_working_snippet(
        web: str, web_mail: Path, ready_node: Node, page: Page, shot: Callable[[str], None],
        tmp_path: Path) -> None:
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.goto(f"{web}/signup/")
    shot("journey-01-signup")
    page.get_by_label("Email").fill("newcomer@example.com")
    page.get_by_label("Password").fill("first endpoint today")
    page.get_by_label("Organisation name").fill("Newcomers")
    page.get_by_role("button", name="Sign up").click()
    expect(page.get_by_test_id("unconfirmed-email")).to_contain_text("newcomer@example.com")
    shot("journey-02-no-endpoints")
    confirm_email(page, web, "newcomer@example.com", web_mail, shot)
    expect(page.get_by_test_id("unconfirmed-email")).to_have_count(0)

    choose_the_demo_model(page)
    page.get_by_label("Context length (tokens)").fill("2048")
    sizing = page.get_by_test_id("sizing")
    expect(sizing).to_contain_text("1 × CPU only")
    expect(sizing).to_contain_text("$0.10/hour")
    page.get_by_label("Name", exact=True).fill("first")
    shot("journey-03-wizard")
    page.get_by_role("button", name="Launch endpoint").click()

    # The endpoint page: a live stage and percent, no invented ETA on a first start.
    expect(page.get_by_role("heading", level=1)).to_have_text("first")
    expect(page.get_by_test_id("progress")).to_contain_text("%")
    expect(page.get_by_test_id("progress")).to_contain_text("no estimate yet")
    shot("journey-04-starting")
    endpoint = Endpoint.objects.get(name="first")
    assert drive(lambda: Endpoint.objects.get(id=endpoint.id).state == State.READY,
                 READY_WITHIN), "the endpoint did not become ready"
    expect(page.get_by_test_id("state")).to_have_text("ready", timeout=10_000)
    expect(page.get_by_role("progressbar")).to_have_count(0)
    # What kvrun sized is what the engine allocated: on a CPU node, the KV the policy needs
    # (8 requests of 2,048 tokens), to the block.
    expect(page.get_by_test_id("engine-kv")).to_contain_text(
        "16,384 tokens: 8 requests of 2,048 tokens")
    shot("journey-05-ready")

    page.get_by_role("link", name="Open the playground").click()
    page.get_by_label("Message").fill("Hello, who are you?")
    page.get_by_role("button", name="Send").click()
    stats = page.locator(".message.assistant .stats")
    expect(stats).to_contain_text("TTFT", timeout=60_000)
    expect(stats).to_contain_text("tokens/s")
    expect(stats).to_contain_text("completion tokens")
    assert page.locator(".message.assistant .content").inner_text().strip()
    shot("journey-06-playground")
    playground_key = APIKey.objects.get(purpose=KeyPurpose.PLAYGROUND)
    assert playground_key.endpoint_names == ["first"]

    # The request is in the usage ledger, on the playground's own key, and on the charts.
    def recorded() -> bool:
        ingest_usage.delay()
        return UsageRecord.objects.filter(endpoint=endpoint).exists()
    assert wait_until(recorded, 30, interval=0.5)
    assert UsageRecord.objects.get(endpoint=endpoint).api_key_id == playground_key.id
    page.get_by_role("link", name="first").click()
    expect(page.locator("#usage-totals")).to_contain_text("1 request,")
    expect(page.locator("#charts canvas")).to_have_count(4)
    shot("journey-07-charts")

    # The usage page has the request's tokens and what the endpoint has cost this month, and
    # the draft invoice the GPU time behind it.
    def rolled_up() -> bool:
        roll_up_usage.delay()
        return TokenHour.objects.filter(endpoint=endpoint, requests=1).exists()
    assert wait_until(rolled_up, 30, interval=0.5)
    nav = page.get_by_role("navigation", name="Main")
    nav.get_by_role("link", name="Usage & billing").click()
    expect(page.get_by_test_id("month-so-far")).to_contain_text("$")
    expect(page.locator("#daily-charts canvas")).to_have_count(2)
    tokens = TokenHour.objects.get(endpoint=endpoint)
    assert page.evaluate("JSON.parse(document.getElementById('daily-usage').textContent)"
                         ".completion_tokens.at(-1)") == tokens.completion_tokens
    shot("journey-08-billing")
    page.get_by_role("cell", name="draft").locator("xpath=..").get_by_role("link").first.click()
    expect(page.get_by_role("table")).to_contain_text("first: CPU only, ready")
    expect(page.get_by_test_id("invoice-total")).to_contain_text("$")
    shot("journey-09-invoice")

    nav.get_by_role("link", name="API keys").click()
    page.get_by_label("Name", exact=True).fill("script")
    page.get_by_role("button", name="Create key").click()
    copy = page.get_by_test_id("new-key").locator("button.copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    secret = page.evaluate("navigator.clipboard.readText()")
    shot("journey-10-key")

    nav.get_by_role("link", name="Endpoints").click()
    shot("journey-11-endpoints")
    page.get_by_role("link", name="first").click()
    copy = page.locator("#snippet-python + button")
    copy.click()
    expect(copy).to_have_text("Copied")
    snippet = page.evaluate("navigator.clipboard.readText()")
    answered = run_snippet(snippet, secret, tmp_path)
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout.strip()

    # An operator's price of $1 a second makes the month cost more than a $1.00 budget set to
    # stop: the endpoint stops, every page says why, and the gateway refuses the snippet with
    # the budget's message (once the key's cached state has expired).
    GPUPrice.objects.create(gpu_type=endpoint.gpu_type, hourly_price_usd=3600,
                            effective_from=month_bounds(month_of(timezone.now()))[0])
    nav.get_by_role("link", name="Usage & billing").click()
    page.get_by_label("Monthly limit (USD)").fill("1.00")
    page.get_by_label("At 100 %").select_option("stop")
    page.get_by_role("button", name="Set a budget").click()
    expect(page.get_by_test_id("billing-hold")).to_contain_text(
        "monthly budget of $1.00 is reached")
    shot("journey-12-budget")
    refusals: list[str] = []

    def refused_for_the_budget() -> bool:
        refusals.append(run_snippet(snippet, secret, tmp_path).stderr)
        return "monthly budget of $1.00 is reached" in refusals[-1]
    assert wait_until(refused_for_the_budget, 30, interval=1), refusals[-1]
    assert "402" in refusals[-1]
    assert drive(lambda: Endpoint.objects.get(id=endpoint.id).state == State.STOPPED, 60)

    nav.get_by_role("link", name="API keys").click()
    page.get_by_role("button", name="Revoke").click()
    expect(page.get_by_role("status")).to_contain_text("is revoked")
    refused = run_snippet(snippet, secret, tmp_path)
    assert refused.returncode != 0
    assert "401" in refused.stderr or "invalid_api_key" in refused.stderr

    # Delete it from its page; its engine goes and nothing is left running.
    nav.get_by_role("link", name="Endpoints").click()
    page.get_by_role("link", name="first").click()
    page.get_by_role("button", name="Delete").click()
    expect(page.get_by_role("status")).to_contain_text("Deleted first")
    assert drive(lambda: not api_servers("first") and not Replica.objects.filter(
        endpoint=endpoint).exclude(state=State.STOPPED).exists(), 60)
