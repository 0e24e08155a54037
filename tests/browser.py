"""Browser tests in real headless Chromium: Debian's `chromium` driven by Playwright (its Python
package talks to the browser over CDP; no browser is downloaded) against pytest-django's live
server, which runs the real middleware, templates and static files (htmx, Chart.js).

`console` opens a logged-in page per person; every page records browser console errors, failed
requests and uncaught exceptions, and the test fails on any of them (`assert_clean`).
Screenshots go to STEWARD_TEST_ARTIFACTS (default: test-artifacts/screenshots in the repo)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("STEWARD_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("STEWARD_TEST_ARTIFACTS", ROOT / "test-artifacts"))
PASSWORD = "correct horse battery staple"

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-extensions",
                 "--no-first-run", "--disable-default-apps"]


@pytest.fixture
def chromium() -> Iterator[Any]:
    """A Chromium per test. A missing browser is an error, not a skip: `make test` installs it
    (Makefile target `browser`). Per test, not per session: Playwright's sync API leaves its
    event loop set as the thread's running loop while it is open, which breaks every later
    test that runs asyncio in the main thread."""
    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).exists()):
        raise RuntimeError(f"Chromium not found at {CHROMIUM}: run `make browser` "
                           "(apt-get install chromium) or set STEWARD_CHROMIUM")
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are
    # still synchronous and safe, so Django's async guard is lifted for these tests only.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=CHROMIUM_ARGS)
        yield browser
        browser.close()


# Visible inputs, selects and textareas with neither a <label> nor aria-label(ledby).
UNLABELLED_JS = """() => Array.from(document.querySelectorAll('input, select, textarea'))
  .filter(el => !['hidden', 'submit', 'button'].includes(el.type))
  .filter(el => el.getClientRects().length > 0)
  .filter(el => !((el.labels && el.labels.length) || el.getAttribute('aria-label')
                  || el.getAttribute('aria-labelledby')))
  .map(el => el.outerHTML.slice(0, 120))"""


@dataclass
class ConsolePage:
    page: Any
    base_url: str
    name: str
    problems: list[str] = field(default_factory=list)

    def go(self, path: str) -> Any:
        response = self.page.goto(self.base_url + path)
        assert response is not None and response.status < 400, (path, response and
                                                                  response.status)
        return response

    def shot(self, name: str) -> Path:
        """Screenshot the page, and record any visible form control without a label (every
        main page is shot, so every main page's forms are checked)."""
        unlabelled = self.page.evaluate(UNLABELLED_JS)
        if unlabelled:
            self.problems.append(f"unlabelled form controls on {name}: {unlabelled}")
        out = ARTIFACTS / "screenshots" / f"{name}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(out), full_page=True)
        return out

    def assert_clean(self) -> None:
        assert self.problems == [], f"browser problems on {self.name}'s pages: {self.problems}"


@pytest.fixture
def console(chromium, live_server) -> Iterator[Any]:
    """console(user) -> a ConsolePage logged in through the real login form."""
    contexts = []

    def open_as(user: Any, password: str = PASSWORD) -> ConsolePage:
        context = chromium.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(15_000)
        cp = ConsolePage(page, live_server.url, user.username)
        page.on("console", lambda msg: msg.type == "error" and cp.problems.append(
            f"console: {msg.text}"))
        page.on("pageerror", lambda exc: cp.problems.append(f"pageerror: {exc}"))
        # ERR_ABORTED: the browser cancelled a request because the page navigated on (e.g. the
        # favicon of a page left at once) — not a failure of the server or the page.
        page.on("requestfailed", lambda req: "ERR_ABORTED" not in (req.failure or "")
                and cp.problems.append(f"requestfailed: {req.url} {req.failure}"))
        page.on("response", lambda resp: resp.status >= 500 and cp.problems.append(
            f"HTTP {resp.status}: {resp.url}"))
        cp.go("/login/")
        # By keyboard only: the login form must be usable without a pointer.
        page.get_by_label("Username").focus()
        page.keyboard.type(user.username)
        page.keyboard.press("Tab")
        page.keyboard.type(password)
        page.keyboard.press("Enter")
        page.wait_for_url(live_server.url + "/")
        return cp

    yield open_as
    for context in contexts:
        context.close()
