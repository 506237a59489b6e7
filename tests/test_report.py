"""`interp report` on the default toy model, and the page as a person sees it in headless Chromium."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest

from analyses.cli import main

# seaborn 0.13 calls a matplotlib method that matplotlib 3.11 marks for deprecation; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert main(["report", "--out", str(out), "--force"]) == 0
    return out


def _chromium(tmp_path, *args):
    if CHROMIUM is None:
        pytest.fail("Chromium is needed to render the report (Debian package `chromium`; .ci/run installs it).")
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


def test_report_files(report):
    for name in ("index.html", "heads.csv", "ablation.csv", "pruning.csv", "summary.json"):
        assert (report / name).stat().st_size > 0, name
    heads = pd.read_csv(report / "heads.csv")
    assert len(heads) == 8 and {"layer", "head", "label", "induction", "previous_token"} <= set(heads.columns)
    summary = json.loads((report / "summary.json").read_text())
    assert {h["class"] for h in summary["strongest_heads"]} >= {"induction", "previous_token"}
    assert [(m["class"], m["prompt"]) for m in summary["attention_maps"]][:1] == [("induction", "repeated random tokens")]
    assert "labels" in heads.columns and summary["threads"] == __import__("torch").get_num_threads()
    assert {r["order"] for r in summary["pruning"]} == {"importance", "random"}
    pngs = sorted(p.name for p in (report / "figures").glob("*.png"))
    assert "ablation.png" in pngs and "pruning.png" in pngs and any(p.startswith("attention_induction") for p in pngs)


def test_page_is_self_contained_and_every_image_is_a_png(report):
    page = (report / "index.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page must not fetch anything"
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) >= 6
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        image = mpimg.imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
        assert image.shape[0] > 50 and image.shape[1] > 50


def test_page_renders_in_chromium_with_every_image_loaded(report, tmp_path):
    # a copy of the page that records, after load, whether each image decoded
    probe = tmp_path / "probe.html"
    script = ("<script>window.addEventListener('load', () => { for (const img of document.images) "
              "img.setAttribute('data-loaded', img.complete && img.naturalWidth > 0); });</script>")
    probe.write_text((report / "index.html").read_text().replace("</body>", script + "</body>"))
    dom = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()).stdout
    states = re.findall(r'data-loaded="(true|false)"', dom)
    assert states and all(s == "true" for s in states), states
    assert len(states) == len(re.findall(r"<img ", (report / "index.html").read_text()))

    shot = tmp_path / "shot.png"
    _chromium(tmp_path, "--window-size=1280,2400", f"--screenshot={shot}", (report / "index.html").as_uri())
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    assert pixels.std() > 0.1  # not a blank page
    colours = np.unique((pixels[::7, ::7] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50  # text, tables and heatmaps, not a flat page


@pytest.mark.slow
def test_report_on_smollm2(tmp_path):
    """The report on a 30-layer real model (about 80 s): a short table of each class's strongest heads, the
    induction map on repeated tokens, a scan of all 270 heads on 4 prompts (`python -m pytest -m slow`)."""
    assert main(["report", "--model", "smollm2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    strongest = pd.DataFrame(summary["strongest_heads"])
    assert len(strongest) <= 3 * 7 and strongest.groupby("class").size().max() <= 3
    assert (strongest[strongest["class"] == "induction"]["layer"].between(17, 23)).all()
    assert summary["attention_maps"][0] == {"class": "induction", "layer": 18, "head": 6,
                                            "prompt": "repeated random tokens"}
    assert len(pd.read_csv(tmp_path / "ablation.csv")) == 270 and "first 4" in summary["study_inputs"]
