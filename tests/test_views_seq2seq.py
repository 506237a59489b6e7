"""Views and grids of encoder-decoder models (issue 15): the head view and attention grid show one attention site
at a time (encoder self, decoder self, cross), labelled by stack and kind, in a real browser (``browser.py``: any
request or console error fails a test); the weights read from the page are ``cache.pattern`` of the site from
Python, padding dropped, to the 4 decimals the page shows. The tiny T5 and BART come from ``test_seq2seq.py``."""

from __future__ import annotations

import base64

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from browser import Page, chromium  # noqa: E402
from test_seq2seq import _batch, _tiny  # noqa: E402

import interp  # noqa: E402
from analyses import detect_heads  # noqa: E402
from analyses.views import attention_grid, head_view  # noqa: E402
from analyses.views.study_plots import ablation_heatmap, head_score_grid  # noqa: E402

# seaborn 0.13's heatmap calls Colormap.set_bad, which matplotlib 3.11 plans to deprecate; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")

HALF_UNIT = 0.5e-4 + 1e-6  # the page shows 4 decimals
LABELS = ["encoder 0 self", "encoder 1 self", "decoder 0 self", "decoder 0 cross", "decoder 1 self", "decoder 1 cross"]
CROSS = 3  # decoder.blocks.0.cross_attn, in model.cfg.sites order
B = 1  # the pair shown: source 6 of 9 positions real, target 4 of 6: padding on both sides


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


@pytest.fixture(scope="module", params=["t5", "bart"])
def model(request):
    return interp.load_model(_tiny(request.param), attn="flash")


@pytest.fixture(scope="module")
def batch():
    src, src_mask, tgt, tgt_mask = _batch()
    return {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt, "decoder_attention_mask": tgt_mask}


@pytest.fixture(scope="module")
def cache(model, batch):
    with torch.no_grad():
        _, cache = model.run_with_cache(batch["input_ids"], batch["attention_mask"],
                                        decoder_input_ids=batch["decoder_input_ids"],
                                        decoder_attention_mask=batch["decoder_attention_mask"])
    return cache


@pytest.fixture(scope="module")
def scores(model):
    return detect_heads(model, n_prompts=8, seq_len=8, n_bootstrap=50)


def reference(model, cache, batch, site: int, b: int = B) -> np.ndarray:
    """The site's pattern (h, q, k) of pair ``b`` from Python, its padding dropped on both sides."""
    s = model.cfg.sites[site]
    source, target = batch["attention_mask"][b].bool(), batch["decoder_attention_mask"][b].bool()
    queries = source if s.stack == "encoder" else target
    keys = target if s.stack == "decoder" and s.kind == "self" else source
    return cache.pattern(site)[b][:, queries][:, :, keys].float().numpy()


def real(ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [str(int(t)) for t in ids[mask.bool()]]


def decoded(data: dict) -> dict[int, np.ndarray]:
    """{site index: (heads, q, k)} of the weights a view embeds, site after site."""
    flat = np.frombuffer(base64.b64decode(data["weights"]), dtype="<u2").astype(float) / data["scale"]
    out, at = {}, 0
    for site, heads, packed in zip(data["layers"], data["heads"], data["packed"]):
        spec = data["sites"][site]
        nq, nk = len(data[spec["query"]]["tokens"]), len(data[spec["key"]]["tokens"])
        block = np.zeros((len(heads), nq, nk))
        if packed:
            rows, cols = np.tril_indices(nq)
            size = len(rows) * len(heads)
            block[:, rows, cols] = flat[at:at + size].reshape(len(heads), -1)
        else:
            size = block.size
            block[:] = flat[at:at + size].reshape(block.shape)
        out[site], at = block, at + size
    assert at == len(flat)
    return out


# -- data, without a browser -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["model", "cache"])
def test_every_site_embeds_its_pattern_with_the_padding_dropped(model, batch, cache, path):
    view = head_view(model, batch, batch=B) if path == "model" else head_view(cache, batch, batch=B)
    data = view.data
    assert [s["label"] for s in data["sites"]] == LABELS and data["layers"] == list(range(6))
    assert data["sites"][CROSS]["name"] == "decoder.blocks.0.cross_attn"
    assert (data["sites"][CROSS]["query"], data["sites"][CROSS]["key"]) == ("target", "source")
    assert data["source"]["tokens"] == real(batch["input_ids"][B], batch["attention_mask"][B])  # 6 of 9
    assert data["target"]["tokens"] == real(batch["decoder_input_ids"][B], batch["decoder_attention_mask"][B])  # 4 of 6
    assert data["packed"] == [False, False, True, False, True, False]  # only the causal decoder keeps a triangle
    weights = decoded(data)
    assert weights[CROSS].shape == (4, 4, 6) and weights[0].shape == (4, 6, 6) and weights[2].shape == (4, 4, 4)
    for site in range(6):
        assert np.abs(weights[site] - reference(model, cache, batch, site)).max() <= HALF_UNIT, site
    assert "6 source + 4 target tokens, 24 heads in 6 site(s)" in repr(view)


def test_a_pair_is_teacher_forced_and_sites_are_named_or_indexed(model, batch):
    source, labels = batch["input_ids"][0], batch["decoder_input_ids"][0]
    forced = {"input_ids": source, "decoder_input_ids": model.decoder_inputs(labels[None])}
    from_pair = head_view(model, (source, labels), layers="decoder.blocks.0.cross_attn").data
    assert from_pair["layers"] == [CROSS] and len(from_pair["target"]["tokens"]) == len(labels)
    assert from_pair["target"]["tokens"][1:] == [str(int(t)) for t in labels[:-1]]  # shifted right behind the start
    assert from_pair["weights"] == head_view(model, forced, layers=[CROSS]).data["weights"]
    from_labels = head_view(model, {"input_ids": source, "labels": labels}, layers=CROSS).data
    assert from_pair["weights"] == from_labels["weights"]
    picked = head_view(model, forced, heads=[("decoder.blocks.1.cross_attn", 2), (0, 1)]).data
    assert picked["layers"] == [0, 5] and picked["heads"] == [[1], [2]]


def test_a_text_pair_is_tokenized_on_both_sides():
    """A word-level tokenizer that appends </s> as T5's does: the target is shifted, so </s> alone is not shown."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", *"the cat sat on mat die katze sass auf der matte".split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    model = interp.HookedModel(_tiny("t5"), tokenizer=tokenizer)
    data = head_view(model, ("the cat sat on the mat", "die katze sass"), layers=CROSS).data
    assert data["source"]["tokens"] == ["the", "cat", "sat", "on", "the", "mat", "</s>"]
    assert data["target"]["tokens"] == ["<pad>", "die", "katze", "sass"]  # T5 starts the decoder with its pad token
    assert decoded(data)[CROSS].shape == (4, 4, 7)


def test_bad_input_is_refused_with_the_fix(model, batch, cache, scores):
    with pytest.raises(ValueError, match=r"\(source, target\)"):
        head_view(model, batch["input_ids"])
    with pytest.raises(KeyError, match="decoder.blocks.0.cross_attn"):
        head_view(model, batch, layers="decoder.blocks.0.cross")
    with pytest.raises(IndexError, match="sites 0..5"):
        head_view(model, batch, layers=[6])
    with pytest.raises(IndexError, match="site 3 has heads 0..3"):
        head_view(model, batch, heads=[(CROSS, 4)])
    with pytest.raises(ValueError, match="window"):
        head_view(model, batch, window=(0, 3))
    with pytest.raises(TypeError, match="cannot tokenize"):
        head_view(cache, "some text")
    with pytest.raises(ValueError, match="5 source token labels"):
        head_view(cache, (["a"] * 5, None), batch=B)
    with pytest.raises(ValueError, match="detect_heads \\(of this encoder-decoder model\\)"):
        attention_grid(cache, batch, scores=scores.drop(columns=["site"]))
    toy = interp.load_model("toy-induction")
    with pytest.raises(ValueError, match="site column"):
        attention_grid(toy, torch.arange(1, 9), scores=scores)


# -- in the browser ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["model", "cache"])
def test_head_view_switches_to_cross_attention_and_hover_shows_its_weights(browser, model, batch, cache, path):
    view = head_view(model, batch, batch=B) if path == "model" else head_view(cache, batch, batch=B)
    page = Page(browser, view.page())
    p = page.page
    assert p.eval_on_selector_all('[data-role="layer"] option', "os => os.map(o => o.textContent)") == LABELS
    assert p.get_attribute(".interp-view", "data-site") == "encoder.blocks.0.attn"
    source, target = view.data["source"]["tokens"], view.data["target"]["tokens"]
    texts = lambda side: p.eval_on_selector_all(f'[data-role="{side}"] .iv-text', "els => els.map(e => e.textContent)")
    assert texts("query") == source and texts("key") == source  # encoder self-attention: the source both sides

    p.select_option('[data-role="layer"]', str(CROSS))
    assert p.get_attribute(".interp-view", "data-layer") == str(CROSS)
    assert p.get_attribute(".interp-view", "data-site") == "decoder.blocks.0.cross_attn"
    assert texts("query") == target and texts("key") == source  # target queries, source keys
    assert "queries from the target" in p.inner_text('[data-role="sides"]')
    pattern = reference(model, cache, batch, CROSS)  # (4, 4, 6)
    for q in (3, 0):  # a second query must change the squares
        p.hover(f'[data-role="query"][data-token="{q}"] .iv-text')
        shown = page.squares("key")
        assert len(shown) == 6 * 4 and not page.squares("query")
        assert all(abs(w - pattern[h, q, k]) <= HALF_UNIT for (k, h), w in shown.items()), q
    p.hover('[data-role="key"][data-token="5"] .iv-text')  # what attends to source token 5
    shown = page.squares("query")
    assert len(shown) == 4 * 4 and all(abs(w - pattern[h, q, 5]) <= HALF_UNIT for (q, h), w in shown.items())
    p.hover('[data-role="query"][data-token="2"] .iv-sq[data-head="1"]')  # one square: its weight in the info line
    info = p.locator('[data-role="info"]')
    assert info.get_attribute("data-site") == "decoder.blocks.0.cross_attn"
    assert (info.get_attribute("data-query"), info.get_attribute("data-key")) == ("2", "5")
    assert info.get_attribute("data-weight") == f"{shown[(2, 1)]:.4f}"
    assert "decoder 0 cross head 1" in info.inner_text()

    p.select_option('[data-role="layer"]', "4")  # decoder 1 self: the target both sides, causal
    assert texts("query") == target and texts("key") == target
    p.hover('[data-role="query"][data-token="2"] .iv-text')
    pattern = reference(model, cache, batch, 4)
    shown = page.squares("key")
    assert len(shown) == 4 * 4 and all(abs(w - pattern[h, 2, k]) <= HALF_UNIT for (k, h), w in shown.items())
    assert all(w == 0 for (k, _), w in shown.items() if k > 2)
    page.check_clean()
    page.close()


def test_heatmap_of_a_cross_site_has_its_aspect_and_reports_the_cell(browser, model, batch, cache):
    view = head_view(model, batch, batch=B, layers="decoder.blocks.0.cross_attn", heads=[1], display="matrix")
    page = Page(browser, view.page())
    p = page.page
    canvas = '[data-role="matrix"][data-site="decoder.blocks.0.cross_attn"][data-head="1"]'
    width, height = p.eval_on_selector(canvas, "e => [e.clientWidth, e.clientHeight]")  # inside its border
    assert width / height == 6 / 4  # 6 source keys across, 4 target queries down
    box = p.locator(canvas).bounding_box()
    q, k = 2, 4
    p.mouse.move(box["x"] + (k + 0.5) * box["width"] / 6, box["y"] + (q + 0.5) * box["height"] / 4)
    info = p.locator('[data-role="info"]')
    assert (info.get_attribute("data-query"), info.get_attribute("data-key")) == (str(q), str(k))
    assert abs(float(info.get_attribute("data-weight")) - reference(model, cache, batch, CROSS)[1, q, k]) <= HALF_UNIT
    page.check_clean()
    page.close()


def test_grid_rows_name_stack_and_kind_and_a_cross_thumbnail_opens_its_scores(browser, model, batch, cache, scores):
    grid = attention_grid(cache, batch, batch=B, scores=scores)
    assert grid.data["score"] == "alignment"
    page = Page(browser, grid.page())
    p = page.page
    rows = p.eval_on_selector_all('[data-role="row"]', "els => els.map(e => [e.textContent, e.dataset.site])")
    assert rows == [[label, site.name] for label, site in zip(LABELS, model.cfg.sites)]
    assert p.locator('[data-role="thumb"]').count() == 24
    cross = p.locator('[data-role="thumb"][data-site="decoder.blocks.1.cross_attn"][data-head="2"]').bounding_box()
    own = p.locator('[data-role="thumb"][data-site="encoder.blocks.0.attn"][data-head="2"]').bounding_box()
    assert cross["width"] > cross["height"] and abs(own["width"] - own["height"]) < 0.5  # 4 x 6 drawn wide; 6 x 6 square
    p.click('[data-role="thumb"][data-layer="5"][data-head="2"]')
    detail = p.locator('[data-role="detail"]')
    assert (detail.get_attribute("data-site"), detail.get_attribute("data-head")) == ("decoder.blocks.1.cross_attn", "2")
    assert p.inner_text('[data-role="detail"] h4').startswith("decoder 1 cross head 2")
    row = scores.set_index(["site", "head"]).loc[("decoder.blocks.1.cross_attn", 2)]
    cells = lambda score: p.locator(f'[data-role="scores"] tr[data-score="{score}"] td').all_inner_texts()
    assert cells("alignment")[1] == f"{row['alignment']:.3f}" and "source position i" in cells("alignment")[3]
    assert cells("previous_token")[1] == "n/a"  # a self-attention score of a cross-attention head
    box = p.locator('[data-role="detail"] [data-role="matrix"]').bounding_box()
    q, k = 3, 1
    p.mouse.move(box["x"] + (k + 0.5) * box["width"] / 6, box["y"] + (q + 0.5) * box["height"] / 4)
    weight = float(p.get_attribute('[data-role="detail"] [data-role="info"]', "data-weight"))
    assert abs(weight - reference(model, cache, batch, 5)[2, q, k]) <= HALF_UNIT
    p.select_option('[data-role="score"]', "previous_token")
    frames = p.eval_on_selector_all('[data-role="thumb"][data-site$="cross_attn"]',
                                    "els => els.map(e => e.style.borderColor)")
    assert frames == ["rgb(221, 221, 221)"] * 8  # grey: cross heads have no previous-token score
    page.check_clean()
    page.close()


# -- static grids ---------------------------------------------------------------------------------------
def _heatmap(ax) -> np.ndarray:
    return np.ma.filled(np.ma.asarray(ax.collections[0].get_array(), dtype=float), np.nan)


def test_head_score_grid_has_a_row_per_site_and_leaves_scores_a_head_has_not_blank(scores):
    ax = head_score_grid(scores, "alignment")
    assert [t.get_text() for t in ax.get_yticklabels()] == LABELS and ax.get_ylabel() == "site"
    values = _heatmap(ax)
    cross = scores[scores.kind == "cross"]
    np.testing.assert_allclose(values[[3, 5]], cross.pivot(index="site", columns="head", values="alignment").to_numpy())
    assert np.isnan(values[[0, 1, 2, 4]]).all() and len(ax.texts) == 8  # only cross heads are written
    plt.close("all")
    ax = head_score_grid(scores, "previous_token")
    values = _heatmap(ax)
    assert np.isnan(values[[3, 5]]).all() and not np.isnan(values[[0, 1, 2, 4]]).any()
    assert all(t.get_text() for t in ax.texts) and len(ax.texts) == 16
    framed = {(int(r.get_y()), int(r.get_x())) for r in ax.patches if r.get_edgecolor()[:3] == (1.0, 0.0, 0.0)}
    sites = list(pd.unique(scores["site"]))
    assert framed == {(sites.index(r.site), r.head) for r in scores.itertuples() if r.label == "previous_token"}
    plt.close("all")


def test_attention_heatmap_of_a_cross_site_labels_target_queries_and_source_keys(model, cache, batch):
    from analyses.views.plots import attention_heatmap

    pattern = torch.as_tensor(reference(model, cache, batch, CROSS)[1])  # (4 target, 6 source)
    target, source = real(batch["decoder_input_ids"][B], batch["decoder_attention_mask"][B]), \
        real(batch["input_ids"][B], batch["attention_mask"][B])
    ax = attention_heatmap(pattern, tokens=target, key_tokens=source)
    assert [t.get_text() for t in ax.get_yticklabels()] == target
    assert [t.get_text() for t in ax.get_xticklabels()] == source
    np.testing.assert_allclose(_heatmap(ax), pattern.numpy(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="key_tokens="):
        attention_heatmap(pattern, tokens=target)
    plt.close("all")


def test_ablation_heatmap_of_a_table_with_sites():
    df = pd.DataFrame([{"site": site, "head": h, "delta": i - 0.3 * h} for i, site in enumerate(
        ["encoder.blocks.0.attn", "decoder.blocks.0.attn", "decoder.blocks.0.cross_attn"]) for h in range(2)])
    ax = ablation_heatmap(df, metric_name="copy loss")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["encoder 0 self", "decoder 0 self", "decoder 0 cross"]
    np.testing.assert_allclose(_heatmap(ax), [[0, -0.3], [1, 0.7], [2, 1.7]])
    plt.close("all")


# -- the copy toy ---------------------------------------------------------------------------------------
@pytest.mark.slow  # trains the copy toy: 20 s on a quiet 2-core machine, 2 minutes on a busy one
def test_copy_toy_cross_attention_shows_the_diagonal(browser, tmp_path):
    from analyses.data.seq2seq import copy_task, train_copy_model

    model = train_copy_model(steps=400, n_heads=4, seed=0)
    batch = copy_task(model, 1, 10, seed=5)
    head = int(detect_heads(model, n_prompts=32, seq_len=10, n_bootstrap=50).query("kind == 'cross'")
               .sort_values("alignment").iloc[-1]["head"])
    page = Page(browser, head_view(model, batch, layers="decoder.blocks.0.cross_attn").page())
    p = page.page
    for q in (2, 7):  # target i copies source i: the aligned head's largest weight is on it
        p.hover(f'[data-role="query"][data-token="{q}"] .iv-text')
        shown = {k: w for (k, h), w in page.squares("key").items() if h == head}
        assert max(shown, key=shown.get) == q and shown[q] > 0.4, (q, shown)
    page.check_clean()
    page.screenshot(tmp_path / "seq2seq_view.png")
    page.close()
