"""The interactive views' numbers (issue 14): SmolLM2's 270-head grid on 64 tokens and head views on 512 tokens,
built and saved from Python, then opened from the file in headless Chromium (Playwright driving Debian's
``chromium``).

    python benchmarks/bench_views.py --threads 2 [--repeats 3] [--screenshots notebooks]

In the browser: first paint is the page's ``first-paint`` entry; interactive is the page's own clock
(``performance.now()``, from navigation start) when the view's script has drawn everything (``data-ready-ms``);
a response is timed in the page from dispatching the event to the next frame after the handler ran, and from
Python (Playwright's hover or click until the page shows the answer), which adds the round trip to the browser.
Medians over ``--repeats`` fresh pages. ``--screenshots DIR`` also writes the README's pictures of the views.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import interp
from analyses import detect_heads
from analyses.data.prompts import repeated_random_tokens
from analyses.views import attention_grid, head_view

RESPOND = """async ([selector, type, fx, fy]) => {
  const el = document.querySelector(selector), r = el.getBoundingClientRect();
  const init = {bubbles: true, clientX: r.left + fx * r.width, clientY: r.top + fy * r.height};
  const t0 = performance.now();
  el.dispatchEvent(new MouseEvent(type, init));
  await new Promise((done) => requestAnimationFrame(() => setTimeout(done, 0)));
  return performance.now() - t0;
}"""


def open_page(browser, path: Path) -> tuple[object, dict]:
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector(".interp-view[data-ready]")
    paint = page.evaluate("() => (performance.getEntriesByName('first-paint')[0] || {}).startTime")
    ready = float(page.get_attribute(".interp-view", "data-ready-ms"))
    if errors:
        raise RuntimeError(f"the page raised: {errors}")
    return page, {"first paint ms": paint, "interactive ms": ready}


def measure(browser, path: Path, actions, repeats: int) -> dict:
    """Medians over fresh pages of first paint, interactive, and each action: (name, js args, python fn)."""
    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        page, times = open_page(browser, path)
        for name, in_page, from_python in actions:
            if in_page is not None:
                times[f"{name}, in page ms"] = page.evaluate(RESPOND, in_page)
            if from_python is not None:
                t0 = time.perf_counter()
                from_python(page)
                times[f"{name}, from Playwright ms"] = 1000 * (time.perf_counter() - t0)
        page.close()
        for k, v in times.items():
            rows.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in rows.items()}


def timed(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--screenshots", type=Path, default=None, help="folder for view_grid.png and view_head.png")
    args = p.parse_args(argv)
    if args.threads:
        interp.set_threads(args.threads)
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {chromium}")
    print(f"# command: python benchmarks/bench_views.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    model = interp.load_model("smollm2")
    generator = torch.Generator().manual_seed(0)
    ids64 = repeated_random_tokens(model, 1, 64, generator)[0]
    ids512 = repeated_random_tokens(model, 1, 512, generator)[0]
    scores, t_scores = timed(lambda: detect_heads(model), 1)
    print(f"detect_heads(model) with its defaults (the grid's colours): {t_scores:.1f} s")

    folder = Path(tempfile.mkdtemp(prefix="bench-views-"))
    views = {
        "grid: 270 heads, 64 tokens": lambda: attention_grid(model, ids64, scores=scores),
        "head view: 512 tokens, window (448, 512), 270 heads": lambda: head_view(model, ids512, window=(448, 512)),
        "head view: 512 tokens, layer 18 (9 heads), heatmaps": lambda: head_view(model, ids512, layers=[18]),
        "head view: 512 tokens, layer 18 (9 heads), lines": lambda: head_view(model, ids512, layers=[18],
                                                                               display="lines"),
    }
    thumb, matrix = '[data-role="thumb"][data-layer="18"][data-head="6"]', '[data-role="detail"] [data-role="matrix"]'
    query = '[data-role="query"][data-token="500"] .iv-text'
    actions = {
        "grid": [("click a thumbnail: its head opens", [thumb, "click", 0.5, 0.5], None),
                 ("hover its heatmap: the weight shows", [matrix, "mousemove", 0.7, 0.8], None),
                 ("click + wait (Playwright)", None, lambda pg: (pg.click(thumb.replace('"6"', '"5"')),
                                                                pg.wait_for_selector('[data-role="detail"][data-head="5"]')))],
        "window": [("hover a query token: lines and weights", ['[data-role="query"][data-token="500"] .iv-text',
                                                              "mouseover", 0.5, 0.5], None),
                   ("hover + wait (Playwright)", None, lambda pg: (pg.hover('[data-role="query"][data-token="480"] .iv-text'),
                                                                   pg.wait_for_selector('[data-role="key"] .iv-sq[data-weight]')))],
        "heatmaps": [("hover a heatmap cell: the weight shows", ['[data-role="matrix"]', "mousemove", 0.6, 0.9], None)],
        "lines": [("hover a query token: lines and weights", [query, "mouseover", 0.5, 0.5], None)],
    }
    print("\n| view | build s | save s | file MB | first paint ms | interactive ms | response | in page ms |"
          " from Playwright ms |\n|---|---:|---:|---:|---:|---:|---|---:|---:|")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for (name, build), kind in zip(views.items(), actions):
            view, t_build = timed(build, args.repeats)
            path = folder / f"{kind}.html"
            _, t_save = timed(lambda: view.save(path), args.repeats)
            got = measure(browser, path, actions[kind], args.repeats)
            for i, (action, _, _) in enumerate(actions[kind]):
                first = (f"| {name} | {t_build:.2f} | {t_save:.3f} | {path.stat().st_size / 1e6:.2f} | "
                         f"{got['first paint ms']:.0f} | {got['interactive ms']:.0f} |") if i == 0 else "| | | | | | |"
                in_page, python = got.get(f"{action}, in page ms"), got.get(f"{action}, from Playwright ms")
                print(f"{first} {action} | {'' if in_page is None else f'{in_page:.1f}'} | "
                      f"{'' if python is None else f'{python:.0f}'} |")
        if args.screenshots is not None:
            screenshots(browser, model, scores, ids64, args.screenshots, folder)
        browser.close()
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


def _small_png(data: bytes, path: Path) -> None:
    """A screenshot reduced to 256 colours, a third of the bytes for the repository (on a whole page, the fast
    octree keeps white white and viridis' yellow yellow; median cut turned the yellow salmon, maximum coverage
    the white pink)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    image.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(path, optimize=True)


def screenshots(browser, model, scores, ids64, out: Path, folder: Path) -> None:
    """The README's pictures: the grid with induction head 18.6 open, and a head view on a sentence."""
    path = attention_grid(model, ids64, scores=scores).save(folder / "shot_grid.html")
    page = browser.new_page(viewport={"width": 1280, "height": 1180})
    page.goto(path.as_uri())
    page.wait_for_selector(".interp-view[data-ready]")
    page.click('[data-role="thumb"][data-layer="18"][data-head="6"]')
    page.evaluate("window.scrollTo(0, 0)")
    box = page.locator('[data-role="detail"] [data-role="matrix"]').bounding_box()
    query = 57  # second copy; its token first occurred at 57 - 32, so the induction target is key 26
    page.mouse.move(box["x"] + box["width"] * 26.5 / 64, box["y"] + box["height"] * (query + 0.5) / 64)
    _small_png(page.screenshot(), out / "view_grid.png")
    page.close()
    text = "The old lighthouse keeper climbed the stairs at dusk, and the old lighthouse keeper lit the lamp."
    path = head_view(model, text, layers=[16, 17, 18], heads=[0, 3, 4, 6]).save(folder / "shot_head.html")
    page = browser.new_page(viewport={"width": 900, "height": 640})
    page.goto(path.as_uri())
    page.wait_for_selector(".interp-view[data-ready]")
    page.select_option('[data-role="layer"]', "18")
    tokens = model.to_str_tokens(text)
    second = [i for i, t in enumerate(tokens) if t == "Ġlighthouse"][-1]
    page.hover(f'[data-role="query"][data-token="{second}"] .iv-text')
    _small_png(page.screenshot(), out / "view_head.png")
    page.close()
    print(f"screenshots: {out / 'view_grid.png'}, {out / 'view_head.png'}")


if __name__ == "__main__":
    sys.exit(main())
