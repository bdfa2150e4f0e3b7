"""A person signs up, creates an API key, sees it once and revokes it, in a real Chromium."""

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from accounts.models import APIKey

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(autouse=True)
def _allow_orm_beside_playwright(monkeypatch: pytest.MonkeyPatch) -> None:
    # Playwright's sync API runs an event loop in this thread; the ORM calls made by the
    # assertions below are plain blocking calls, which Django must be told are fine here.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    page = context.new_page()
    yield page
    context.close()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_sign_up_create_a_key_and_revoke_it(live_server: object, page: Page) -> None:
    page.goto(f"{live_server.url}/signup/")
    page.get_by_label("Email").fill("ada@example.com")
    page.get_by_label("Password").fill("too short")
    page.get_by_role("button", name="Sign up").click()
    expect(page.locator(".errors")).to_contain_text("too short")

    page.get_by_label("Password").fill("analytical engine 1843")
    page.get_by_label("Organisation name").fill("Engines")
    page.get_by_role("button", name="Sign up").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("Engines")

    page.get_by_label("Name").fill("laptop")
    page.get_by_label("Scope").select_option("inference")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#new-key-secret").inner_text()
    assert secret.startswith("kvr_")
    key = APIKey.objects.get(name="laptop")
    assert key.last_four == secret[-4:]

    page.goto(f"{live_server.url}/")
    expect(page.locator("#new-key-secret")).to_have_count(0)
    page.get_by_role("button", name="Revoke").click()
    expect(page.get_by_role("status")).to_contain_text("is revoked")
    key.refresh_from_db()
    assert key.revoked_at is not None
