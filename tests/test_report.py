"""`interp report` on the default toy model, and the page as a person sees it in headless Chromium (``browser.py``:
Playwright driving Debian's Chromium; any request other than the page itself, or a console error, fails a test)."""

from __future__ import annotations

import base64
import io
import json
import re
import struct

import matplotlib.image as mpimg
import pandas as pd
import pytest
import torch
from browser import Page, chromium

from analyses import SCORE_DEFINITIONS
from analyses.cli import main

# seaborn 0.13 calls a matplotlib method that matplotlib 3.11 marks for deprecation; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert main(["report", "--out", str(out), "--force"]) == 0
    return out


@pytest.fixture(scope="module")
def streaming_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("streaming_report")
    assert main(["report", "--out", str(out), "--force", "--streaming"]) == 0
    return out


def test_streaming_section_only_when_asked(report, streaming_report):
    """--streaming adds the section, its figure, its table and a finding (issue 26); without it none of them, and the
    default report's stages are the same as before."""
    on = json.loads((streaming_report / "summary.json").read_text())
    page = (streaming_report / "index.html").read_text()
    assert 'id="streaming"' in page and "streaming curve" in page and 'href="streaming.csv"' in page
    assert (streaming_report / "figures" / "streaming.png").read_bytes()[:4] == b"\x89PNG"
    df = pd.read_csv(streaming_report / "streaming.csv")
    assert set(df.order) == {"induction", "random"} and set(df.seed.dropna()) == {0, 1}
    assert df.kv_fraction.min() < 1 and df[df.fraction_streaming == 0].kv_fraction.eq(1).all()
    assert sum("#streaming" in line for line in on["findings"]) == 1
    assert list(on["seconds"])[-2:] == ["streaming", "total"]
    # the induction order keeps the induction circuit longer than random orders (layer 0 streams first)
    half = df[df.fraction_streaming == 0.5].groupby("order").metric.mean()
    assert half["induction"] < half["random"]
    off = json.loads((report / "summary.json").read_text())
    page = (report / "index.html").read_text()
    assert "streaming" not in off and 'id="streaming"' not in page and "streaming.csv" not in page
    assert not (report / "streaming.csv").exists() and not (report / "figures" / "streaming.png").exists()
    assert not any("#streaming" in line for line in off["findings"])
    assert list(off["seconds"]) == ["heads", "attention maps", "ablation", "classes", "pruning", "total"]


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
    images = re.findall(r'<img src="([^"]+)" width="(\d+)" height="(\d+)"', page)
    assert len(images) >= 6 and len(images) == page.count("<img ")
    for src, width, height in images:
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1])
        image = mpimg.imread(io.BytesIO(data), format="png")
        assert image.shape[0] > 50 and image.shape[1] > 50
        assert struct.unpack(">II", data[16:24]) == (image.shape[1], image.shape[0])  # the header the page reads
        assert (int(width), int(height)) == (image.shape[1] // 2, image.shape[0] // 2)  # shown at 100 px per inch
    assert "<script src" not in page and "@import" not in page


def test_page_is_explorable_in_chromium_offline(report, tmp_path):
    """No request and no console error; every image decodes and is shown at half its pixel size (2x PNGs, so a
    figure's 7.5 pt text is 10.4 px); no HTML text under 10 px; the grid and the head views respond."""
    heads = pd.read_csv(report / "heads.csv").set_index(["layer", "head"])
    with chromium() as browser:
        page = Page(browser, (report / "index.html").read_text())
        p = page.page
        images = p.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth, e.naturalHeight, "
                                               "e.getAttribute('width'), e.getAttribute('height')])")
        assert len(images) >= 6
        for complete, natural_w, natural_h, width, height in images:
            assert complete and natural_w > 50 and (int(width), int(height)) == (natural_w // 2, natural_h // 2)
        assert page.smallest_text() >= 10
        assert p.locator('.interp-view[data-view="grid"] [data-role="thumb"]').count() == 8
        p.click('[data-role="thumb"][data-layer="1"][data-head="3"]')
        cells = p.locator('[data-role="scores"] tr[data-score="induction"] td').all_inner_texts()
        assert cells[1] == f"{heads.loc[(1, 3), 'induction']:.3f}"
        views = p.locator('.interp-view[data-view="head"]')
        assert views.count() >= 1
        views.first.locator('[data-role="query"]').nth(20).locator(".iv-text").hover()
        assert views.first.locator(".iv-sq[data-weight]").count() > 0
        page.check_clean()
        page.screenshot(tmp_path / "report.png", min_colours=50)
        page.close()


def test_report_opens_with_the_model_name_findings_and_the_strongest_induction_head(report):
    """A page to send to a colleague: the model's name first, then the findings (each linked to its evidence),
    and the first head view open on the strongest head of the most specific class (issue 27)."""
    summary = json.loads((report / "summary.json").read_text())
    induction = [h for h in summary["strongest_heads"] if h["class"] == "induction"][0]
    ablated = {r["class"]: r for r in summary["class_ablation"]["rows"]}
    assert ablated["induction"]["share"] > 0.9  # ablating the toy's induction heads removes the in-context gain
    with chromium() as browser:
        page = Page(browser, (report / "index.html").read_text())
        p = page.page
        first = p.eval_on_selector_all("body > *", "els => els.slice(0, 4).map(e => [e.tagName, e.innerText])")
        assert first[0][0] == "H1" and first[0][1].startswith("toy-induction")
        assert first[2] == ["H2", "Findings"] and "parameters, 2 layers x 4 heads" in first[1][1]
        findings = p.locator('[data-role="findings"] li').all_inner_texts()
        assert findings[0].startswith("3 induction heads") and f"strongest {induction['layer']}.{induction['head']}" \
            in findings[0] and "% of the in-context gain" in findings[0]
        assert p.locator('[data-role="findings"] a[href="#classes-causal"]').count() >= 1
        assert p.locator("#classes-causal").count() == 1
        view = p.locator('.interp-view[data-view="head"]').first
        assert view.locator('[data-role="layer"]').input_value() == str(induction["layer"])
        assert f"{induction['layer']}.{induction['head']} induction" in view.inner_text().split(",")[0]
        page.check_clean()
        page.close()


def test_strongest_table_is_short_and_every_score_is_defined_where_shown(report):
    page = (report / "index.html").read_text()
    summary = json.loads((report / "summary.json").read_text())
    visible = page.split("<details>")[0].split("Strongest head of each class")[1]
    classes = {h["class"] for h in summary["strongest_heads"]}
    rows = re.findall(r"<tr><td class=\"text \">(\w+)</td>", visible)
    assert sorted(rows) == sorted(classes)  # one row per class; the rest behind a toggle
    for kind in classes:
        assert SCORE_DEFINITIONS[kind] in visible
    assert "All " in page and "labelled heads</summary>" in page
    for name in ("heads.csv", "ablation.csv", "pruning.csv", "summary.json"):
        assert f'href="{name}"' in page and (report / name).exists()
    captions = re.findall(r"<figcaption><b>(\w+)</b>: ([^<]+)</figcaption>", page)
    assert {c for c, _ in captions} >= {"induction", "previous_token", "sink"}
    assert all("threshold" in text and "95% bootstrap interval" in text for c, text in captions
               if c != "positional_fraction")


def test_study_inputs_of_one_length_say_so_and_compute_no_padding():
    """The report on a model with many heads runs its ablation scan and pruning on sentences of one length (SmolLM2's
    first 4 sentences were 72 positions, 10 of them padding); the description must name those sentences, not call
    them "given prompts" (as a first version did)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    import interp
    from analyses.heads import corpus_sentences
    from analyses.views.report import study_inputs

    tokenizer = AutoTokenizer.from_pretrained(interp.loading.resolve_source("minilm"), local_files_only=True)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=64, vocab_size=len(tokenizer)))
    model = interp.load_model(hf.eval())
    model.tokenizer = tokenizer
    batch, _, what = study_inputs(model, None, n=4, same_length=True)
    length = batch["input_ids"].shape[1]
    assert what == f"the first 4 of the project's sentences that are {length} tokens long (its most common length)"
    assert batch["attention_mask"] is None or bool(batch["attention_mask"].all())
    lengths = [len(tokenizer(s)["input_ids"]) for s in corpus_sentences()]
    assert lengths.count(length) == max(lengths.count(k) for k in set(lengths))
    expected = [s for s, k in zip(corpus_sentences(), lengths) if k == length][:4]
    assert torch.equal(batch["input_ids"], model.to_batch(expected)["input_ids"])
    assert study_inputs(model, None, n=4)[2] == "the first 4 of the project's sentences"
    assert study_inputs(model, ["one text", "another"], same_length=True)[2] == "2 given prompts"


def test_report_writes_vector_figures_for_papers(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path), "--fmt", "svg,pdf", "--n-prompts", "8"]) == 0
    figures = sorted(p.name for p in (tmp_path / "figures").iterdir())
    assert "ablation.svg" in figures and "ablation.pdf" in figures and not any(f.endswith(".png") for f in figures)
    assert (tmp_path / "figures" / "grid_induction.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "figures" / "pruning.pdf").read_bytes()[:5] == b"%PDF-"
    capsys.readouterr()
    assert main(["report", "--out", str(tmp_path / "x"), "--fmt", "eps"]) == 2
    assert "png, svg, pdf" in capsys.readouterr().err


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


def test_importing_the_report_leaves_the_matplotlib_backend_alone(tmp_path):
    """It switched every user's session to Agg (issue 22): a notebook's inline backend stopped drawing."""
    import os
    import subprocess
    import sys

    code = ("import matplotlib; from analyses import write_report; import analyses.views.report; "
            "print(matplotlib.get_backend())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLBACKEND": "svg"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().lower() == "svg"
