"""The registry of head scores (issue 36): a user's score, defined in a file outside the package, runs wherever ours
do — detect_heads, `interp heads --score-module`, the report's grid and the long view — on decoder-only, GPT-2 and
T5 models (encoder self-attention and cross-attention sites), on both paths; no list of score names lives outside
the registry; T5 scoring on the flash path builds no n x n matrix."""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import analyses
import interp
from analyses import detect_heads
from analyses.heads import registry
from analyses.cli import main
from tests.tiny import model_class, tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "notebooks" / "examples" / "punctuation_heads.py"
TOL = 1e-5


def _load_example():
    spec = importlib.util.spec_from_file_location("punctuation_heads_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def punctuation():
    """The user's score registered from its file, and removed afterwards (the registry is the process's)."""
    module = _load_example()
    yield module
    registry.unregister("punctuation")


def _tiny(family: str):
    return tiny_model(family, cls=model_class(family, seq2seq=True)) if family == "t5" else tiny_model(family)


def _plain_score(model, batch: dict, example) -> dict:
    """The punctuation score of every (site, head) recomputed with plain torch from the eager patterns: per site,
    the mean over rows with a target (not a causal site's first row) of the weight on that target."""
    _, cache = model.run_with_cache(batch["input_ids"], batch.get("attention_mask"),
                                    **{k: batch[k] for k in ("decoder_input_ids",) if k in batch})
    out = {}
    for site in model.cfg.sites:
        pattern = cache.pattern(site.name).double()  # (b, h, q, k)
        q_ids, k_ids = batch[site.queries], batch[site.keys]
        target = example.punctuation(q_ids, k_ids, None)  # no padding here: positions are the padded ones
        total, rows = torch.zeros(pattern.shape[1], dtype=torch.float64), 0
        for b in range(pattern.shape[0]):
            for i in range(pattern.shape[2]):
                if target[b, i] < 0 or (site.causal and i == 0):
                    continue
                total += pattern[b, :, i, target[b, i]]
                rows += 1
        for h in range(pattern.shape[1]):
            out[(site.name, h)] = float(total[h] / rows) if rows else float("nan")
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_a_users_score_runs_on_every_model_and_both_paths_and_matches_plain_torch(punctuation, family):
    hf = _tiny(family)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 99, (5, 14), generator=g)
    batch = {"input_ids": ids, "decoder_input_ids": torch.randint(0, 99, (5, 11), generator=g)} if family == "t5" \
        else {"input_ids": ids}
    prompts = batch if family == "t5" else ids
    frames = {}
    for attn in ("eager", "flash"):
        model = interp.load_model(hf, attn=attn)
        frames[attn] = detect_heads(model, scores=["punctuation"], prompts=prompts, n_bootstrap=50)
    eager, flash = frames["eager"], frames["flash"]
    assert (eager["punctuation"] - flash["punctuation"]).abs().max() < TOL
    assert {"punctuation_lo", "punctuation_hi", "label", "labels"} <= set(eager.columns)
    if family == "t5":
        assert {("encoder", "self"), ("decoder", "self"), ("decoder", "cross")} <= set(zip(eager["stack"], eager["kind"]))
    plain = _plain_score(interp.load_model(hf, attn="eager"), batch, punctuation)
    got = {(s, int(h)): v for s, h, v in zip(eager.site, eager["head"], eager["punctuation"])}
    assert got.keys() == plain.keys()
    assert max(abs(got[k] - plain[k]) for k in got) < TOL


def test_a_users_score_on_padded_batches_sees_each_prompt_from_its_first_token(punctuation):
    """A rule is called on each prompt's real tokens: padding never shifts its positions, on either side."""
    model = interp.load_model(tiny_model("llama"), attn="flash")
    prompts = [[5, 1, 7, 8, 2, 9], [3, 4, 1, 6], [11, 12, 13, 2, 14, 15, 16, 17]]
    together = detect_heads(model, scores=["punctuation"], prompts=prompts, n_bootstrap=20, batch_size=3)
    alone = [detect_heads(model, scores=["punctuation"], prompts=[p], n_bootstrap=20) for p in prompts]
    rows = [sum(1 for i in range(1, len(p)) if any(t < 10 for t in p[:i + 1])) for p in prompts]
    mixed = sum(a["punctuation"] * r for a, r in zip(alone, rows)) / sum(rows)
    assert (together["punctuation"] - mixed).abs().max() < TOL


def test_the_command_line_takes_a_score_module(punctuation, tmp_path):
    folder = tmp_path / "llama"
    tiny_model("llama").save_pretrained(folder)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["heads", "--model", str(folder), "--score-module", str(EXAMPLE), "--scores", "punctuation,sink",
                     "--n-prompts", "4", "--format", "csv", "--threads", "1"])
    assert code == 0, err.getvalue()
    df = pd.read_csv(io.StringIO(out.getvalue()))
    assert {"punctuation", "punctuation_lo", "sink"} <= set(df.columns) and df["punctuation"].notna().all()
    with redirect_stdout(io.StringIO()), redirect_stderr(err := io.StringIO()):
        code = main(["heads", "--model", str(folder), "--score-module", str(tmp_path / "nope.py")])
    assert code == 2 and "no such file" in err.getvalue()


def test_the_report_grid_and_the_long_view_show_a_users_score(punctuation, tmp_path):
    from analyses.views.report import write_report

    model = interp.load_model(tiny_model("llama"))
    write_report(model, tmp_path / "r", n_prompts=4, study_prompts=2)
    heads = pd.read_csv(tmp_path / "r" / "heads.csv")
    assert heads["punctuation"].notna().all()
    assert (tmp_path / "r" / "figures" / "grid_punctuation.png").exists()
    assert "punctuation score per head" in (tmp_path / "r" / "index.html").read_text()
    assert registry.SCORE_DEFINITIONS["punctuation"] in (tmp_path / "r" / "index.html").read_text()
    ids = torch.randint(0, 99, (120,), generator=torch.Generator().manual_seed(0))
    view = analyses.long_view(model, ids, layer=1)
    assert len(view.data["scores"]["punctuation"]) == model.cfg.sites[1].n_heads
    assert 'data-role="scores"' in view.html
    pairs = detect_heads(model, scores=["punctuation"], prompts=ids[None], n_bootstrap=10)
    at_layer = pairs[pairs.layer == 1]["punctuation"].round(4).tolist()
    assert view.data["scores"]["punctuation"] == at_layer


class _Sizes(TorchDispatchMode):
    """Records every new tensor (not a view of an op's input) with a (query, key) block of positions — two adjacent
    axes whose sizes are both sequence lengths in ``lengths`` — that interp's own scoring code made (the op's caller,
    torch's frames aside, is in analyses/, the per-site pass, the statistics or the cache; the model's own forward —
    HF's T5 position bias — is not the scorer's)."""

    def __init__(self, lengths: set[int]):
        super().__init__()
        self.lengths, self.found = lengths, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {x.untyped_storage().data_ptr() for x in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(x, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given and any(
                    a in self.lengths and b in self.lengths for a, b in zip(t.shape, t.shape[1:])):
                caller = [f for f in traceback.extract_stack() if "/torch/" not in f.filename][-2]  # -1: this method
                if any(part in caller.filename for part in ("/analyses/", "/interp/attention/site_pass.py", "/interp/attention/stats.py",
                                                            "/hooks/cache.py")):
                    self.found.append((str(func), tuple(t.shape), caller.filename, caller.lineno))
        return out


def test_t5_scoring_on_flash_builds_no_n_by_n_matrix(monkeypatch):
    import interp.attention.stats

    monkeypatch.setattr(interp.attention.stats, "_TOP_BUDGET", 2 * 4 * 8 * 8)  # the argmax's tiles: 8 x 8 positions, not n x n
    model = interp.load_model(_tiny("t5"), attn="flash")
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 99, (2, 47), generator=g),
             "decoder_input_ids": torch.randint(0, 99, (2, 41), generator=g)}  # lengths no other axis has
    with _Sizes({47, 41}) as sizes:
        df = detect_heads(model, prompts=batch, n_bootstrap=10)
    assert len(df) and sizes.found == []
    model.set_attn("eager")  # the check can fail: eager patterns are n x n and are read by the scorer
    with _Sizes({47, 41}) as sizes:
        detect_heads(model, prompts=batch, n_bootstrap=10)
    assert sizes.found


def test_no_list_of_score_names_outside_the_registry():
    """A literal list, tuple, set or dict naming two or more registered scores in the library code is a second
    home for the registry's fact; the grid, the report and the CLI would miss a new score."""
    names = set(registry.names()) | {r.label_column for r in registry.scores()}
    found = []
    for package in ("hooks", "interp", "analyses"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "analyses" / "registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                elements = [k for k in node.keys if k is not None] if isinstance(node, ast.Dict) else \
                    node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else []
                hits = [e.value for e in elements if isinstance(e, ast.Constant) and e.value in names]
                if len(hits) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {hits}")
    assert found == []


def test_registration_mistakes_are_clear():
    with pytest.raises(ValueError, match="one of interp's own scores"):
        analyses.head_score("induction")(lambda ids: ids)
    with pytest.raises(ValueError, match="must be an identifier"):
        analyses.head_score("my score")(lambda ids: ids)
    with pytest.raises(ValueError, match="takes some of"):
        analyses.head_score("bad_args")(lambda tokens, extra: tokens)
    with pytest.raises(ValueError, match="sites are some of"):
        analyses.head_score("bad_sites", sites=("self",))(lambda ids: ids)
    assert "bad_args" not in registry.names()

    @analyses.head_score("wrong_shape", threshold=None)
    def wrong_shape(ids):
        return ids[:, :-1]

    try:
        model = interp.load_model(tiny_model("llama"))
        with pytest.raises(ValueError, match="target rule of 'wrong_shape' must return a \\(batch, pos\\)"):
            detect_heads(model, scores=["wrong_shape"], n_prompts=2, n_bootstrap=10)
    finally:
        registry.unregister("wrong_shape")
    with pytest.raises(ValueError, match="cannot be removed"):
        registry.unregister("sink")


def test_registering_again_replaces_a_users_score_and_defaults_include_it(punctuation):
    _load_example()  # a notebook cell run twice
    assert list(registry.names()).count("punctuation") == 1
    model = interp.load_model(tiny_model("llama"))
    df = detect_heads(model, n_prompts=3, n_bootstrap=10)
    assert "punctuation" in df and "punctuation" in json.dumps(list(analyses.LABEL_ORDER))


def test_the_docs_table_is_the_registry():
    text = (ROOT / "notebooks" / "head_scores.md").read_text(encoding="utf-8")
    table = text.split("<!-- scores -->\n", 1)[1].split("\n<!-- /scores -->", 1)[0]
    assert table == registry.markdown_table()


def test_the_reports_attention_maps_say_how_to_explain_each_head(tmp_path):
    """Each map's caption carries the QK-attribution command for its head, on its class's target rule."""
    from analyses.views.report_page import _why_command

    assert _why_command({}, "induction", 1, 3) == "interp attribute --model MODEL --qk 1.3 --pairs induction"
    assert _why_command({}, "positional", "decoder.blocks.0.attn", 2).endswith("--qk decoder.blocks.0.attn.2 --pairs top1")
