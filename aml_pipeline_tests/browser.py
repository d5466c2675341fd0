"""A real browser for the UI tests: Debian's chromium, headless, driven by Playwright.

No browser is downloaded: Playwright launches ``/usr/bin/chromium`` (``scripts/system_packages.sh``
installs it) with the flags this machine needs (no sandbox as root, no background networking on a
closed network, a fresh profile).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    return path


@contextmanager
def browser_page(width: int = 1600, height: int = 1200) -> Iterator[Any]:
    """A page of a headless chromium with a fresh profile, closed at the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        try:
            yield browser.new_context(viewport={"width": width, "height": height}).new_page()
        finally:
            browser.close()


def dismiss_dialogs(page: Any) -> None:
    """Dagster's first-visit dialog (community, newsletter), if it shows, skipped as a person would."""
    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(timeout=3000)
    except Exception:  # noqa: BLE001 - Playwright's TimeoutError: the dialog did not show
        return
    skip.click()
