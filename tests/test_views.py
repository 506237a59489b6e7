"""Interactive views (issue 14) in a real browser (``browser.py``: Playwright driving Debian's Chromium; any request
other than the page itself, or a console error, fails a test). Weights read from the page are compared with
``cache.pattern`` from Python to the 4 decimals the page shows."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
import torch
from browser import Page, chromium

import interp
from analyses import detect_heads
from analyses.cli import main
from analyses.data.toy import repeated_sequences
from analyses.views import AttentionGrid, HeadView, attention_grid, head_view

HALF_UNIT = 0.5e-4 + 1e-6  # the page shows 4 decimals


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


@pytest.fixture(scope="module")
def toy():
    return interp.load_model("toy-induction")


@pytest.fixture(scope="module")
def tokens():
    """[BOS, x, x] with len(x) = 12: (25,)."""
    return repeated_sequences(1, 12, 64, torch.Generator().manual_seed(1), bos_token_id=0)[0]


@pytest.fixture(scope="module")
def patterns(toy, tokens):
    """{layer: (h, q, k)} from Python, the reference for every weight a page shows."""
    with torch.no_grad():
        _, cache = toy.run_with_cache(tokens)
    return {l: cache.pattern(l)[0].numpy() for l in range(toy.cfg.n_layers)}


@pytest.fixture(scope="module")
def heads_df(toy):
    return detect_heads(toy, n_prompts=8, n_bootstrap=50)


def decoded(data: dict) -> np.ndarray:
    """The weights a view embeds, as (heads, q, k) floats."""
    flat = np.frombuffer(base64.b64decode(data["weights"]), dtype="<u2").astype(float) / data["scale"]
    n, n_heads = len(data["tokens"]), sum(len(h) for h in data["heads"])
    out = np.zeros((n_heads, n, n))
    if data["packed"]:
        rows, cols = np.tril_indices(n)
        out[:, rows, cols] = flat.reshape(n_heads, -1)
    else:
        out[:] = flat.reshape(n_heads, n, n)
    return out


# -- data, without a browser -----------------------------------------------------------------------------
def test_embedded_weights_are_the_patterns_to_4_decimals(toy, tokens, patterns):
    view = head_view(toy, tokens)
    data = view.data
    assert isinstance(view, HeadView) and data["layers"] == [0, 1] and data["heads"] == [[0, 1, 2, 3]] * 2
    assert data["packed"] and data["tokens"] == [str(int(t)) for t in tokens] and data["window"] is None
    expected = np.concatenate([patterns[0], patterns[1]])
    assert np.abs(decoded(data) - expected).max() <= HALF_UNIT


def test_a_cache_view_equals_a_model_view_and_reads_only_the_heads_shown(toy, tokens):
    with torch.no_grad():
        _, cache = toy.run_with_cache(tokens, names=["blocks.1.attn.hook_q", "blocks.1.attn.hook_k"])
    from_cache = head_view(cache, [str(int(t)) for t in tokens], heads=[(1, 3), (1, 1)]).data
    from_model = head_view(toy, tokens, heads=[(1, 1), (1, 3)]).data
    assert from_cache["layers"] == [1] and from_cache["heads"] == [[1, 3]]
    assert from_cache["weights"] == from_model["weights"]
    with pytest.raises(KeyError, match="layer 0"):
        head_view(cache, None, layers=[0])


def test_sites_name_the_layers_of_a_decoder_only_model(toy, tokens):
    """(site, head) on every model: a decoder-only model's sites are its layers, by name or number."""
    by_site = head_view(toy, tokens, heads=[("blocks.1.attn", 3), (0, 1)]).data
    assert by_site["layers"] == [0, 1] and by_site["heads"] == [[1], [3]] and "sites" not in by_site
    assert by_site["weights"] == head_view(toy, tokens, heads=[(0, 1), (1, 3)]).data["weights"]
    by_name = head_view(toy, tokens, layers="blocks.1.attn").data
    assert by_name["weights"] == head_view(toy, tokens, layers=1).data["weights"] and by_name["layers"] == [1]
    with pytest.raises(KeyError, match="blocks.1.attn"):
        head_view(toy, tokens, layers="blocks.1.atn")


def test_padding_is_dropped_and_a_padded_row_shows_what_it_shows_alone(toy):
    short, long = torch.arange(1, 9), torch.arange(1, 17)
    ids = torch.stack([long, torch.cat([torch.zeros(8, dtype=torch.long), short])])
    mask = (torch.arange(16)[None] >= torch.tensor([[0], [8]])).long()  # row 1 left-padded by 8
    alone = head_view(toy, short).data
    from_model = head_view(toy, {"input_ids": ids, "attention_mask": mask}, batch=1).data
    with torch.no_grad():
        _, cache = toy.run_with_cache(ids, mask)
    from_cache = head_view(cache, ids, batch=1).data
    for data in (from_model, from_cache):
        assert data["tokens"] == [str(i) for i in range(1, 9)] and data["positions"] == list(range(8))
        assert np.abs(decoded(data) - decoded(alone)).max() <= 1e-4 + 1e-9


def test_window_embeds_only_its_positions_and_the_weight_outside(toy):
    long = repeated_sequences(1, 30, 64, torch.Generator().manual_seed(1), bos_token_id=0)[0]  # 61 tokens
    data = head_view(toy, long, layers=0, window=(20, -11)).data
    with torch.no_grad():
        _, cache = toy.run_with_cache(long)
    full = cache.pattern(0)[0].numpy()  # (h, q, k)
    assert data["positions"] == list(range(20, 50)) and data["window"] == [20, 50] and data["length"] == 61
    assert np.abs(decoded(data) - full[:, 20:50, 20:50]).max() <= HALF_UNIT
    outside = np.frombuffer(base64.b64decode(data["outside"]), dtype="<u2").reshape(4, 30) / 1e4
    expected = full[:, 20:50].sum(-1) - full[:, 20:50, 20:50].sum(-1)
    assert np.abs(outside - expected).max() <= HALF_UNIT and expected.max() > 0.1


def test_bad_input_is_refused_with_the_fix(toy, tokens, monkeypatch):
    with pytest.raises(IndexError, match="layers 0..1"):
        head_view(toy, tokens, layers=[2])
    with pytest.raises(IndexError, match="heads 0..3"):
        head_view(toy, tokens, heads=[4])
    with pytest.raises(ValueError, match="not both"):
        head_view(toy, tokens, layers=[0], heads=[(0, 1)])
    with pytest.raises(ValueError, match="window"):
        head_view(toy, tokens, window=(10, 5))
    with pytest.raises(ValueError, match="'lines' or 'matrix'"):
        head_view(toy, tokens, display="bars")
    with torch.no_grad():
        _, cache = toy.run_with_cache(tokens)
    with pytest.raises(TypeError, match="cannot tokenize"):
        head_view(cache, "some text")
    with pytest.raises(ValueError, match="3 token labels"):
        head_view(cache, ["a", "b", "c"])
    with pytest.raises(ValueError, match="not in the scores table"):
        attention_grid(cache, None, score="induction")
    with pytest.raises(ValueError, match=".html"):
        head_view(cache).save("view.png")
    monkeypatch.setattr("analyses.views.attention.MAX_BYTES", 1000)
    with pytest.raises(ValueError, match="layers=, heads= or window="):
        head_view(cache)


def _norm_weighted_by_hand(model, tokens, layer: int) -> np.ndarray:
    """(h, q, k): the pattern times each key's ||v_j W_O^h|| computed from HF's o_proj weight, rows renormalised."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        pattern, v = cache.pattern(layer)[0].double(), cache["v", layer][0].double()  # (h, q, k), (k, g, e)
        w_o = model.hf.model.layers[layer].self_attn.o_proj.weight.double()  # (m, h * e)
    h, e = pattern.shape[0], v.shape[-1]
    v = v.repeat_interleave(h // v.shape[1], dim=1)  # (k, h, e)
    norms = torch.stack([(v[:, i] @ w_o[:, i * e:(i + 1) * e].T).norm(dim=-1) for i in range(h)])  # (h, k)
    moved = pattern * norms[:, None, :]
    return (moved / moved.sum(-1, keepdim=True)).numpy()


def test_a_norm_weighted_head_view_embeds_each_keys_share_of_the_output(toy, tokens, patterns):
    data = head_view(toy, tokens, weighting="norm").data
    assert data["weighting"] == "norm" and "norm-weighted" in data["title"]
    expected = np.concatenate([_norm_weighted_by_hand(toy, tokens, l) for l in (0, 1)])
    assert np.abs(decoded(data) - expected).max() <= HALF_UNIT
    assert np.abs(decoded(data) - np.concatenate([patterns[0], patterns[1]])).max() > 0.01  # not the pattern
    assert head_view(toy, tokens).data["weighting"] == "raw"
    with torch.no_grad():
        _, cache = toy.run_with_cache(tokens)
    with pytest.raises(ValueError, match="W_O, which a cache does not hold"):
        head_view(cache, weighting="norm")
    with pytest.raises(ValueError, match="weighting is one of"):
        head_view(toy, tokens, weighting="value")


# -- in the browser ---------------------------------------------------------------------------------------
def test_head_view_hover_shows_the_exact_weights_both_ways(browser, toy, tokens, patterns, tmp_path):
    view = head_view(toy, tokens)
    page = Page(browser, view.page())
    p = page.page
    assert p.get_attribute(".interp-view", "data-layer") == "0"
    assert p.locator('[data-role="query"]').count() == 25 and p.locator('[data-role="head"]').count() == 4
    for q in (20, 7):  # a second-copy query, then a first-copy one: the squares must change
        p.hover(f'[data-role="query"][data-token="{q}"] .iv-text')
        shown = page.squares("key")
        assert len(shown) == 25 * 4 and not page.squares("query")
        for (k, h), w in shown.items():
            assert abs(w - patterns[0][h, q, k]) <= HALF_UNIT, (q, k, h, w)
    p.hover('[data-role="key"][data-token="3"] .iv-text')  # what attends to key 3
    shown = page.squares("query")
    assert len(shown) == 25 * 4
    assert all(abs(w - patterns[0][h, q, 3]) <= HALF_UNIT for (q, h), w in shown.items())
    p.hover('[data-role="query"][data-token="4"] .iv-sq[data-head="1"]')  # one square: its weight in the info line
    info = p.locator('[data-role="info"]')
    assert (info.get_attribute("data-query"), info.get_attribute("data-key")) == ("4", "3")
    assert info.get_attribute("data-weight") == f"{shown[(4, 1)]:.4f}"
    page.check_clean()
    page.screenshot(tmp_path / "head_view.png")
    page.close()


def test_a_norm_weighted_head_view_says_so_and_a_dormant_sink_shows_as_nothing(browser):
    """The planted model of test_sinks: both heads park most weight on the first token; head 0's first-token value
    is zero, so read on norm-weighted attention its sink vanishes, head 1's stays."""
    from test_sinks import planted, prompts

    model, tokens = interp.load_model(planted()), torch.tensor(prompts()[2])
    raw, norm = (head_view(model, tokens, weighting=w) for w in ("raw", "norm"))
    page = Page(browser, norm.page())
    p = page.page
    assert p.get_attribute(".interp-view", "data-weighting") == "norm"
    assert p.locator('[data-role="weighting"]').inner_text() == "norm-weighted attention"
    q = len(tokens) - 1
    p.hover(f'[data-role="query"][data-token="{q}"] .iv-text')
    shown = page.squares("key")
    assert shown[(0, 0)] == 0.0 and shown[(0, 1)] > 0.1  # head 0's sink moves nothing, head 1's does
    assert abs(sum(w for (k, h), w in shown.items() if h == 0) - 1.0) < 0.01  # its output comes from other keys
    assert abs(shown[(0, 1)] - decoded(norm.data)[1, q, 0]) <= HALF_UNIT
    assert decoded(raw.data)[0, q, 0] > 0.5  # the weights themselves: a sink
    page.check_clean()
    page.close()
    page = Page(browser, raw.page())
    assert page.page.get_attribute(".interp-view", "data-weighting") is None
    assert page.page.locator('[data-role="weighting"]').count() == 0
    page.close()


def test_layer_selector_and_head_buttons(browser, toy, tokens, patterns):
    page = Page(browser, head_view(toy, tokens).page())
    p = page.page
    p.select_option('[data-role="layer"]', "1")
    assert p.get_attribute(".interp-view", "data-layer") == "1"
    p.hover('[data-role="query"][data-token="20"] .iv-text')
    shown = page.squares("key")
    assert all(abs(w - patterns[1][h, 20, k]) <= HALF_UNIT for (k, h), w in shown.items())
    assert max(shown.values()) > 0.5  # layer 1's induction heads look at the token after the earlier copy
    p.click('[data-role="head"][data-head="2"]')
    assert p.get_attribute('[data-role="head"][data-head="2"]', "aria-pressed") == "false"
    p.hover('[data-role="query"][data-token="21"] .iv-text')
    assert {h for _, h in page.squares("key")} == {0, 1, 3}
    page.check_clean()
    page.close()
    # heads given as pairs: the view opens on the first head's layer, not the lowest (issue 35)
    page = Page(browser, head_view(toy, tokens, heads=[(1, 3), (0, 2)]).page())
    p = page.page
    assert p.get_attribute(".interp-view", "data-layer") == "1" and p.input_value('[data-role="layer"]') == "1"
    assert p.locator('[data-role="head"]').all_inner_texts() == ["head 3"]
    page.check_clean()
    page.close()


def test_heatmap_display_reports_the_hovered_cell(browser, toy, tokens, patterns):
    page = Page(browser, head_view(toy, tokens, layers=[1], heads=[3], display="matrix").page())
    p = page.page
    box = p.locator('[data-role="matrix"][data-layer="1"][data-head="3"]').bounding_box()
    n, (q, k) = 25, (20, 9)
    p.mouse.move(box["x"] + (k + 0.5) * box["width"] / n, box["y"] + (q + 0.5) * box["height"] / n)
    info = p.locator('[data-role="info"]')
    assert (info.get_attribute("data-query"), info.get_attribute("data-key")) == (str(q), str(k))
    assert abs(float(info.get_attribute("data-weight")) - patterns[1][3, q, k]) <= HALF_UNIT
    assert patterns[1][3, q, k] > 0.5  # the induction target
    page.check_clean()
    page.close()


def test_grid_thumbnail_opens_that_head_with_its_scores(browser, toy, tokens, patterns, heads_df, tmp_path):
    grid = attention_grid(toy, tokens, scores=heads_df)
    assert isinstance(grid, AttentionGrid) and grid.data["score"] == "induction"
    page = Page(browser, grid.page())
    p = page.page
    assert p.locator('[data-role="thumb"]').count() == 8
    p.click('[data-role="thumb"][data-layer="1"][data-head="3"]')
    detail = p.locator('[data-role="detail"]')
    assert (detail.get_attribute("data-layer"), detail.get_attribute("data-head")) == ("1", "3")
    row = heads_df.set_index(["layer", "head"]).loc[(1, 3)]
    cells = p.locator('[data-role="scores"] tr[data-score="induction"] td').all_inner_texts()
    assert cells[1] == f"{row['induction']:.3f}"
    assert cells[2] == f"{row['induction_lo']:.3f} to {row['induction_hi']:.3f}" and "Olsson" in cells[3]
    box = p.locator('[data-role="detail"] [data-role="matrix"]').bounding_box()
    q, k = 20, 9
    p.mouse.move(box["x"] + (k + 0.5) * box["width"] / 25, box["y"] + (q + 0.5) * box["height"] / 25)
    weight = float(p.get_attribute('[data-role="detail"] [data-role="info"]', "data-weight"))
    assert abs(weight - patterns[1][3, q, k]) <= HALF_UNIT
    colours = lambda: p.eval_on_selector_all('[data-role="thumb"]', "els => els.map(e => e.style.borderColor)")
    by_induction = colours()
    p.select_option('[data-role="score"]', "previous_token")
    assert colours() != by_induction and "just before" in p.inner_text('[data-role="definition"]')
    page.check_clean()
    page.screenshot(tmp_path / "attention_grid.png")
    page.close()


def test_bidirectional_model_shows_the_full_pattern(browser, minilm):
    text = "The cat sat on the mat because it was tired."
    view = head_view(minilm, text, layers=[2], heads=[5])
    with torch.no_grad():
        _, cache = minilm.run_with_cache(text)
    pattern = cache.pattern(2, [5])[0, 0].numpy()
    assert not view.data["packed"] and view.data["tokens"][0] == "[CLS]"
    page = Page(browser, view.page())
    page.page.hover('[data-role="query"][data-token="1"] .iv-text')
    shown = page.squares("key")
    assert all(abs(w - pattern[1, k]) <= HALF_UNIT for (k, _), w in shown.items())
    assert max(w for (k, _), w in shown.items() if k > 1) > 0.01  # keys after the query: not a lower triangle
    page.check_clean()
    page.close()


def test_several_views_on_one_page_and_no_text_under_10px(browser, toy, tokens, heads_df):
    views = [head_view(toy, tokens, layers=1), attention_grid(toy, tokens, scores=heads_df)]
    assert all(v._repr_html_() == v.html and v.html.startswith('<div class="interp-view"') for v in views)
    page = Page(browser, "<!doctype html><meta charset=utf-8><link rel=icon href='data:,'>" + "".join(v.html for v in views))
    p = page.page
    p.click('[data-role="thumb"][data-layer="0"][data-head="1"]')
    p.hover('[data-role="query"][data-token="5"] .iv-text')
    assert len(page.squares("key")) == 25 * 4
    assert page.smallest_text() >= 10
    page.check_clean()
    page.close()


def test_smollm2_grid_of_270_heads_on_64_tokens_is_small_and_quick(browser, tmp_path):
    """The issue's numbers: at most 3 MB, interactive within 2 s (benchmarks/bench_views.py measures more)."""
    model = interp.load_model("smollm2")
    ids = model.to_batch(" ".join(["The old lighthouse keeper climbed the stairs at dusk and lit the lamp."] * 6),
                          max_length=64)
    assert ids["input_ids"].shape[1] == 64
    grid = attention_grid(model, ids, scores=detect_heads(model, n_prompts=8, n_bootstrap=50))
    path = grid.save(tmp_path / "grid.html")
    assert path.stat().st_size <= 3_000_000, path.stat().st_size
    start = time.perf_counter()
    page = Page(browser, path.read_text())
    p = page.page
    assert p.locator('[data-role="thumb"]').count() == 270
    ready_ms = float(p.get_attribute(".interp-view", "data-ready-ms"))
    p.click('[data-role="thumb"][data-layer="18"][data-head="6"]')
    assert ready_ms < 2000 and time.perf_counter() - start < 10, ready_ms
    page.check_clean()
    page.screenshot(tmp_path / "grid_smollm2.png")
    page.close()


def test_the_page_check_catches_requests_and_console_errors(browser):
    """The checks above could fail: a page that asks for a CDN script and logs an error is caught."""
    page = Page(browser, "<!doctype html><div class='interp-view' data-ready='1'></div>"
                         "<script src='https://cdn.example.org/lib.js'></script><script>console.error('boom')</script>")
    assert page.requests == ["https://cdn.example.org/lib.js"] and "boom" in page.errors
    with pytest.raises(AssertionError):
        page.check_clean()
    page.close()


def test_interp_view_writes_a_page_and_refuses_bad_input(tmp_path, toy, tokens, heads_df, capsys):
    head, grid = tmp_path / "head.html", tmp_path / "grid.html"
    assert main(["view", "--layers", "1", "--text", " ".join(map(str, tokens.tolist())), "--out", str(head)]) == 0
    assert head_view(toy, tokens, layers=1).html in head.read_text()  # the same view as from Python
    heads_df.to_csv(tmp_path / "heads.csv", index=False)
    assert main(["view", "grid", "--csv", str(tmp_path / "heads.csv"), "--score", "sink", "--out", str(grid)]) == 0
    assert 'data-view="grid"' in grid.read_text()
    capsys.readouterr()
    assert main(["view", "--out", str(tmp_path / "view.png")]) == 2
    assert main(["view", "grid", "--heads", "1.3", "--out", str(tmp_path / "g.html")]) == 2
    assert main(["view", "--out", str(head)]) == 2  # exists, no --force
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and ".html page" in err[0] and "interp view head" in err[1] and "--force" in err[2]
    norm = tmp_path / "norm.html"
    assert main(["view", "--layers", "1", "--text", " ".join(map(str, tokens.tolist())), "--weighting", "norm",
                 "--out", str(norm)]) == 0
    assert head_view(toy, tokens, layers=1, weighting="norm").html in norm.read_text()
    capsys.readouterr()
    assert main(["view", "grid", "--weighting", "norm", "--out", str(tmp_path / "g.html")]) == 2
    assert "--weighting go with `interp view head`" in capsys.readouterr().err
