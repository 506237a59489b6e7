"""Head slicing (structural pruning): cut attention heads out of a HF model's q/k/v/o weights.

``analyses.prune_model`` decides which heads go; this module does the slicing and the bookkeeping that
loading needs, so that ``interp`` never imports ``analyses``. A pruned model records the heads it keeps,
in the original numbering, in its config::

    config.interp_pruned_heads = {layer: [kept heads]}   # layers not listed keep all their heads
    config.interp_pruned_heads = {site: [kept heads]}    # an encoder-decoder model: per site name

From that record and the original ``num_attention_heads``/``num_key_value_heads`` the layout of every
layer follows (``plan_layer``), so a saved folder is rebuilt by slicing a freshly built model the same
way and then loading its weights (``from_pretrained_pruned``).

Rules, and why:

- **Grouped-query attention.** The attention function repeats each key/value head ``n_rep = q_heads //
  kv_heads`` times, so every remaining key/value head must serve the same number of consecutive query
  heads. A KV head goes only when all its query heads go. When the surviving groups keep different
  numbers of query heads (sizes ``s_g``), each KV head serves ``r = gcd(s_g)`` query heads and the KV head
  of a group that keeps ``s_g`` heads is duplicated ``s_g / r`` times. The result is exact; it is smallest
  when every group keeps the same number of heads (then nothing is duplicated), and ``kv_heads`` can grow
  when groups are pruned unevenly.
- **A layer with no heads left.** transformers' attention modules reshape with ``-1`` heads and cannot run
  with none, so such a layer keeps one placeholder head whose q/k/v/o weights and biases are zero: its
  output is exactly the output projection's bias, as zero-ablating every head gives.
"""

from __future__ import annotations

import math
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.pytorch_utils import Conv1D

from .projections import Projections, _per_head_params
from .seq2seq import _discover
from .layered import Structure, discover

__all__ = ["CONFIG_KEY", "LayerPlan", "plan_layer", "kept_heads", "slice_heads", "slice_sites", "check_head_counts",
           "from_pretrained_pruned", "save_pruned"]

CONFIG_KEY = "interp_pruned_heads"


@dataclass(frozen=True)
class LayerPlan:
    """The layout of one pruned layer, in original head numbers.

    q: the original query head behind each remaining query head, in order.
    kv: the original key/value head behind each remaining key/value head (may repeat, see the module doc).
    placeholder: the layer lost every head and keeps one zeroed head (``q == kv == (0,)``).
    """

    q: tuple[int, ...]
    kv: tuple[int, ...]
    placeholder: bool = False

    @property
    def group(self) -> int:
        """Query heads per key/value head after pruning (the attention function's ``n_rep``)."""
        return len(self.q) // len(self.kv)


def plan_layer(n_heads: int, n_kv_heads: int, kept: Sequence[int]) -> LayerPlan:
    """The layer layout that keeps the query heads ``kept`` of ``n_heads`` (``n_kv_heads`` KV heads).

    >>> plan_layer(8, 2, [0, 1, 2, 3, 4, 5])   # groups keep 4 and 2 heads: each KV head serves 2
    LayerPlan(q=(0, 1, 2, 3, 4, 5), kv=(0, 0, 1), placeholder=False)
    >>> plan_layer(8, 2, [4, 6])
    LayerPlan(q=(4, 6), kv=(1,), placeholder=False)
    """
    kept = sorted(set(int(h) for h in kept))
    if any(not 0 <= h < n_heads for h in kept):
        raise ValueError(f"Kept heads must lie in 0..{n_heads - 1}; got {kept}.")
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads cannot be grouped over {n_kv_heads} key/value heads.")
    if not kept:
        return LayerPlan(q=(0,), kv=(0,), placeholder=True)
    group = n_heads // n_kv_heads
    sizes = {}
    for h in kept:  # kept is sorted, so the groups come out in order
        sizes[h // group] = sizes.get(h // group, 0) + 1
    r = math.gcd(*sizes.values())
    kv = tuple(g for g, s in sizes.items() for _ in range(s // r))
    return LayerPlan(q=tuple(kept), kv=kv)


def _original_counts(config) -> tuple[int, int, int]:
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    return config.num_hidden_layers, n_heads, n_kv


def kept_heads(config) -> dict[int, list[int]]:
    """Every layer's kept heads, in original numbering (all heads for a model that was never pruned)."""
    n_layers, n_heads, _ = _original_counts(config)
    record = getattr(config, CONFIG_KEY, None) or {}
    if not isinstance(record, Mapping):
        raise ValueError(f"config.{CONFIG_KEY} must map layer -> kept heads; got {type(record).__name__}.")
    kept = {layer: list(range(n_heads)) for layer in range(n_layers)}
    for layer, heads in record.items():  # JSON turns the int keys into strings
        layer = int(layer)
        if not 0 <= layer < n_layers:
            raise ValueError(f"config.{CONFIG_KEY} names layer {layer}; layers run 0..{n_layers - 1}.")
        kept[layer] = sorted(int(h) for h in heads)
    return kept


# -- slicing ---------------------------------------------------------------------------------------------
def _head_rows(heads: Sequence[int], d_head: int, offset: int = 0) -> torch.Tensor:
    """Feature indices of ``heads`` in a (h d) axis: head h owns features h*d .. h*d + d - 1."""
    idx = torch.tensor(heads, dtype=torch.long)[:, None] * d_head + torch.arange(d_head)
    return idx.flatten() + offset


def _weight_axes(module: torch.nn.Module) -> tuple[int, int]:
    """(output axis, input axis) of a projection's weight: Linear is (out, in), GPT-2's Conv1D (in, out)."""
    if isinstance(module, Conv1D):
        return 1, 0
    if isinstance(module, torch.nn.Linear):
        return 0, 1
    raise TypeError(f"Cannot slice heads out of a {type(module).__name__}; expected nn.Linear or Conv1D.")


def _select(module: torch.nn.Module, index: torch.Tensor, side: str, zero: torch.Tensor | None = None) -> None:
    """Keep only features ``index`` on the ``side`` ("out" or "in") of a projection, in place.

    zero: positions (in the new numbering) whose weights, and output bias, are set to 0.
    """
    out_axis, in_axis = _weight_axes(module)
    axis = out_axis if side == "out" else in_axis
    index = index.to(module.weight.device)
    weight = module.weight.detach().index_select(axis, index).clone()
    if zero is not None:
        weight.index_fill_(axis, zero.to(weight.device), 0)
    module.weight = torch.nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    if side == "out" and module.bias is not None:
        bias = module.bias.detach().index_select(0, index).clone()
        if zero is not None:
            bias.index_fill_(0, zero.to(bias.device), 0)
        module.bias = torch.nn.Parameter(bias, requires_grad=module.bias.requires_grad)
    n = len(index)
    if isinstance(module, Conv1D):
        if side == "out":
            module.nf = n
        else:
            module.nx = n
    elif side == "out":
        module.out_features = n
    else:
        module.in_features = n


def _slice_layer(block: torch.nn.Module, attn: torch.nn.Module, proj: Projections, o_proj: torch.nn.Module,
                 local: LayerPlan, n_q: int, n_kv: int, d: int, e: int) -> None:
    """Slice one layer to ``local`` (head numbers of the module as it is now: n_q query, n_kv KV heads)."""
    q_idx, kv_idx, v_idx = _head_rows(local.q, d), _head_rows(local.kv, d), _head_rows(local.kv, e)

    def zero(index):
        return torch.arange(len(index)) if local.placeholder else None

    if proj.layout == "separate":
        for path, index in ((proj.q, q_idx), (proj.k, kv_idx), (proj.v, v_idx)):
            _select(block.get_submodule(path), index, "out", zero(index))
    elif proj.layout == "concat":  # [q | k | v] along the output features
        index = torch.cat([q_idx, kv_idx + n_q * d, v_idx + n_q * d + n_kv * d])
        _select(block.get_submodule(proj.q), index, "out", zero(index))
    else:  # "interleaved": [q_h | k_h | v_h] per head, query and key/value heads the same
        index = _head_rows(local.q, 3 * d)
        _select(block.get_submodule(proj.q), index, "out", zero(index))
    _select(o_proj, _head_rows(local.q, e), "in", zero(_head_rows(local.q, e)))
    for path, side, width in proj.per_head:
        index = _head_rows(local.q if side == "q" else local.kv, width)
        owner, name = path.rsplit(".", 1)
        module = block.get_submodule(owner)
        param = getattr(module, name)
        value = param.detach().index_select(0, index.to(param.device)).clone()
        if local.placeholder:
            value.zero_()
        setattr(module, name, torch.nn.Parameter(value, requires_grad=param.requires_grad))
    _set_counts(attn, len(local.q), len(local.kv), d)


def _set_counts(attn: torch.nn.Module, n_q: int, n_kv: int, d_head: int) -> None:
    """Update the head-count attributes HF attention modules read in forward (most reshape with -1)."""
    for name, value in (("num_heads", n_q), ("num_attention_heads", n_q), ("all_head_size", n_q * d_head),
                        ("split_size", n_q * d_head), ("num_key_value_groups", n_q // n_kv),
                        ("num_key_value_heads", n_kv), ("n_heads", n_q)):
        if hasattr(attn, name) and isinstance(getattr(attn, name), int):
            setattr(attn, name, value)


def slice_heads(hf: torch.nn.Module, structure: Structure, keep: Mapping[int, Sequence[int]]) -> None:
    """Slice ``hf`` in place so that layer ``l`` keeps the query heads ``keep[l]`` (original numbering).

    ``structure`` is ``interp.structure.layered.discover(hf)``. ``hf`` may already be pruned (its config records what
    it kept); every layer of ``keep`` must be a subset of what the layer keeps now. Records the result in
    ``hf.config.interp_pruned_heads``. Raises NotImplementedError, naming the reason, for a layer whose
    projections are not a layout it can slice.
    """
    config = hf.config
    n_layers, n_heads, n_kv = _original_counts(config)
    before = kept_heads(config)
    blocks = hf.get_submodule(structure.layers)
    record = {layer: heads for layer, heads in before.items() if len(heads) < n_heads}
    for layer, heads in keep.items():
        layer, heads = int(layer), sorted(set(int(h) for h in heads))
        if not 0 <= layer < n_layers:
            raise ValueError(f"Layer {layer} is out of range; layers run 0..{n_layers - 1}.")
        missing = sorted(set(heads) - set(before[layer]))
        if missing:
            raise ValueError(f"Layer {layer} no longer has heads {missing} (it keeps {before[layer]}).")
        if heads == before[layer]:
            continue
        proj = structure.projections[layer]
        if isinstance(proj, str):
            raise NotImplementedError(f"Cannot prune heads of this {config.model_type} model (layer {layer}): {proj}.")
        attention = structure.layer_attn[layer]
        old, new = plan_layer(n_heads, n_kv, before[layer]), plan_layer(n_heads, n_kv, heads)
        if (len(old.q), len(old.kv)) != (attention.n_heads, attention.n_kv_heads):
            raise NotImplementedError(
                f"Cannot prune this {config.model_type} model: layer {layer} runs {attention.n_heads} query and "
                f"{attention.n_kv_heads} key/value heads but its config implies {len(old.q)} and {len(old.kv)}.")
        # Map the new layout to head numbers of the module as it is now.
        q_local = [0] if new.placeholder else [old.q.index(h) for h in new.q]
        kv_local = [0] if new.placeholder else [old.kv.index(g) for g in new.kv]
        local = LayerPlan(q=tuple(q_local), kv=tuple(kv_local), placeholder=new.placeholder)
        block = blocks[layer]
        _slice_layer(block, block.get_submodule(structure.attn[layer]), proj,
                     block.get_submodule(structure.o_proj[layer]), local, len(old.q), len(old.kv),
                     attention.d_head, attention.d_head_v)
        record[layer] = heads
    setattr(config, CONFIG_KEY, {layer: record[layer] for layer in sorted(record)})


def slice_sites(hf: torch.nn.Module, keep: Mapping[str, Sequence[int]]) -> None:
    """An encoder-decoder model's ``slice_heads``: slice ``hf`` in place so that site ``name`` (``"encoder.blocks.0.attn"``,
    ``"decoder.blocks.1.cross_attn"``, ...) keeps the heads ``keep[name]`` (original numbering), recorded in
    ``hf.config.interp_pruned_heads`` by site name. Sites are found by the probe (``interp.structure.seq2seq``).
    Raises NotImplementedError, naming the reason, where a model's heads cannot be sliced per site."""
    config = hf.config
    sites, _, _, modules, layout, _ = _discover(hf)
    by_name = {site.name: site for site in sites}
    for site in sites:  # first, whether any site ties heads together (checked on every site: T5 shares them)
        reason = _unsliceable(site, modules[site.name], layout[site.name][0])
        if reason is not None:
            raise NotImplementedError(f"Cannot prune heads of this {config.model_type} model: {site.name}: {reason}.")
    before = {str(k): sorted(int(h) for h in v) for k, v in (getattr(config, CONFIG_KEY, None) or {}).items()}
    record = dict(before)
    for name, heads in keep.items():
        if name not in by_name:
            raise ValueError(f"{name!r} is not an attention site of this model; sites are {', '.join(by_name)}.")
        site, heads = by_name[name], sorted(set(int(h) for h in heads))
        current = before.get(name, list(range(site.n_heads)))
        missing = sorted(set(heads) - set(current))
        if missing:
            raise ValueError(f"{name} no longer has heads {missing} (it keeps {current}).")
        if heads == current:
            continue
        if site.n_heads != site.n_kv_heads:
            raise NotImplementedError(f"Cannot prune {name}: it groups {site.n_heads} query heads over "
                                      f"{site.n_kv_heads} key/value heads, which encoder-decoder pruning does not handle.")
        n = max([*current, *heads, 0]) + 1
        old, new = plan_layer(n, n, current), plan_layer(n, n, heads)
        local = LayerPlan(q=(0,) if new.placeholder else tuple(old.q.index(h) for h in new.q),
                          kv=(0,) if new.placeholder else tuple(old.q.index(h) for h in new.q),
                          placeholder=new.placeholder)
        attn = modules[name]
        _slice_layer(attn, attn, layout[name][0], attn.get_submodule(site.o_proj), local, len(old.q), len(old.q),
                     site.d_head, site.d_head_v)
        record[name] = heads
    setattr(config, CONFIG_KEY, {name: record[name] for name in by_name if name in record})


def _unsliceable(site, attn: torch.nn.Module, proj: Projections | str) -> str | None:
    """Why a site's heads cannot be sliced out of its attention module, or None."""
    if isinstance(proj, str):
        return proj
    if site.o_proj is None:
        return "no linear map reads z (the heads' outputs) directly, so there is nothing to slice per head"
    linears = [attn.get_submodule(path) for path in (proj.q, proj.k, proj.v, site.o_proj)]
    names = {m: n for n, m in attn.named_modules()}
    extra = _per_head_params(attn, linears, site.n_heads, site.n_kv_heads, site.d_head, names)
    if isinstance(extra, str):
        return (f"{extra.replace('the attention module', 'its attention module')}. A parameter not split per head "
                "along its first axis, such as T5's relative position bias (one column per head, computed in the "
                "stack's first block and passed to every later block), ties the heads of different blocks together, "
                "so no site's heads can be removed alone")
    return f"per-head parameters outside its projections ({', '.join(p for p, _, _ in extra)})" if extra else None


def check_head_counts(blocks, s: Structure) -> None:
    """Raise if a layer's output projection does not take ``heads * d_head_v`` features (config and weights
    disagree, e.g. a pruned folder loaded without its ``interp_pruned_heads`` record)."""
    for layer, (block, path) in enumerate(zip(blocks, s.o_proj)):
        if path is None:
            continue
        o_proj = block.get_submodule(path)
        n, e = s.layer_attn[layer].n_heads, s.layer_attn[layer].d_head_v
        got = o_proj.weight.shape[_weight_axes(o_proj)[1]]
        if got != n * e:
            raise ValueError(
                f"Layer {layer}: the attention runs {n} heads of size {e} ({n * e} features) but the output "
                f"projection takes {got}. A pruned model must keep config.{CONFIG_KEY}; load pruned folders with "
                "interp.load_model."
            )


# -- loading ---------------------------------------------------------------------------------------------
def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return load_file(single)
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(folder / name))
        return state
    raise FileNotFoundError(
        f"{folder} records pruned heads but holds no model.safetensors; save pruned models with "
        "save_pretrained (safetensors, the default)."
    )


def from_pretrained_pruned(model_class, folder: Path, config, attn_key: str,
                           dtype: torch.dtype | None) -> torch.nn.Module:
    """Build the model ``config`` describes, slice it as its ``interp_pruned_heads`` says, load the weights."""
    record = dict(getattr(config, CONFIG_KEY))
    by_site = getattr(config, "is_encoder_decoder", False)  # recorded per site name (slice_sites), else per layer
    keep = None if by_site else kept_heads(config)
    setattr(config, CONFIG_KEY, {})  # build the unpruned shape first, then slice to the record
    kwargs = {"attn_implementation": attn_key}
    if dtype is not None:
        kwargs["dtype"] = dtype
    build = getattr(model_class, "from_config", None) or model_class._from_config  # Auto classes, or the class itself
    hf = build(config, **kwargs)
    if by_site:
        slice_sites(hf, record)
    else:
        slice_heads(hf, discover(hf), {int(layer): keep[int(layer)] for layer in record})
    state = _read_state_dict(folder)
    result = hf.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(
            f"{folder}: weights that the pruned model has no place for: {result.unexpected_keys[:5]}. A pruned model "
            "saved with the HF model's own save_pretrained is stored in transformers' checkpoint layout (for MoE "
            "and some other families it renames or splits weights); save it with HookedModel.save_pretrained, "
            "which keeps the model's own layout."
        )
    loaded = {t.data_ptr() for name, t in hf.state_dict().items() if name in state}
    untied = [k for k in result.missing_keys if hf.state_dict()[k].data_ptr() not in loaded]
    if untied:
        raise ValueError(f"{folder}: weights missing from the checkpoint: {untied[:5]}")
    return hf


def save_pruned(hf: torch.nn.Module, folder: Path) -> None:
    """Save a pruned model's config and its weights in the module's own layout (``state_dict`` names and shapes,
    tied weights once), which ``from_pretrained_pruned`` reads back as it is. transformers' save_pretrained would
    convert some families' weights to their checkpoint layout (fused MoE experts split per expert, renamed
    keys), and undoing that needs its internal loading machinery."""
    from safetensors.torch import save_model

    folder.mkdir(parents=True, exist_ok=True)
    hf.config.architectures = [type(hf).__name__]  # as save_pretrained records it: loading builds this class
    hf.config.save_pretrained(folder)
    if getattr(hf, "generation_config", None) is not None and hf.can_generate():
        hf.generation_config.save_pretrained(folder)
    save_model(hf, str(folder / "model.safetensors"), metadata={"format": "pt"})
