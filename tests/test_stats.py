"""interp.attention.stats: the tiled statistics equal the same statistics read off the eager pattern (<= 1e-5), for every
feature the flash path supports (windows, soft-cap, sinks, GQA, T5 position bias, padding, decode rows), with the
logsumexp computed here or taken from the flash path's kernel, and with tiles small enough to split every row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interp.attention.paths import eager_attention, flash_attention
from interp.attention.stats import attention_stats, bucket_labels, offset_buckets

TOL = 1e-5


class _Module(torch.nn.Module):
    def __init__(self, groups: int, causal: bool):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = causal
        self.eval()


def _allowed(b, n_q, n_k, causal, window, valid):
    dist = torch.arange(n_k)[None] - (torch.arange(n_q)[:, None] + n_k - n_q)
    before, after = window
    after = 0 if causal else after
    ok = torch.ones(n_q, n_k, dtype=torch.bool)
    if before is not None:
        ok &= dist >= -before
    if after is not None:
        ok &= dist <= after
    return ok[None, None] & valid[:, None, None, :]  # (b, 1, q, k)


def _reference(q, k, scale, causal, window, valid, softcap, sinks, bias):
    """The eager path's pattern (b, h, q, k) and which keys each row may see."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    allowed = _allowed(b, n_q, n_k, causal, window, valid)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    v = torch.zeros_like(k)
    _, pattern = eager_attention(_Module(h // k.shape[1], causal), q, k, v, mask, scaling=scale, softcap=softcap,
                                 s_aux=sinks, position_bias=bias)
    return pattern, allowed.expand(b, h, n_q, n_k)


def _flash_lse(q, k, scale, causal, window, valid, softcap, sinks, bias):
    """The logsumexp the flash path's hook_lse reports for the same call."""
    b, h, n_q, _ = q.shape
    allowed = _allowed(b, n_q, k.shape[2], causal, window, valid)
    mask = torch.where(allowed, 0.0, float("-inf"))
    seen = []

    class Hooks:  # just enough of LayerHooks for flash_attention to fire hook_lse
        q = k = v = z = attn_scores = pattern = None
        any, causal, bias = True, None, None

        @staticmethod
        def lse(x):
            seen.append(x)
            return x

    module = _Module(h // k.shape[1], causal)
    module._interp_hooks = Hooks()
    flash_attention(module, q, k, torch.zeros_like(k), mask, scaling=scale, softcap=softcap, s_aux=sinks,
                    position_bias=bias)
    return seen[0]


def _check(case):
    b, n_k, n_q, g, group, d, causal, window, lengths, softcap, with_sinks, with_bias, given_lse, budget, seed = case
    torch.manual_seed(seed)
    h = g * group
    q, k = torch.randn(b, h, n_q, d) * 2, torch.randn(b, g, n_k, d) * 2
    valid = torch.zeros(b, n_k, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, n_k - n:] = True  # left padding
    sinks = torch.randn(h) if with_sinks else None
    bias = torch.randn(1, h, n_q, n_k) if with_bias else None
    scale = d ** -0.5
    args = (q, k, scale, causal, window, valid, softcap, sinks, bias)
    pattern, allowed = _reference(*args)
    lse = _flash_lse(*args) if given_lse else None
    needle = torch.zeros(b, n_k, dtype=torch.bool)
    needle[:, n_k // 3: n_k // 2 + 1] = True
    pb, pq, pk = torch.randint(b, (20,)), torch.randint(n_q, (20,)), torch.randint(n_k, (20,))
    stats = attention_stats(q, k, scale, lse, causal=causal, window=window, key_valid=valid, softcap=softcap,
                            sinks=sinks, bias=bias, n_sink=2, n_buckets=5, key_sets={"needle": needle},
                            pairs={"p": (pb, pq, pk)}, budget=budget)

    live = allowed.any(-1)  # rows with a key to see; eager spreads a fully masked row evenly, the kernel gives 0
    w = torch.where(allowed, pattern, 0.0)
    first = valid.int().argmax(1)
    keys = torch.arange(n_k)
    in_sink = (keys[None] >= first[:, None]) & (keys[None] < first[:, None] + 2)
    dist = keys[None] - (torch.arange(n_q)[:, None] + n_k - n_q)
    bucket = offset_buckets(dist, 5)
    expect = {
        "top_weight": w.max(-1).values,
        "sink": (w * in_sink[:, None, None]).sum(-1),
        "entropy": -torch.where(w > 0, w * w.clamp(min=1e-30).log(), 0.0).sum(-1),
        "total": w.sum(-1),
    }
    for name, want in expect.items():
        got = getattr(stats, name)
        assert torch.allclose(got[live], want[live], atol=TOL), (name, (got - want)[live].abs().max())
    offsets = torch.stack([(w * (bucket == i)).sum(-1) for i in range(5)], -1)
    assert torch.allclose(stats.offsets[live], offsets[live], atol=TOL)
    assert torch.allclose(stats.key_sets["needle"][live], (w * needle[:, None, None]).sum(-1)[live], atol=TOL)
    # the top-1 key holds the top weight (ties may pick either key)
    top = torch.where(live, stats.top_index, 0)
    picked = w.gather(-1, top[..., None])[..., 0]
    assert torch.allclose(picked[live], expect["top_weight"][live], atol=TOL)
    assert (stats.top_index[~live] == -1).all() and (stats.total[~live] == 0).all()
    assert torch.allclose(stats.pairs["p"], w[pb, :, pq, pk], atol=TOL)


@st.composite
def cases(draw):
    b = draw(st.integers(1, 2))
    n_k = draw(st.integers(1, 14))
    n_q = draw(st.sampled_from([n_k, 1, max(1, n_k // 2)]))
    g, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8]))
    causal = draw(st.booleans())
    window = (draw(st.sampled_from([None, 1, 3])), None if causal else draw(st.sampled_from([None, 0, 2])))
    lengths = [draw(st.integers(1, n_k)) for _ in range(b)]
    softcap = draw(st.sampled_from([None, 2.0]))
    return (b, n_k, n_q, g, group, d, causal, window, lengths, softcap, draw(st.booleans()), draw(st.booleans()),
            draw(st.booleans()), draw(st.sampled_from([3, 40, 1 << 22])), draw(st.integers(0, 2 ** 16)))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_stats_match_eager_pattern(case):
    _check(case)


@pytest.mark.parametrize("feature", ["plain", "window", "softcap", "sinks", "bias", "padding", "decode"])
def test_each_feature_in_small_tiles(feature):
    """One case per feature, tiles of 3 elements so that every row crosses several key tiles."""
    case = dict(b=2, n_k=13, n_q=13, g=2, group=2, d=8, causal=True, window=(None, None), lengths=[13, 13],
                softcap=None, sinks=False, bias=False)
    case.update({"window": {"window": (3, None)}, "softcap": {"softcap": 2.0}, "sinks": {"sinks": True},
                 "bias": {"bias": True, "causal": False}, "padding": {"lengths": [13, 6]},
                 "decode": {"n_q": 1}, "plain": {}}[feature])
    for lse in (False, True):
        _check((case["b"], case["n_k"], case["n_q"], case["g"], case["group"], case["d"], case["causal"],
                case["window"], case["lengths"], case["softcap"], case["sinks"], case["bias"], lse, 3, 1))


def test_buckets_and_labels():
    assert offset_buckets(torch.tensor([0, 1, 2, 3, 4, 7, 8, 100, -3]), 5).tolist() == [0, 1, 2, 2, 3, 3, 4, 4, 2]
    assert bucket_labels(5) == ["0", "1", "2-3", "4-7", ">=8"]


def test_shape_errors_say_what_was_expected():
    with pytest.raises(ValueError, match="multiple of g"):
        attention_stats(torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8), 1.0)
    with pytest.raises(ValueError, match="last q of the k"):
        attention_stats(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 4, 8), 1.0)


@pytest.mark.parametrize("budget", [3, 40, 1 << 22])
@pytest.mark.parametrize("window", [(None, None), (3, None)])
def test_top_index_alone_is_the_eager_argmax(budget, window):
    """``fields=("top_index",)`` (the positional score's pass) picks its own tiles and reads indices only for rows that
    improve; its top-1 key is still the eager pattern's argmax, with padding, windows and any tile size."""
    torch.manual_seed(0)
    b, h, g, n, d = 2, 4, 2, 37, 8
    q, k = torch.randn(b, h, n, d) * 2, torch.randn(b, g, n, d) * 2
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :9] = False
    pattern, allowed = _reference(q, k, d ** -0.5, True, window, valid, None, None, None)
    top = attention_stats(q, k, 1.0, causal=True, window=window, key_valid=valid, fields=("top_index",),
                          budget=budget).top_index
    live = allowed.any(-1)
    assert torch.equal(top[live], torch.where(allowed, pattern, -1.0).argmax(-1)[live])
    assert (top[~live] == -1).all()


@pytest.mark.parametrize("fields", [("top_index",), ("top_index", "top_weight", "total")])
def test_a_non_finite_key_no_row_may_see_changes_nothing(fields):
    """Blocks are masked by adding 0 / -inf, which turns an inf score into NaN; such a block is masked exactly again,
    so an inf key after the diagonal leaves every earlier row as it was."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 2, 24, 8), torch.randn(1, 1, 24, 8)
    bad = k.clone()
    bad[0, 0, 20, 0] = float("inf")
    clean, dirty = (attention_stats(q, keys, 0.5, causal=True, fields=fields, budget=1 << 22) for keys in (k, bad))
    for name in fields:
        assert torch.equal(getattr(dirty, name)[..., :20], getattr(clean, name)[..., :20]), name
