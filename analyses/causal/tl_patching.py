"""TransformerLens 4.3's ``transformer_lens.patching`` with its names, signatures, shapes and meaning, on interp's hooks.

Each function runs ``corrupted_tokens`` once per index (a layer and position, a layer and head, ...) with that one
slice of one activation taken from ``clean_cache``, and returns ``patching_metric(logits)`` for each: a tensor with
one axis per index axis (``get_act_patch_resid_pre``: ``(n_layers, pos)``), or one value per row of an explicit
``index_df``. What differs from TransformerLens is how the runs are made, not what they compute: several patched
copies of the corrupted batch share a forward and the blocks before the patched layer are replayed, not recomputed
(``analyses.causal.engine.scan``, as the head scans do), so ``patching_metric`` is called on each copy's logits
``(batch, pos, d_vocab)`` and must not depend on anything else.

- k and v are patched per key/value head (``n_key_value_heads`` of them under GQA), as TransformerLens 4.3; the
  ``*_every`` functions pad those results to ``n_heads`` with zeros, as it does.
- ``hook_q``/``hook_k`` are after the rotary embedding here (before it in TransformerLens): patching a whole
  (position, head) slice from the same clean run gives the same result either way.
- A pattern patch on the flash path runs that layer eagerly for its forward (``interp.attention.paths``).

Use (as TransformerLens's demos do, with ``model``, the corrupted tokens, the clean run's cache and a metric)::

    from analyses.causal import tl_patching as patching
    patching.get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric).shape  # (n_layers, pos)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from interp.utils import get_act_name

from ..data.batches import _main_output, batch_of
from .engine import copies_per_forward, scan

__all__ = ["make_df_from_ranges", "generic_activation_patch", "layer_pos_patch_setter",
           "layer_pos_head_vector_patch_setter", "layer_head_vector_patch_setter", "layer_head_pattern_patch_setter",
           "layer_head_pos_pattern_patch_setter", "layer_head_dest_src_pos_pattern_patch_setter",
           "get_act_patch_resid_pre", "get_act_patch_resid_mid", "get_act_patch_attn_out", "get_act_patch_mlp_out",
           "get_act_patch_attn_head_out_by_pos", "get_act_patch_attn_head_q_by_pos",
           "get_act_patch_attn_head_k_by_pos", "get_act_patch_attn_head_v_by_pos",
           "get_act_patch_attn_head_pattern_by_pos", "get_act_patch_attn_head_pattern_dest_src_pos",
           "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_q_all_pos",
           "get_act_patch_attn_head_k_all_pos", "get_act_patch_attn_head_v_all_pos",
           "get_act_patch_attn_head_pattern_all_pos", "get_act_patch_attn_head_all_pos_every",
           "get_act_patch_attn_head_by_pos_every", "get_act_patch_block_every"]

AXES = ("layer", "pos", "head_index", "head", "src_pos", "dest_pos")


def make_df_from_ranges(column_max_ranges: Sequence[int], column_names: Sequence[str]) -> pd.DataFrame:
    """Every combination of ``range(m)`` for each column's ``m``, the last column varying fastest (TransformerLens's)."""
    return pd.DataFrame(list(itertools.product(*[range(m) for m in column_max_ranges])), columns=list(column_names))


def _axis_ranges(model, corrupted_tokens: torch.Tensor, activation_name: str, names: Sequence[str]) -> list[int]:
    """Each named axis's size: layers, the corrupted tokens' positions, heads (key/value heads for k and v)."""
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise ValueError(f"index_axis_names takes {list(AXES)}; got {unknown}.")
    heads = model.cfg.n_key_value_heads if activation_name in ("k", "v") else model.cfg.n_heads
    size = {"layer": model.cfg.n_layers, "pos": corrupted_tokens.shape[-1], "head_index": heads}
    size.update(head=heads, src_pos=size["pos"], dest_pos=size["pos"])
    return [size[n] for n in names]


def generic_activation_patch(model, corrupted_tokens: torch.Tensor, clean_cache, patching_metric: Callable,
                             patch_setter: Callable, activation_name: str,
                             index_axis_names: Sequence[str] | None = None, index_df: pd.DataFrame | None = None,
                             return_index_df: bool = False, per_forward: int | None = None):
    """The metric of the corrupted run with one slice of ``activation_name`` (TransformerLens's short name: "z",
    "resid_pre", "pattern", ...) taken from ``clean_cache``, for each index (TransformerLens's signature).

    Indices: every combination of ``index_axis_names`` (the first is the layer), giving a tensor with one axis per
    name; or the rows of ``index_df`` (first column the layer), giving one value per row. ``patch_setter(
    corrupted_activation, index, clean_activation)`` writes the clean slice for ``index`` into the corrupted
    activation and returns it; it gets one copy's rows of the activation, batch first. ``per_forward``: patched
    copies per forward (default: what ``copies_per_forward``'s memory budget allows; 1 runs them one by one).
    Returns the tensor (float32, on ``model.cfg.device``), and ``index_df`` too if ``return_index_df``.
    """
    if (index_df is None) == (index_axis_names is None):
        raise ValueError("generic_activation_patch takes either index_axis_names (axes to iterate over) or index_df "
                         f"(one row per patch), exactly one; got {'both' if index_df is not None else 'neither'}.")
    if index_df is None:
        shape = _axis_ranges(model, corrupted_tokens, activation_name, index_axis_names)
        index_df = make_df_from_ranges(shape, index_axis_names)
    else:
        shape = [len(index_df)]
    batch = batch_of(model, corrupted_tokens)
    indices = [[int(v) for v in row] for row in index_df.itertuples(index=False)]
    hook_names = {layer: get_act_name(activation_name, layer) for layer in {index[0] for index in indices}}
    for name in hook_names.values():
        point = model.hook_dict.get(name)
        if point is not None and getattr(point, "read_only", None):  # one line before any forward
            raise ValueError(f"{activation_name!r} cannot be patched on this model: {name} is observe-only "
                             f"({point.read_only}).")
    clean = {layer: clean_cache[name] for layer, name in hook_names.items()}

    def hooks_for(group, copies):
        by_layer: dict[int, list] = {}
        for i, index in enumerate(group):
            by_layer.setdefault(index[0], []).append((i, index))
        return [(hook_names[layer], _patching_hook(entries, clean[layer], patch_setter, copies))
                for layer, entries in by_layer.items()]

    def metric(output, _batch) -> float:
        return float(patching_metric(_main_output(output)))

    if per_forward is None:
        per_forward = copies_per_forward(model, batch, None)
    _, values = scan(model, batch, indices, lambda index: index[0], hooks_for, metric, per_forward,
                     desc=f"{len(indices)} {activation_name} patches")
    result = torch.tensor(values, dtype=torch.float32, device=model.cfg.device).reshape(shape)
    return (result, index_df) if return_index_df else result


def _patching_hook(entries, clean_activation: torch.Tensor, patch_setter: Callable, copies: int):
    """A hook that hands copy ``i``'s rows of the activation to ``patch_setter`` with ``index`` for each ``(i,
    index)`` entry; the activation is cloned first (the corrupted tensor may be read elsewhere in the forward)."""

    def hook(activation, hook=None):
        activation = activation.clone()
        b = activation.shape[0] // copies
        for i, index in entries:
            rows = activation[i * b:(i + 1) * b]
            patched = patch_setter(rows, index, clean_activation.to(activation.device, activation.dtype))
            if patched is not rows:
                activation[i * b:(i + 1) * b] = patched
        return activation

    return hook


# -- TransformerLens's patch setters: index -> the slice written (batch first) -----------------------------------
def layer_pos_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, pos]; activations laid out [batch, pos, ...] (all but attention patterns)."""
    _check_index(index, 2)
    corrupted_activation[:, index[1], ...] = clean_activation[:, index[1], ...]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, pos, head_index]; activations laid out [batch, pos, head_index, ...] (q, k, v, z, result)."""
    _check_index(index, 3)
    _, pos, head = index
    corrupted_activation[:, pos, head] = clean_activation[:, pos, head]
    return corrupted_activation


def layer_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index]: every position; activations laid out [batch, pos, head_index, ...]."""
    _check_index(index, 2)
    corrupted_activation[:, :, index[1]] = clean_activation[:, :, index[1]]
    return corrupted_activation


def layer_head_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index]; activations laid out [batch, head_index, dest_pos, src_pos] (patterns, scores)."""
    _check_index(index, 2)
    corrupted_activation[:, index[1], :, :] = clean_activation[:, index[1], :, :]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index, dest_pos]; activations laid out [batch, head_index, dest_pos, src_pos]."""
    _check_index(index, 3)
    _, head, dest = index
    corrupted_activation[:, head, dest, :] = clean_activation[:, head, dest, :]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index, dest_pos, src_pos]; activations laid out [batch, head_index, dest_pos, src_pos]."""
    _check_index(index, 4)
    _, head, dest, src = index
    corrupted_activation[:, head, dest, src] = clean_activation[:, head, dest, src]
    return corrupted_activation


def _check_index(index, n: int) -> None:
    if len(index) != n:
        raise ValueError(f"this patch setter takes an index of {n} entries (layer first); got {list(index)}. Pass "
                         "index_axis_names (or index_df columns) that match the setter.")


# -- the specialised functions ------------------------------------------------------------------------------------
def _specialise(name: str, setter: Callable, activation_name: str, axes: tuple[str, ...], what: str):
    def patch(model, corrupted_tokens, clean_cache, patching_metric, index_df=None, return_index_df=False,
              per_forward=None):
        return generic_activation_patch(model, corrupted_tokens, clean_cache, patching_metric, setter,
                                        activation_name, None if index_df is not None else axes, index_df,
                                        return_index_df, per_forward)

    shape = ", ".join({"layer": "n_layers", "head": "n_heads", "head_index": "n_heads"}.get(a, a) for a in axes)
    patch.__name__ = patch.__qualname__ = name
    patch.__doc__ = (f"Activation patching of {what}: the metric for each patch, shape [{shape}] (TransformerLens's "
                     f"``{name}``; n_heads is n_key_value_heads for k and v). See ``generic_activation_patch``.")
    return patch


_by_pos, _all_pos = ("layer", "pos", "head"), ("layer", "head")
get_act_patch_resid_pre = _specialise("get_act_patch_resid_pre", layer_pos_patch_setter, "resid_pre",
                                      ("layer", "pos"), "the residual stream at the start of each block, by position")
get_act_patch_resid_mid = _specialise("get_act_patch_resid_mid", layer_pos_patch_setter, "resid_mid",
                                      ("layer", "pos"), "the residual stream between attention and MLP, by position")
get_act_patch_attn_out = _specialise("get_act_patch_attn_out", layer_pos_patch_setter, "attn_out", ("layer", "pos"),
                                     "each attention layer's output, by position")
get_act_patch_mlp_out = _specialise("get_act_patch_mlp_out", layer_pos_patch_setter, "mlp_out", ("layer", "pos"),
                                    "each MLP layer's output, by position")
get_act_patch_attn_head_out_by_pos = _specialise("get_act_patch_attn_head_out_by_pos",
                                                 layer_pos_head_vector_patch_setter, "z", _by_pos,
                                                 "each head's output (z), by position")
get_act_patch_attn_head_q_by_pos = _specialise("get_act_patch_attn_head_q_by_pos", layer_pos_head_vector_patch_setter,
                                               "q", _by_pos, "each head's queries, by position")
get_act_patch_attn_head_k_by_pos = _specialise("get_act_patch_attn_head_k_by_pos", layer_pos_head_vector_patch_setter,
                                               "k", _by_pos, "each key/value head's keys, by position")
get_act_patch_attn_head_v_by_pos = _specialise("get_act_patch_attn_head_v_by_pos", layer_pos_head_vector_patch_setter,
                                               "v", _by_pos, "each key/value head's values, by position")
get_act_patch_attn_head_pattern_by_pos = _specialise("get_act_patch_attn_head_pattern_by_pos",
                                                     layer_head_pos_pattern_patch_setter, "pattern",
                                                     ("layer", "head_index", "dest_pos"),
                                                     "each head's attention pattern, by destination position")
get_act_patch_attn_head_pattern_dest_src_pos = _specialise(
    "get_act_patch_attn_head_pattern_dest_src_pos", layer_head_dest_src_pos_pattern_patch_setter, "pattern",
    ("layer", "head_index", "dest_pos", "src_pos"), "each entry of each head's attention pattern")
get_act_patch_attn_head_out_all_pos = _specialise("get_act_patch_attn_head_out_all_pos",
                                                  layer_head_vector_patch_setter, "z", _all_pos,
                                                  "each head's output (z) at every position at once")
get_act_patch_attn_head_q_all_pos = _specialise("get_act_patch_attn_head_q_all_pos", layer_head_vector_patch_setter,
                                                "q", _all_pos, "each head's queries at every position at once")
get_act_patch_attn_head_k_all_pos = _specialise("get_act_patch_attn_head_k_all_pos", layer_head_vector_patch_setter,
                                                "k", _all_pos, "each key/value head's keys at every position at once")
get_act_patch_attn_head_v_all_pos = _specialise("get_act_patch_attn_head_v_all_pos", layer_head_vector_patch_setter,
                                                "v", _all_pos, "each key/value head's values at every position at once")
get_act_patch_attn_head_pattern_all_pos = _specialise("get_act_patch_attn_head_pattern_all_pos",
                                                      layer_head_pattern_patch_setter, "pattern",
                                                      ("layer", "head_index"), "each head's whole attention pattern")


def _pad_heads(results: torch.Tensor, n_heads: int) -> torch.Tensor:
    """k/v results per key/value head padded with zeros to ``n_heads`` on the last axis (TransformerLens's stacking)."""
    return torch.nn.functional.pad(results, (0, n_heads - results.shape[-1]))


def _every_head(args: tuple, per_forward: int | None, out, q, k, v, pattern) -> torch.Tensor:
    """The five head patches stacked (TransformerLens's order: output, query, key, value, pattern), key and value
    padded with zeros to n_heads on the last axis (they are per key/value head under GQA), as TransformerLens 4.3."""
    out, q, k, v, pattern = (f(*args, per_forward=per_forward) for f in (out, q, k, v, pattern))
    return torch.stack([out, q, _pad_heads(k, q.shape[-1]), _pad_heads(v, q.shape[-1]), pattern], dim=0)


def get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric,
                                          per_forward: int | None = None) -> torch.Tensor:
    """Every head patched at every position at once, for output, query, key, value and pattern: shape [5, n_layers,
    n_heads] (key and value per key/value head, padded with zeros to n_heads, as TransformerLens 4.3).
    ``per_forward``: as ``generic_activation_patch``'s."""
    return _every_head((model, corrupted_tokens, clean_cache, metric), per_forward, get_act_patch_attn_head_out_all_pos,
                       get_act_patch_attn_head_q_all_pos, get_act_patch_attn_head_k_all_pos,
                       get_act_patch_attn_head_v_all_pos, get_act_patch_attn_head_pattern_all_pos)


def get_act_patch_attn_head_by_pos_every(model, corrupted_tokens, clean_cache, metric,
                                         per_forward: int | None = None) -> torch.Tensor:
    """Every head at each position, for output, query, key, value and pattern (by destination position): shape [5,
    n_layers, pos, n_heads] (key and value padded to n_heads, as TransformerLens 4.3). ``per_forward``: as
    ``generic_activation_patch``'s."""

    def pattern(*args, per_forward=None):  # (layer, head, dest_pos) -> (layer, pos, head)
        return get_act_patch_attn_head_pattern_by_pos(*args, per_forward=per_forward).transpose(1, 2)

    return _every_head((model, corrupted_tokens, clean_cache, metric), per_forward, get_act_patch_attn_head_out_by_pos,
                       get_act_patch_attn_head_q_by_pos, get_act_patch_attn_head_k_by_pos,
                       get_act_patch_attn_head_v_by_pos, pattern)


def get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric,
                              per_forward: int | None = None) -> torch.Tensor:
    """The residual stream at each block's start, each attention layer's output and each MLP's output, by
    position: shape [3, n_layers, pos]. ``per_forward``: as ``generic_activation_patch``'s."""
    args = (model, corrupted_tokens, clean_cache, metric)
    return torch.stack([f(*args, per_forward=per_forward) for f in (get_act_patch_resid_pre, get_act_patch_attn_out,
                                                                    get_act_patch_mlp_out)], dim=0)
