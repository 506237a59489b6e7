"""The long-sequence view (analyses.views.long) on a real model: build time, page size, first paint, a screenshot.

The prompt is BOS + x + x (x random ordinary tokens), so induction heads draw a diagonal half a prompt back.
First paint is the browser's ``first-contentful-paint`` (Playwright with Debian's Chromium, as tests/browser.py).

    python benchmarks/bench_long_view.py --model smollm2 --n 8192 --layer 18 --out long.html --png long.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import interp  # noqa: E402
from analyses.views.long import long_view  # noqa: E402
from bench_long_context import _prompt  # noqa: E402


def first_paint(path: Path, png: Path | None, head: int = 6) -> float:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 620})
        page.goto(path.resolve().as_uri())
        page.wait_for_load_state("load")
        entry = "performance.getEntriesByName('first-contentful-paint')[0]"
        page.wait_for_function(f"{entry} !== undefined", timeout=60_000)  # a big page paints after its load event
        paint = page.evaluate(f"{entry}.startTime")
        if png is not None:
            chosen = f'[data-role="head"][data-head="{head}"]'
            page.click(chosen) if page.locator(chosen).count() else None
            page.screenshot(path=str(png))
        browser.close()
    return paint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--layer", type=int, default=18)
    parser.add_argument("--out", type=Path, default=Path("long.html"))
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--head", type=int, default=6, help="the head selected in the screenshot")
    args = parser.parse_args()
    model = interp.load_model(args.model, attn="flash")
    ids = _prompt(model, args.n)
    start = time.perf_counter()
    view = long_view(model, ids, layer=args.layer)
    built = time.perf_counter() - start
    view.save(args.out, overwrite=True)  # the benchmark rewrites its own page
    size = args.out.stat().st_size
    paint = first_paint(args.out, args.png, args.head)
    print(f"{args.model} layer {args.layer}, {args.n} tokens, threads {os.environ.get('OMP_NUM_THREADS')}: built in "
          f"{built:.1f} s (forward to the layer included), page {size / 1e6:.2f} MB, first paint {paint:.0f} ms; "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
