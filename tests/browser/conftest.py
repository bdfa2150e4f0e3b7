"""A real Chromium (Debian's, which `make test` installs) driven by Playwright. Every page a
test visits is also saved as a screenshot under artifacts/screenshots/, to be looked at."""

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.core import mail
from playwright.sync_api import Browser, Page, expect, sync_playwright

from endpoints.models import Node
from endpoints.services import do_load_catalogs
from engine.devices import HostResources
from fleet.reports import do_register_node
from tests.helpers import ROOT

CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = ROOT / "artifacts" / "screenshots"


# Module scope, not session: Playwright's sync API runs an event loop in this thread while the
# browser lives, and the suites after these need the thread (and the environment) back.
@pytest.fixture(scope="module")
def _allow_orm_beside_playwright() -> Iterator[None]:
    # The ORM calls the tests make beside that loop are plain blocking calls, which Django
    # must be told are fine.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


@pytest.fixture(scope="module")
def browser(_allow_orm_beside_playwright: None) -> Iterator[Browser]:
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
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # the pages' confirmations
    yield page
    context.close()


@pytest.fixture
def shot(page: Page) -> Callable[[str], None]:
    """shot(name): a full-page screenshot of what the page shows now."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(name: str) -> None:
        page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)
    return take


def sign_up(page: Page, base: str, organization: str = "Engines",
            mail_dir: Path | None = None) -> None:
    """Sign up through the page, as a newcomer does, with a new organisation, and confirm the
    address from the mail: from the shared web process's `mail_dir`, else from this
    process's outbox (the live server's)."""
    page.goto(f"{base}/signup/")
    page.get_by_label("Email").fill("ada@example.com")
    page.get_by_label("Password").fill("analytical engine 1843")
    page.get_by_label("Organisation name").fill(organization)
    page.get_by_role("button", name="Sign up").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Endpoints")
    confirm_email(page, base, "ada@example.com", mail_dir)


def confirm_email(page: Page, base: str, address: str, mail_dir: Path | None,
                  shot: Callable[[str], None] | None = None) -> None:
    """Open the last confirmation link mailed to `address`, as its owner does (`shot`: with
    a screenshot of the page it opens)."""
    mails = ([path.read_text() for path in sorted(
        mail_dir.iterdir(), key=lambda path: path.stat().st_mtime_ns)] if mail_dir
             else [message.message().as_string() for message in mail.outbox])
    links = [found.group(1) for text in mails if f"To: {address}" in text
             for found in re.finditer(r"https?://\S+?(/email/verify/\S+/)", text)]
    assert links, f"no confirmation mail to {address}"
    page.goto(f"{base}{links[-1]}")
    expect(page.get_by_role("heading", level=1)).to_have_text("Email address confirmed")
    if shot:
        shot("email-confirmed")
    page.goto(f"{base}/")


@pytest.fixture
def laptop(live_server: object, page: Page) -> Node:
    """A CPU node with the catalogs loaded, and the page signed up as the owner of a new
    organisation, Engines: where most dashboard tests begin."""
    do_load_catalogs()
    node = do_register_node(name="laptop", resources=HostResources(
        devices=[], cpu_count=2, memory_bytes=24 * 2**30))
    sign_up(page, live_server.url)
    return node


def choose_the_demo_model(page: Page) -> None:
    """From an organisation without endpoints: the wizard, with the demo model picked."""
    page.get_by_role("link", name="Create your first endpoint").click()
    wizard_ready(page)
    page.get_by_label("Search").fill("demo")
    page.get_by_text("kvrun demo").click()


def wizard_ready(page: Page) -> None:
    """Wait for the wizard's scripts: its filters and live sizing do nothing before them (a
    person takes longer than they take to load; a test may not)."""
    page.wait_for_load_state()
