"""A headless Chromium for the page tests, through Playwright: at /usr/bin/chromium or $TSERVE_CHROMIUM.
Without Playwright or Chromium the tests are skipped, unless $TSERVE_REQUIRE_BROWSER or $CI is set, where they
fail instead."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("TSERVE_CHROMIUM", "/usr/bin/chromium")


def _unavailable(reason: str) -> None:
    if os.environ.get("TSERVE_REQUIRE_BROWSER") or os.environ.get("CI"):
        pytest.fail(f"browser tests are required here: {reason}")
    pytest.skip(reason)


@contextmanager
def chromium() -> Iterator:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[dev]')")
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        _unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        yield b
        b.close()


class PageRefs(HTMLParser):
    """What a page refers to (src, href, action, ...) and the ids it defines."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        for name, value in attrs:
            if name in ("src", "href", "action", "poster", "srcset", "data") and value:
                self.refs.append(value)
            if name == "id" and value:
                self.ids.add(value)
