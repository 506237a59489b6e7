"""A real browser for the page tests (views and report): Playwright driving Debian's Chromium through
``executable_path``, so no browser is downloaded. A page is served through a route that answers only the page
itself: any other request (a CDN, a font, a favicon) is recorded and refused, and so are console errors."""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import matplotlib.image as mpimg
import numpy as np
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
URL = "http://interp.test/index.html"  # never reaches a network: the route below answers it


@contextmanager
def chromium():
    """A headless Chromium; the test fails (is not skipped) when there is none."""
    if CHROMIUM is None:
        pytest.fail("Chromium is needed for the page tests (Debian package `chromium`; .ci/run installs it).")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


class Page:
    """``html`` opened offline; ``errors`` and ``requests`` collect what must stay empty."""

    def __init__(self, browser, html: str, width: int = 1280, height: int = 900):
        self.errors, self.requests = [], []
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        body = html.encode()

        def answer(route):
            if route.request.url == URL:
                route.fulfill(status=200, content_type="text/html; charset=utf-8", body=body)
            else:
                self.requests.append(route.request.url)
                route.abort()

        self.page.route("**/*", answer)
        self.page.goto(URL)
        self.page.wait_for_function("[...document.querySelectorAll('.interp-view')].every(v => v.dataset.ready)")

    def check_clean(self):
        assert self.errors == [] and self.requests == [], (self.errors, self.requests)

    def squares(self, side: str) -> dict[tuple[int, int], float]:
        """{(token position, head): weight} shown in the squares beside the ``side`` column of a head view."""
        found = self.page.eval_on_selector_all(
            f'[data-role="{side}"] .iv-sq[data-weight]',
            "els => els.map(e => [+e.closest('[data-token]').dataset.token, +e.dataset.head, +e.dataset.weight])")
        return {(t, h): w for t, h, w in found}

    def smallest_text(self) -> float:
        """The smallest computed font size (px) of any element with text of its own."""
        return self.page.evaluate("""() => Math.min(...[...document.querySelectorAll('body *')]
            .filter(e => [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()))
            .filter(e => e.getClientRects().length)
            .map(e => parseFloat(getComputedStyle(e).fontSize)))""")

    def screenshot(self, path, min_colours: int = 30):
        """A full-page screenshot at ``path`` that is not blank."""
        self.page.screenshot(path=str(path), full_page=True)
        pixels = mpimg.imread(path)[..., :3]
        assert pixels.std() > 0.05, "blank screenshot"
        assert len(np.unique((pixels[::3, ::3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > min_colours

    def close(self):
        self.page.close()
