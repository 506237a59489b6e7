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
    assert list(off["seconds"]) == ["heads", "attention maps", "ablation", "classes", "sinks", "pruning", "total"]


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
    from analyses.data.prompts import corpus_sentences
    from analyses.data.prompts import study_inputs

    tokenizer = AutoTokenizer.from_pretrained(interp.model.loading.resolve_source("minilm"), local_files_only=True)
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
    """The report on a 30-layer real model (about 2 min): a short table of each class's strongest heads, the
    induction map on repeated tokens, a scan of all 270 heads on 4 prompts (`python -m pytest -m slow`)."""
    assert main(["report", "--model", "smollm2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    strongest = pd.DataFrame(summary["strongest_heads"])
    assert len(strongest) <= 3 * 7 and strongest.groupby("class").size().max() <= 3
    assert (strongest[strongest["class"] == "induction"]["layer"].between(17, 23)).all()
    assert summary["attention_maps"][0] == {"class": "induction", "layer": 18, "head": 6,
                                            "prompt": "repeated random tokens"}
    assert len(pd.read_csv(tmp_path / "ablation.csv")) == 270 and "first 4" in summary["study_inputs"]
    edge = summary["circuits"]["edge_circuit"]  # the report's edge circuit runs on SmolLM2's whole graph
    assert "skipped" not in edge and edge["total"] == 70_651 and [r["size"] for r in edge["curve"]] == [10, 20, 40]


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


def test_a_model_in_training_mode_gets_the_report_of_eval_mode_and_keeps_its_mode_and_rng(tmp_path):
    """write_report drew its attention maps with dropout on and moved torch's global RNG (issue 35): every stage runs
    in eval mode with the RNG untouched (``model.studying()``), and the model is left in training mode. The toy with
    attention dropout 0.3: the files of a report in training mode equal those in eval mode (but the timings)."""
    import interp
    from analyses.views.report import write_report

    model = interp.load_model("toy-induction")
    for layer in model.hf.model.layers:
        layer.self_attn.attention_dropout = 0.3
    model.hf.eval()
    write_report(model, tmp_path / "eval", n_prompts=8, study_prompts=4)
    model.hf.train()
    rng = torch.random.get_rng_state()
    write_report(model, tmp_path / "train", n_prompts=8, study_prompts=4)
    assert model.hf.training and all(m.training for m in model.hf.modules())
    assert torch.equal(torch.random.get_rng_state(), rng)
    files = sorted(p.relative_to(tmp_path / "eval") for p in (tmp_path / "eval").rglob("*") if p.is_file())
    assert any(p.name.startswith("attention_induction") for p in files)
    for name in files:
        eval_bytes, train_bytes = (tmp_path / "eval" / name).read_bytes(), (tmp_path / "train" / name).read_bytes()
        if name.name == "summary.json":
            eval_bytes, train_bytes = ({k: v for k, v in json.loads(b).items() if k != "seconds"}
                                       for b in (eval_bytes, train_bytes))
        elif name.name == "index.html":  # the views' data
            eval_bytes, train_bytes = (re.findall(rb'class="iv-data">(.*?)</script>', b)
                                       for b in (eval_bytes, train_bytes))
            assert len(eval_bytes) >= 2
        assert eval_bytes == train_bytes, name


def test_each_head_view_opens_on_the_head_its_title_names_first():
    """On SmolLM2 the "strongest heads" view was titled 18.6 (the strongest induction head) and opened on layer 5, the
    lowest of its heads (a duplicate-token head's; issue 35). The view's data name the layer it opens on: the first
    head of its title's, and that head is among the heads shown there. The toy with a strongest table whose first
    head is on layer 1 and the next on layer 0, as on SmolLM2."""
    import interp
    from analyses import detect_heads
    from analyses.views.report import _views

    model = interp.load_model("toy-induction")
    heads = detect_heads(model, n_prompts=8)
    strongest = pd.DataFrame({"class": ["induction", "duplicate_token"], "layer": [1, 0], "head": [3, 2],
                              "score": [0.9, 0.5]})
    ids = torch.randint(1, 64, (24,), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(ids[None])
    views = _views(heads, strongest, {"repeated random tokens": (cache, [str(i) for i in range(24)])},
                   list(model.cfg.sites))
    [view] = views["head_views_html"]
    data = json.loads(re.search(r'class="iv-data">(.*?)</script>', view).group(1))
    first = re.search(r"strongest heads on [^:]+: (\d+)\.(\d+) ", data["title"]).groups()
    assert first == ("1", "3") and data["layers"] == [0, 1]
    assert data["open"] == 1 and 3 in data["heads"][data["layers"].index(data["open"])]
    assert views["head_views"][0]["heads"][0] == "1.3" and views["first_site"] == "blocks.1.attn"


def test_the_class_ablation_finding_names_its_prompts(report):
    """The report's 74% for SmolLM2's induction heads differed from the README's 85% with nothing to say why: they
    come from different prompts (issue 35). The finding says which: how many sequences, of how many tokens."""
    summary = json.loads((report / "summary.json").read_text())
    ablation = summary["class_ablation"]
    assert (ablation["n"], ablation["tokens"]) == (8, 33)
    [line] = [f for f in summary["findings"] if "in-context gain" in f and "induction" in f]
    share = {r["class"]: r["share"] for r in ablation["rows"]}["induction"]
    assert re.search(rf"removes <b>{share * 100:.0f}%</b> of the in-context gain on 8 repeated random sequences "
                     r"\[BOS, x, x\] of 33 tokens \(\|x\| = 16\); as many random heads", line), line


def test_the_cli_report_prints_a_line_per_stage_into_a_log_file(tmp_path):
    """The report ran 4.5 minutes with nothing printed after the model's conversion line (issue 35). Where stderr is
    a file (not a terminal: no bar), a line as each stage starts, with the time the one before took. A mistake found
    once the model is loaded stays the only line on stderr."""
    import os
    import subprocess
    import sys

    def report(*args, env=()):
        with open(tmp_path / "stderr.txt", "w") as log:
            done = subprocess.run([sys.executable, "-m", "analyses.cli", "report", "--n-prompts", "8", *args],
                                  stdout=subprocess.PIPE, stderr=log, text=True, timeout=600,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", **dict(env)})
        return done.returncode, (tmp_path / "stderr.txt").read_text()

    code, err = report("--out", str(tmp_path / "out"))
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("interp report: ")]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    stages = [s for s in summary["seconds"] if s != "total"]
    assert [line.split(" (")[0] for line in lines] == [f"interp report: {s}" for s in stages]
    assert re.fullmatch(r"interp report: heads \(stage 2 of 8; load took \d+\.\d s\)", lines[0])
    assert re.fullmatch(r"interp report: attention maps \(stage 3 of 8; heads took \d+\.\d s\)", lines[1])
    code, err = report("--out", str(tmp_path / "bad"), "--model", "minilm", "--streaming")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "causal decoders" in err


def test_stage_lines_are_quiet_when_progress_is_turned_off(capsys, monkeypatch):
    from analyses.cli.common import _Progress

    from interp.runtime.progress import progress_lines_off_a_terminal

    for env, printed in (("lines", True), ("0", False), ("", True)):  # unset: lines, where stderr is no terminal
        monkeypatch.setenv("INTERP_PROGRESS", env)
        with _Progress(["load", "heads"], lines="interp report") as progress, progress_lines_off_a_terminal():
            progress("load")
            progress("heads")
        assert ("interp report: heads (stage 2 of 2; load took" in capsys.readouterr().err) == printed, env


def test_force_replaces_the_earlier_reports_files_and_keeps_the_users(tmp_path, capsys):
    """`interp report --force` replaced the whole figures/ folder, a user's own file in it too (issue 35): it replaces
    what a report wrote (the earlier report's summary lists its files), never a file it did not write."""
    import interp
    from analyses.views.report import write_report

    out = tmp_path / "report"
    write_report(interp.load_model("toy-induction"), out, n_prompts=4, study_prompts=2, fmt="svg")
    earlier = json.loads((out / "summary.json").read_text()).get("files", [])
    mine = {"notes.txt": "my notes", "figures/mine.png": "my figure", "figures/drafts/a.txt": "a draft"}
    for name, text in mine.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    assert main(["report", "--out", str(out), "--force", "--n-prompts", "4"]) == 0
    for name, text in mine.items():
        assert (out / name).read_text() == text, name
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert "pruning.png" in figures and not any(f.endswith(".svg") for f in figures)  # the earlier report's: gone
    assert "figures/pruning.svg" in earlier and "index.html" in earlier and "summary.json" in earlier
    files = json.loads((out / "summary.json").read_text())["files"]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and
                  p.relative_to(out).as_posix() not in mine) == files


def test_heads_whose_scores_were_not_measured_are_not_listed_as_labelled():
    """A head labelled 'nan' (none of its scores measured) is no class: the report's table of labelled heads leaves it
    out, as it leaves out 'none'."""
    import pandas as pd

    from analyses.views.report_page import _labelled_table
    heads = pd.DataFrame({"stack": "", "kind": "self", "site": ["blocks.0.attn"] * 3, "layer": 0, "head": [0, 1, 2],
                          "induction": [0.9, 0.1, float("nan")], "induction_lo": [0.8, 0.0, float("nan")],
                          "induction_hi": [1.0, 0.2, float("nan")], "label": ["induction", "none", "nan"],
                          "labels": ["induction", "", "nan"]})
    table = _labelled_table(heads)
    assert "0.0" in table and "0.1" not in table and "0.2" not in table
    assert _labelled_table(heads.iloc[1:]) == "<p>No head passes a threshold.</p>"


def test_the_reports_time_comes_with_its_thread_count(tmp_path, monkeypatch, capsys):
    """issue 40: the printed time says how many threads it ran on (one thread and two differ by about 2x)."""
    import analyses.views.report as report_view

    monkeypatch.setattr(report_view, "write_report", lambda *a, **k: {"threads": 3, "attention_maps": []})
    assert main(["report", "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"wrote .*index\.html in \d+\.\d s on 3 threads \(strongest heads: none\)", printed)


def test_each_attention_map_says_how_to_explain_its_head(report):
    """The report's head section links QK attribution (issue 39): every map's caption gives the command."""
    text = (report / "index.html").read_text()
    assert text.count("interp attribute --model MODEL --qk ") >= 1
