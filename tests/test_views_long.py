"""The long-sequence view (analyses.views.long): its numbers equal the eager pattern's, and the page embeds no
n x n matrix (its size grows linearly with the prompt)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

import interp
from analyses.views.long import long_view


@pytest.fixture(scope="module")
def toy():
    return interp.load_model("toy-induction")


def _ids(n):
    x = torch.randint(1, 64, (n // 2,), generator=torch.Generator().manual_seed(0))
    return torch.cat([torch.zeros(1, dtype=torch.long), x, x])[:n]


def test_view_numbers_equal_the_eager_pattern(toy):
    ids = _ids(60)
    view = long_view(toy, ids, layer=1, zoom=(30, 60))
    eager = interp.load_model("toy-induction", attn="eager")
    _, cache = eager.run_with_cache(ids[None])
    pattern = cache.pattern(1)[0]  # (h, q, k)
    for h in range(4):
        top = np.frombuffer(base64.b64decode(view.data["top"][h]), dtype="<u4").copy()
        assert (pattern[h, torch.arange(60), torch.as_tensor(top, dtype=torch.long)]
                >= pattern[h].max(-1).values - 1e-6).all()
        zoom = np.frombuffer(base64.b64decode(view.data["zoom"]["weights"][h]), dtype="u1").reshape(30, -1)
        lo = view.data["zoom"]["keys"][0]
        want = (pattern[h, 30:60, lo:60] * 255).round().numpy()
        assert np.abs(zoom - want).max() <= 1  # 8-bit rounding of the exact weights
        assert abs(view.data["sink"][h] - float(pattern[h, :, 0].mean())) < 1e-4
        assert abs(sum(view.data["mean_offsets"][h]) - 1.0) < 1e-3  # every row's weight lands in some bucket
        prev = float(pattern[h, torch.arange(1, 60), torch.arange(59)].sum()) / 60  # distance 1, row 0 has none
        assert abs(view.data["mean_offsets"][h][1] - prev) < 1e-4


def test_page_grows_linearly_and_is_self_contained(toy, tmp_path):
    small, big = long_view(toy, _ids(32), layer=1, zoom=(24, 32)), long_view(toy, _ids(64), layer=1, zoom=(56, 64))
    per_row = [len(v.data["top"][0]) + len(v.data["weight"][0]) for v in (small, big)]
    assert abs(per_row[1] / per_row[0] - 2) < 0.1  # per-row data doubles with n; nothing n x n
    zoom = big.data["zoom"]
    assert (zoom["rows"][1] - zoom["rows"][0]) * (zoom["keys"][1] - zoom["keys"][0]) <= 8 * 64
    path = big.save(tmp_path / "long.html")
    text = path.read_text()
    assert 'data-view="long"' in text and "http" not in text.replace("http-equiv", "")
    assert text.count('<button data-role="head"') == 4


def test_bad_zoom_and_layer_are_refused(toy):
    with pytest.raises(ValueError, match="zoom is"):
        long_view(toy, _ids(32), layer=1, zoom=(10, 5))
    with pytest.raises(ValueError, match="layer must be"):
        long_view(toy, _ids(32), layer=7)


def test_a_batch_of_several_rows_is_refused_not_glued_into_one_prompt(toy):
    """ids of shape (2, 30) were read as one 60-token prompt (issue 35): a view of one prompt refuses a batch and says
    how to pick a row; one row, (1, p) or (p,), gives the same view."""
    ids = torch.stack([_ids(30), _ids(30).flip(0)])
    with pytest.raises(ValueError, match=r"one prompt.*got 2 rows.*ids\[i:i\+1\]"):
        long_view(toy, ids, layer=1)
    one, flat = long_view(toy, ids[1:2], layer=1), long_view(toy, ids[1], layer=1)
    assert one.data == flat.data and one.data["n"] == 30


def test_bad_arguments_are_refused_with_what_was_given(toy):
    """Raw errors before (issue 35): IndexError for n_buckets=0, a tuple-index TypeError for layer=1.5, "zoom ... got
    None" for empty ids, and an AttributeError (n_layers) on an encoder-decoder model."""
    from test_seq2seq import _tiny

    for empty in (torch.zeros(0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), []):
        with pytest.raises(ValueError, match="no tokens .*the ids are empty"):
            long_view(toy, empty, layer=1)
    for n_buckets in (0, -1, 1, 2.5, True):
        with pytest.raises(ValueError, match=f"n_buckets is a whole number .*got {n_buckets!r}"):
            long_view(toy, _ids(32), layer=1, n_buckets=n_buckets)
    for layer in (1.5, -1, "1", None):
        with pytest.raises(ValueError, match=f"layer must be a whole number in 0..1; got {layer!r}"):
            long_view(toy, _ids(32), layer=layer)
    with pytest.raises(TypeError, match="integer token ids"):
        long_view(toy, torch.rand(8), layer=1)
    seq2seq = interp.load_model(_tiny("t5"), attn="flash")
    with pytest.raises(ValueError, match="encoder and decoder stacks.*head_view"):
        long_view(seq2seq, _ids(16), layer=0)
    view = long_view(toy, _ids(32), layer=np.int64(1), n_buckets=2)  # a numpy layer is a layer; 2 buckets: 0 and >=1
    assert view.data["buckets"] == ["0", ">=1"] and 'data-view="long"' in view.html


def test_a_norm_weighted_long_view_equals_the_norm_weighted_eager_pattern(toy):
    """weighting="norm": top-1 keys, the weight on the first token, the distance buckets, the zoom's exact weights and
    the head scores all read on norm-weighted attention (the pattern times each key's ||v_j W_O||, rows
    renormalised), computed here by hand from HF's o_proj weight and the eager path's values."""
    ids = _ids(60)
    view = long_view(toy, ids, layer=1, zoom=(30, 60), weighting="norm")
    assert view.data["weighting"] == "norm" and "norm-weighted attention" in view.data["title"]
    assert 'data-weighting="norm"' in view.html and 'data-weighting="raw"' in long_view(toy, ids, layer=1).html
    eager = interp.load_model("toy-induction", attn="eager")
    with torch.no_grad():
        _, cache = eager.run_with_cache(ids[None])
        pattern, v = cache.pattern(1)[0].double(), cache["v", 1][0].double()  # (h, q, k), (k, g, e)
        w_o = eager.hf.model.layers[1].self_attn.o_proj.weight.double()  # (m, h * e)
    e = v.shape[-1]
    v = v.repeat_interleave(4 // v.shape[1], dim=1)
    norms = torch.stack([(v[:, h] @ w_o[:, h * e:(h + 1) * e].T).norm(dim=-1) for h in range(4)])  # (h, k)
    moved = pattern * norms[:, None, :]
    nw = moved / moved.sum(-1, keepdim=True)
    assert (nw - pattern).abs().max() > 0.01  # the two differ on this model
    for h in range(4):
        top = np.frombuffer(base64.b64decode(view.data["top"][h]), dtype="<u4").copy()
        assert (nw[h, torch.arange(60), torch.as_tensor(top, dtype=torch.long)] >= nw[h].max(-1).values - 1e-6).all()
        zoom = np.frombuffer(base64.b64decode(view.data["zoom"]["weights"][h]), dtype="u1").reshape(30, -1)
        lo = view.data["zoom"]["keys"][0]
        assert np.abs(zoom - (nw[h, 30:60, lo:60] * 255).round().numpy()).max() <= 1
        assert abs(view.data["sink"][h] - float(nw[h, :, 0].mean())) < 1e-4
        assert abs(sum(view.data["mean_offsets"][h]) - 1.0) < 1e-3
        prev = float(nw[h, torch.arange(1, 60), torch.arange(59)].sum()) / 60
        assert abs(view.data["mean_offsets"][h][1] - prev) < 1e-4
        previous = float(nw[h, torch.arange(1, 60), torch.arange(59)].mean())  # row 0 has no target
        assert abs(view.data["scores"]["previous_token"][h] - previous) < 1e-4
    with pytest.raises(ValueError, match="weighting is one of"):
        long_view(toy, ids, layer=1, weighting="value")
