"""Plots: each function renders with the Agg backend to a PNG of the size asked for, with something drawn
(not blank, in colour), shows the data it was given, draws on the ``ax`` it is handed, and never calls
``plt.show()``. Inputs are real analyses of the bundled models, kept small (the module runs in seconds)."""

from __future__ import annotations

import io
import warnings

import matplotlib
import matplotlib.text

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import interp  # noqa: E402
from analyses import ablation_scan, detect_heads, pruning_curve, second_copy_loss  # noqa: E402
from analyses.views.plots import attention_heatmap, save_figure  # noqa: E402
from analyses.views.study_plots import ablation_heatmap, head_score_grid, pruning_curve_plot  # noqa: E402
from analyses.data.toy import repeated_sequences  # noqa: E402

# seaborn 0.13's heatmap calls Colormap.set_bad, which matplotlib 3.11 plans to deprecate; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")

DPI = 50
FLASH_TOL = 1e-5
# A rendered plot must have contrast (pixel std over RGB in 0..1; a blank figure has 0, empty axes 0.07) and
# colour: pixels whose channels differ by more than 0.2 (empty axes, text and frames are all grey: 0%; one
# default-width line on empty axes: 0.5%; the plots here: 0.7% to 48%).
MIN_STD = 0.05
MIN_COLOURED = 0.002
MIN_COLOURS = 8


@pytest.fixture(autouse=True)
def _no_show_and_close(monkeypatch):
    def show(*args, **kwargs):
        raise AssertionError("a plot function called plt.show(); it must only draw and return its Axes")

    monkeypatch.setattr(plt, "show", show)
    monkeypatch.setattr(plt.Figure, "show", show)
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def toy():
    return interp.load_model("toy-induction", attn="flash")


@pytest.fixture(scope="module")
def tokens():
    """Two [BOS, x, x] sequences with len(x) = 10: (2, 21)."""
    return repeated_sequences(2, 10, 64, torch.Generator().manual_seed(0), bos_token_id=0)


@pytest.fixture(scope="module")
def heads_df(toy):
    return detect_heads(toy, n_prompts=8, n_bootstrap=10)


@pytest.fixture(scope="module")
def scan_df(toy, tokens):
    return ablation_scan(toy, tokens, second_copy_loss)


@pytest.fixture(scope="module")
def curve_df(toy, tokens):
    by_importance = pruning_curve(toy, tokens, second_copy_loss, order="importance", step=0.25)
    random = pruning_curve(toy, tokens, second_copy_loss, order="random", step=0.25, seeds=(0, 1))
    return pd.concat([by_importance, random], ignore_index=True)


# -- rendering -------------------------------------------------------------------------------------------
def render(fig, dpi: int = DPI) -> np.ndarray:
    """The figure as a PNG read back: (height, width, 4) floats in 0..1."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    return plt.imread(buffer, format="png")


def assert_nontrivial(fig, dpi: int = DPI) -> np.ndarray:
    """PNG of the figure's own size x dpi, with contrast and several colours; returns the image."""
    image = render(fig, dpi)
    width, height = fig.get_size_inches() * dpi
    assert image.shape[2] == 4
    assert abs(image.shape[0] - height) <= 1 and abs(image.shape[1] - width) <= 1, \
        f"PNG is {image.shape[1]}x{image.shape[0]} px; the figure is {width:g}x{height:g} px at {dpi} dpi"
    rgb = image[..., :3]
    assert rgb.std() > MIN_STD, f"pixel std {rgb.std():.3f}: the image is (nearly) blank"
    coloured = (rgb.max(-1) - rgb.min(-1)) > 0.2
    assert coloured.mean() > MIN_COLOURED, f"only {coloured.mean():.2%} of the pixels have colour"
    colours = np.unique((rgb * 255).round().astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) >= MIN_COLOURS, f"{len(colours)} distinct colours"
    return image


def heatmap_data(ax) -> np.ndarray:
    """The values seaborn's heatmap drew on ``ax``: (rows, cols)."""
    data = np.ma.asarray(ax.collections[0].get_array(), dtype=float)
    assert data.ndim == 2, f"expected a (rows, cols) mesh; got shape {data.shape}"
    return np.ma.filled(data, np.nan)


def test_the_image_check_rejects_blank_and_colourless_figures():
    blank = plt.figure(figsize=(4, 3))
    with pytest.raises(AssertionError, match="blank"):
        assert_nontrivial(blank)
    empty_axes = plt.subplots(figsize=(4, 3))[0]
    with pytest.raises(AssertionError, match="colour"):
        assert_nontrivial(empty_axes)


# -- attention_heatmap ----------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_attention_heatmap_from_a_cache_shows_the_cached_pattern(attn, tokens):
    model = interp.load_model("toy-induction", attn=attn)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    ax = attention_heatmap(cache, 1, 1, batch=1)
    assert_nontrivial(ax.figure)
    expected = cache.pattern(1, 1)[1, 0].float().numpy()  # (q, k); flash rebuilds it from q and k
    np.testing.assert_allclose(heatmap_data(ax), expected, atol=FLASH_TOL)
    assert ax.get_title() == "head 1.1"
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(i) for i in range(tokens.shape[1])]


def test_attention_heatmap_on_both_paths_draws_the_same_pattern(tokens):
    drawn = {}
    for attn in ("eager", "flash"):
        model = interp.load_model("toy-induction", attn=attn)
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
        drawn[attn] = heatmap_data(attention_heatmap(cache, 1, 3))
    np.testing.assert_allclose(drawn["flash"], drawn["eager"], atol=FLASH_TOL)


def test_attention_heatmap_from_model_and_text_on_minilm(minilm):
    text = "The cat sat on the mat because it was tired."
    ax = attention_heatmap(minilm, 2, 5, text)
    assert_nontrivial(ax.figure)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == minilm.to_str_tokens(text)
    assert labels[0] == "[CLS]" and labels[-1] == "[SEP]"
    data = heatmap_data(ax)
    assert data.shape == (len(labels), len(labels))
    np.testing.assert_allclose(data.sum(1), 1.0, atol=1e-5)  # whole rows of a softmax


def test_attention_heatmap_from_a_tensor_with_token_labels():
    n = 12
    shifted = torch.diag(torch.ones(n - 1), -1)
    shifted[0, 0] = 1.0
    words = [f"w{i}" for i in range(n)]
    ax = attention_heatmap(shifted, tokens=words, title="previous token")
    assert_nontrivial(ax.figure)
    np.testing.assert_array_equal(heatmap_data(ax), shifted.numpy())
    assert [t.get_text() for t in ax.get_yticklabels()] == words
    assert ax.get_title() == "previous token"


def test_attention_heatmap_window_shows_that_part_of_the_pattern(toy):
    long = repeated_sequences(1, 30, 64, torch.Generator().manual_seed(1), bos_token_id=0)  # (1, 61)
    with torch.no_grad():
        _, cache = toy.run_with_cache(long)
    ax = attention_heatmap(cache, 0, 3, window=(20, -11))
    assert_nontrivial(ax.figure)
    np.testing.assert_allclose(heatmap_data(ax), cache.pattern(0, 3)[0, 0, 20:50, 20:50].numpy(), atol=FLASH_TOL)
    assert ax.get_title() == "head 0.3, positions 20..49"
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["20 20", "21 21"]


# -- per-head grids -------------------------------------------------------------------------------------
def _framed(ax) -> set[tuple[int, int]]:
    """(layer, head) of the cells framed in red (cell (x, y) = (head, layer) on a 0-based grid)."""
    return {(int(p.get_y()), int(p.get_x())) for p in ax.patches
            if isinstance(p, Rectangle) and p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)}


def test_head_score_grid_from_detect_heads_of_the_toy_model(heads_df):
    ax = head_score_grid(heads_df, "induction")
    assert_nontrivial(ax.figure)
    grid = heatmap_data(ax)  # (layer, head)
    np.testing.assert_allclose(grid, heads_df.pivot(index="layer", columns="head", values="induction").to_numpy())
    assert len(ax.texts) == 8  # one annotation per head
    labelled = {(r.layer, r.head) for r in heads_df.itertuples() if r.label == "induction"}
    assert labelled and all(layer == 1 for layer, _ in labelled)  # the toy's induction heads live in layer 1
    assert _framed(ax) == labelled


def test_ablation_heatmap_from_an_ablation_scan(scan_df):
    ax = ablation_heatmap(scan_df, metric_name="second-copy loss")
    assert_nontrivial(ax.figure)
    np.testing.assert_allclose(heatmap_data(ax), scan_df.pivot(index="layer", columns="head", values="delta").to_numpy(),
                               rtol=1e-6)
    assert ax.get_title().startswith("ablation: delta of second-copy loss (baseline ")
    assert len(ax.texts) == 8


def test_pruning_curve_plot_with_importance_and_random_orders(curve_df):
    ax = pruning_curve_plot(curve_df, metric_name="second-copy loss", threshold=1.0)
    assert_nontrivial(ax.figure)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["importance", "random (mean of 2 seeds, range shaded)"]
    importance = next(line for line in ax.lines if line.get_label() == "importance")
    expected = curve_df[curve_df.order == "importance"]
    np.testing.assert_allclose(importance.get_xdata(), expected.fraction_pruned)
    np.testing.assert_allclose(importance.get_ydata(), expected.metric)
    assert len(ax.collections) == 1  # the random seeds' range, shaded
    assert ax.get_ylabel() == "second-copy loss"


def test_pruning_curves_and_band_end_inside_the_axes(curve_df):
    """The report's pruning figure set xlim to (0, last step): the curves, their last markers and the band ran into
    the right edge as if they went on (issue 35). Every line's and the band's x data lie inside the limits, with
    room for a marker (at least 1% of the width) either side."""
    ax = pruning_curve_plot(curve_df)
    lo, hi = ax.get_xlim()
    room = 0.01 * (hi - lo)
    xs = [np.asarray(line.get_xdata(), dtype=float) for line in ax.lines if line.get_label() in
          ("importance", "random (mean of 2 seeds, range shaded)")]
    xs += [path.vertices[:, 0] for band in ax.collections for path in band.get_paths()]
    assert len(xs) == 3
    for x in xs:
        assert lo + room <= x.min() and x.max() <= hi - room, (x.min(), x.max(), (lo, hi))


# -- ax= and no show ------------------------------------------------------------------------------------
@pytest.fixture
def plot_calls(toy, tokens, heads_df, scan_df, curve_df):
    with torch.no_grad():
        _, cache = toy.run_with_cache(tokens[:1])
    return {
        "attention_heatmap(cache)": lambda ax: attention_heatmap(cache, 1, 0, ax=ax),
        "attention_heatmap(model, text)": lambda ax: attention_heatmap(toy, 0, 0, tokens[0], ax=ax),
        "attention_heatmap(tensor)": lambda ax: attention_heatmap(torch.eye(6), ax=ax),
        "head_score_grid": lambda ax: head_score_grid(heads_df, "previous_token", ax=ax),
        "ablation_heatmap": lambda ax: ablation_heatmap(scan_df, ax=ax),
        "pruning_curve_plot": lambda ax: pruning_curve_plot(curve_df, ax=ax),
    }


def test_each_plot_draws_on_the_axes_it_is_given(plot_calls):
    for name, call in plot_calls.items():
        fig, axes = plt.subplots(1, 2, figsize=(8, 3))
        before = plt.get_fignums()
        returned = call(axes[1])
        assert returned is axes[1], name
        assert plt.get_fignums() == before, f"{name} opened a new figure"
        assert axes[1].has_data() and not axes[0].has_data(), name
        image = assert_nontrivial(fig)
        assert image.shape[:2] == (3 * DPI, 8 * DPI), name
        plt.close(fig)


def test_without_ax_each_plot_makes_one_figure(plot_calls):
    for name, call in plot_calls.items():
        plt.close("all")
        ax = call(None)
        assert plt.get_fignums() == [ax.figure.number], name
        assert_nontrivial(ax.figure)


def test_plots_are_exported_from_analyses_without_importing_matplotlib_up_front():
    import subprocess
    import sys

    code = ("import sys, analyses; assert 'matplotlib' not in sys.modules, 'import analyses loaded matplotlib'; "
            "from analyses import attention_heatmap, write_report; import analyses.views.plots, analyses.views.report; "
            "assert attention_heatmap is analyses.views.plots.attention_heatmap; "
            "assert write_report is analyses.views.report.write_report")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# -- readable at 100% and vector files (issue 14) -------------------------------------------------------------
def _texts(fig) -> list:
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]


def test_no_text_under_7_5_points_so_at_100_px_per_inch_none_is_under_10_px(plot_calls, heads_df):
    wide = pd.DataFrame([{"layer": l, "head": h, "induction": (l * h % 7) / 7, "induction_lo": 0.0, "induction_hi": 1.0}
                         for l in range(30) for h in range(9)])  # SmolLM2's 30 x 9
    many = pd.DataFrame([{"layer": l, "head": h, "sink": 0.5} for l in range(4) for h in range(32)])  # 32 heads
    extra = {"head_score_grid(30 x 9)": lambda ax: head_score_grid(wide, "induction", ax=ax),
             "head_score_grid(32 heads)": lambda ax: head_score_grid(many, "sink", ax=ax)}
    long = torch.eye(64)
    for name, call in {**plot_calls, **extra,
                       "attention_heatmap(64)": lambda ax: attention_heatmap(long, ax=ax)}.items():
        plt.close("all")
        ax = call(None)
        sizes = [t.get_fontsize() for t in _texts(ax.figure)]
        assert sizes and min(sizes) >= 7.5, (name, min(sizes))
    ax = head_score_grid(many, "sink")
    assert not ax.texts  # 32 heads a layer: cells too narrow for 7.5 pt values, so none are written
    ax = attention_heatmap(long, ax=plt.subplots(figsize=(6, 5))[1])  # rows of about 4 pt: every k-th labelled
    labels = [t.get_text() for t in ax.get_xticklabels()]
    step = int(labels[1])
    assert step > 1 and labels == [str(i) for i in range(0, 64, step)]
    assert all(t.get_fontsize() >= 7.5 for t in ax.get_xticklabels())


def test_head_score_grid_writes_each_interval_below_its_value(heads_df):
    ax = head_score_grid(heads_df, "induction")
    row = heads_df.set_index(["layer", "head"]).loc[(1, 3)]
    expected = f"{row['induction']:.3f}\n{row['induction_lo']:.3f}–{row['induction_hi']:.3f}"
    assert expected in [t.get_text() for t in ax.texts]
    assert all(t.get_fontsize() >= 7.5 for t in ax.texts)
    plt.close("all")
    narrow = plt.subplots(figsize=(2.5, 2))[1]  # no room for intervals: values alone
    head_score_grid(heads_df, "induction", ax=narrow)
    assert all("–" not in t.get_text() for t in narrow.texts) and len(narrow.texts) == 8


def test_save_figure_writes_png_svg_and_pdf(tmp_path, heads_df):
    ax = head_score_grid(heads_df, "induction")
    assert save_figure(ax, tmp_path / "grid.svg").read_text().lstrip().startswith("<?xml")
    assert save_figure(ax.figure, tmp_path / "grid.pdf").read_bytes()[:5] == b"%PDF-"
    png = plt.imread(save_figure(ax, tmp_path / "grid", fmt="png", dpi=100))
    assert png.shape[0] > 100
    with pytest.raises(ValueError, match="png, svg, pdf"):
        save_figure(ax, tmp_path / "grid.jpg")


# -- tokens in every script (issue 27, item 7) ----------------------------------------------------------------
def _bengali_token() -> str:
    """A token of MiniLM's vocabulary in Bengali script (random tokens drew it as a box, with a warning)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(interp.model.loading.resolve_source("minilm"), local_files_only=True)
    return next(t for t in sorted(tokenizer.get_vocab()) if t and all("\u0980" <= c <= "\u09ff" for c in t))


def test_token_labels_draw_every_script_or_show_an_escape_never_a_box():
    """MiniLM's report warned "Glyph 2476 (BENGALI LETTER BA) missing from font(s) DejaVu Sans" and drew a box:
    a character some installed font has is drawn in that font (its family is on the label), one none has is shown
    as \\uXXXX; no glyph warning; matplotlib's settings are left as they were."""
    from analyses.views import fonts

    bengali = _bengali_token()
    tokens = [bengali, "中文", " said", "\u0378"]  # U+0378 is unassigned: no font has a glyph for it
    pattern = torch.softmax(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), -1)
    family_before = list(matplotlib.rcParams["font.family"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ax = attention_heatmap(pattern, tokens=tokens)
        ax.figure.savefig(io.BytesIO(), format="png", dpi=DPI)
    assert not [w for w in caught if "missing from font" in str(w.message)], [str(w.message) for w in caught]
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        text = [t.get_text() for t in labels]
        families = labels[0].get_fontfamily()
        assert families[0] == "DejaVu Sans" and text[2] == "␣said" and text[3] == "\\u0378"
        for token, label in zip(tokens[:2], text):
            expected = "".join(c if fonts._family_of(c) else f"\\u{ord(c):04x}" for c in token)
            assert label == expected, (token, label)
            assert all(fonts._family_of(c) in families for c in token if fonts._family_of(c))
    assert matplotlib.rcParams["font.family"] == family_before and matplotlib.get_backend().lower() == "agg"


def _saved_tight(fig) -> np.ndarray:
    from PIL import Image

    from analyses.views.report_parts import _DPI
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return np.asarray(Image.open(buffer).convert("RGB")).astype(int)


def test_the_reports_figure_pixels_are_savefigs_tight_picture(heads_df):
    """The report cuts its figures from the canvas instead of saving and re-reading a PNG: the size
    savefig(bbox_inches="tight") gives (to a pixel: savefig measures text in its own draw, which can differ from
    the canvas's by a fraction of a pixel), the same picture up to anti-aliasing (savefig draws shifted by a
    fraction of a pixel), the figure's dpi unchanged; and a figure with text beyond its edges still grows as
    savefig grows it."""
    from analyses.views.report_parts import _drawn

    fig, ax = plt.subplots(figsize=(6.0, 5.0), layout="constrained")
    head_score_grid(heads_df, "induction", ax=ax)
    dpi, expected = fig.dpi, _saved_tight(fig)
    got = np.asarray(_drawn(fig)).astype(int)
    assert fig.dpi == dpi
    assert all(abs(a - b) <= 1 for a, b in zip(got.shape, expected.shape))
    rows, cols = min(got.shape[0], expected.shape[0]), min(got.shape[1], expected.shape[1])
    difference = np.abs(got[:rows, :cols] - expected[:rows, :cols])
    assert difference.mean() < 2.0                      # grey levels of 255: edges of glyphs differ, nothing else
    assert (difference.max(-1) > 128).mean() < 0.02
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(4.0, 3.0))
    ax.plot([0, 1], [0, 1])
    ax.text(1.6, 0.5, "far beyond the right edge", transform=ax.transAxes)
    expected = _saved_tight(fig)
    assert expected.shape[1] > 4.0 * 200                # savefig grew the canvas to hold the text
    assert np.asarray(_drawn(fig)).shape == expected.shape
    plt.close(fig)


def test_attention_heatmap_of_a_model_in_training_mode_is_its_eval_pattern(tokens):
    """attention_heatmap(model, ...) ran the model as it was: in training mode with dropout on, a pattern drawn from a
    dropped-out run, and torch's global RNG moved (issue 35). It runs in ``model.studying()``: the eval pattern, the
    RNG as it was, the model left in training mode."""
    model = interp.load_model("toy-induction", attn="flash")
    for layer in model.hf.model.layers:
        layer.self_attn.attention_dropout = 0.3
    want = attention_heatmap(model, 1, 3, tokens[0]).collections[0].get_array()
    model.hf.train()
    rng = torch.random.get_rng_state()
    got = attention_heatmap(model, 1, 3, tokens[0]).collections[0].get_array()
    np.testing.assert_array_equal(got, want)
    assert torch.equal(torch.random.get_rng_state(), rng) and model.hf.training
