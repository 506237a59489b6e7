"""The CLI and the report on encoder-decoder models: every command runs on a saved tiny T5 or BART (heads per site,
SITE.HEAD head specs) or refuses in one line what does not apply (T5 cannot be pruned structurally: one position
bias serves every block's heads); the report of the copy toy finds its copying cross-attention heads and reads
offline in Chromium."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pandas as pd
import pytest
import torch
from browser import Page, chromium

from analyses.cli import main
from analyses.data.seq2seq import train_copy_model
from tests.tiny import model_class, tiny_model

# seaborn 0.13 calls a matplotlib method that matplotlib 3.11 marks for deprecation; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5")
    hf = tiny_model("t5", cls=model_class("t5", seq2seq=True))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith((".q.weight", ".k.weight")):
                p.mul_(3)
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bart_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bart")
    tiny_model("bart", cls=model_class("bart", seq2seq=True)).save_pretrained(folder)
    return folder


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*map(str, argv), "--threads", "1"])
    return code, out.getvalue(), err.getvalue()


def test_heads_ablate_and_patch_name_every_site(t5_folder):
    code, out, _ = run("heads", "--model", t5_folder, "--format", "csv", "--n-prompts", "8")
    heads = pd.read_csv(io.StringIO(out))
    assert code == 0 and list(heads.columns[:5]) == ["stack", "kind", "site", "layer", "head"]
    assert set(heads["site"]) == {"encoder.blocks.0.attn", "encoder.blocks.1.attn", "decoder.blocks.0.attn",
                                  "decoder.blocks.0.cross_attn", "decoder.blocks.1.attn", "decoder.blocks.1.cross_attn"}
    assert heads.loc[heads["kind"] == "cross", "alignment"].notna().all()
    assert heads.loc[heads["kind"] == "self", "alignment"].isna().all()

    code, out, _ = run("ablate", "--model", t5_folder, "--format", "csv", "--n-prompts", "4",
                       "--heads", "decoder.blocks.0.cross_attn.1,encoder.blocks.1.attn.0")
    scan = pd.read_csv(io.StringIO(out))
    assert code == 0 and list(zip(scan["site"], scan["head"])) == [("encoder.blocks.1.attn", 0),
                                                                  ("decoder.blocks.0.cross_attn", 1)]
    assert (scan["delta"] != 0).all()

    code, out, _ = run("patch", "--model", t5_folder, "--format", "csv", "--n-prompts", "4")
    patched = pd.read_csv(io.StringIO(out))
    assert code == 0 and len(patched) == 6 * 4
    # the corrupted source never reaches the first decoder block's self-attention
    assert (patched.loc[patched["site"] == "decoder.blocks.0.attn", "effect"].abs() < 1e-6).all()


@pytest.mark.parametrize("argv, says", [
    (["patch", "--method", "path", "--receivers", "1.0"], "use --method activation or attribution"),
    (["prune", "--save", "{tmp}/pruned", "--fraction", "0.3"], "drop --save"),
    (["prune", "--save", "{tmp}/pruned", "--fraction", "0.3"], "relative position bias"),
    (["attribute", "--text", "5 6", "--answer", "7", "--target", "x"], "--target: this model has no tokenizer"),
    (["plot", "--layer", "0", "--head", "0", "--out", "{tmp}/map.png"], "use interp view"),
    (["patch", "--clean", "a", "--corrupted", "b", "--answer", "x", "--wrong", "y"], "copy task"),
    (["ablate", "--heads", "decoder.blocks.9.cross_attn.0"], "decoder.blocks"),
])
def test_what_does_not_apply_is_refused_in_one_line(t5_folder, tmp_path, argv, says):
    code, _, err = run(*[a.format(tmp=tmp_path) for a in argv], "--model", t5_folder)
    assert code == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_attribute_splits_the_decoders_logit_over_its_self_and_cross_heads(bart_folder):
    code, out, _ = run("attribute", "--model", bart_folder, "--format", "csv", "--n-prompts", "4")
    df = pd.read_csv(io.StringIO(out))
    heads = df[df["component"] == "head"]
    assert code == 0 and set(heads["site"]) == {"decoder.blocks.0.attn", "decoder.blocks.0.cross_attn",
                                                "decoder.blocks.1.attn", "decoder.blocks.1.cross_attn"}
    assert len(heads) == 4 * 4 and heads["kind"].tolist().count("cross") == 8
    remainder = float(df.loc[df["component"] == "remainder", "attribution"].iloc[0])
    assert abs(remainder) < 1e-3 * df["attribution"].abs().sum()  # the parts add up to the logit

    # a source, the target so far and the next token, as token ids (the model has no tokenizer)
    code, out, _ = run("attribute", "--model", bart_folder, "--text", "5 6 7 8", "--target", "5 6",
                       "--answer", "7", "--wrong", "9")
    assert code == 0 and "source '5 6 7 8', target '5 6': logit difference" in out and "cross_attn" in out
    code, out, _ = run("attribute", "--model", bart_folder, "--lens", "--format", "csv", "--n-prompts", "4")
    lens = pd.read_csv(io.StringIO(out))
    assert code == 0 and lens["layer"].tolist() == [-1, 0, 1]


def test_prune_saves_a_model_without_its_least_important_heads_per_site(bart_folder, tmp_path):
    import interp

    code, out, err = run("prune", "--model", bart_folder, "--n-prompts", "4", "--step", "0.5",
                         "--save", tmp_path / "pruned", "--fraction", "0.25")
    assert code == 0 and "importance" in out and "saved a model without 6 heads" in err
    dropped = err.split("(")[1].split(")")[0].split(", ")
    assert all(d.rsplit(".", 1)[0] in {s.name for s in interp.load_model(bart_folder).cfg.sites} for d in dropped)
    pruned = interp.load_model(tmp_path / "pruned")
    assert sum(s.n_heads for s in pruned.cfg.sites) == 6 * 4 - 6
    assert all(s.n_heads >= 1 for s in pruned.cfg.sites)


def test_view_offers_every_site(t5_folder, tmp_path):
    code, _, _ = run("view", "--model", t5_folder, "--out", tmp_path / "view.html",
                     "--layers", "decoder.blocks.1.cross_attn,0")
    page = (tmp_path / "view.html").read_text()
    assert code == 0 and 'data-site' in page and "decoder.blocks.1.cross_attn" in page


@pytest.fixture(scope="module")
def copy_report(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reproducible training (as tests/test_seq2seq_studies.py)
    try:
        model = train_copy_model(steps=400, n_heads=4, seed=0)
    finally:
        torch.set_num_threads(threads)
    folder = tmp_path_factory.mktemp("copy")
    model.hf.save_pretrained(folder / "model")
    out = folder / "report"
    code, printed, _ = run("report", "--model", folder / "model", "--out", out, "--n-prompts", "32")
    assert code == 0 and "best-aligned cross-attention heads: decoder.blocks.0.cross_attn." in printed
    return out


def test_report_of_the_copy_toy_finds_its_copying_heads(copy_report):
    summary = json.loads((copy_report / "summary.json").read_text())
    for name in ("index.html", "heads.csv", "ablation.csv", "attribution.csv", "pruning.csv"):
        assert (copy_report / name).stat().st_size > 0
    best = summary["best_aligned"]
    assert best[0]["site"] == "decoder.blocks.0.cross_attn" and best[0]["alignment"] > 0.6
    # zero-ablating the best-aligned head hurts copying more than ablating any self-attention head
    scan = pd.read_csv(copy_report / "ablation.csv")
    top = scan.sort_values("delta", ascending=False).iloc[0]
    assert top["kind"] == "cross" and top["delta"] > 10 * scan.loc[scan["kind"] == "self", "delta"].abs().max()
    assert summary["head_view_site"] == "decoder.blocks.0.cross_attn"


def test_the_copy_toys_report_is_the_one_report_with_its_copy_task(copy_report):
    """The sections of every model's report, heads named site.head; what an encoder-decoder cannot have is skipped
    with a line saying why; the circuit is the copy task's, and its cross-attention heads carry it."""
    page = (copy_report / "index.html").read_text()
    summary = json.loads((copy_report / "summary.json").read_text())
    for anchor in ("findings", "classes", "classes-causal", "ablation", "circuits", "pruning", "model"):
        assert f'id="{anchor}"' in page, anchor
    first = summary["strongest_heads"][0]
    assert (first["class"], first["site"]) == ("alignment", "decoder.blocks.0.cross_attn")
    assert "Skipped: the class test" in page and page.count("Skipped:") == 1
    assert summary["attention_maps"][0] == {"class": "alignment", "site": "decoder.blocks.0.cross_attn",
                                            "head": first["head"], "prompt": "a copy-task pair"}
    assert (copy_report / "figures" / f"attention_alignment_decoder_blocks_0_cross_attn_H{first['head']}.png").exists()
    assert list(summary["seconds"]) == ["heads", "attention maps", "ablation", "circuits", "classes", "pruning",
                                        "total"]
    assert f"{first['site']}.{first['head']}" in page.split('id="classes"')[1].split("<details>")[0]
    circuits = summary["circuits"]
    assert circuits["name"] == "the copy task" and circuits["clean"] < circuits["corrupted"]
    dla = pd.read_csv(copy_report / "dla.csv")
    assert {"decoder.blocks.0.cross_attn", "decoder.blocks.0.attn"} <= set(dla["site"].dropna())
    attribution = pd.read_csv(copy_report / "attribution.csv")
    assert len(attribution) == 3 * 4 and "On the copy task, patching head" in " ".join(summary["findings"])


def test_report_of_the_copy_toy_reads_offline(copy_report, tmp_path):
    with chromium() as browser:
        page = Page(browser, (copy_report / "index.html").read_text())
        p = page.page
        labels = p.locator('.interp-view[data-view="grid"] [data-role="row"]').all_inner_texts()
        assert [label.strip() for label in labels] == ["encoder 0 self", "decoder 0 self", "decoder 0 cross"]
        assert p.locator("img").count() >= 5
        page.check_clean()
        page.screenshot(tmp_path / "report.png")
        page.close()


def test_info_lists_the_sites_and_hook_names(bart_folder):
    """`interp info` on an encoder-decoder printed the decoder-only probe description and crashed on it."""
    code, out, _ = run("info", bart_folder)
    assert code == 0
    assert "decoder.blocks.0.cross_attn" in out and "cross" in out and "bidirectional" in out
    assert "decoder.blocks.{l}.cross_attn.hook_pattern" in out and "encoder.blocks.{l}.hook_resid_post" in out
    code, out, _ = run("info", bart_folder, "--format", "json")
    assert code == 0 and "encoder.blocks.0.attn.hook_q" in json.loads(out)["hook_names"]
