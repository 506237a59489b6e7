"""Where a HF model keeps what the hooks need, found by one probe forward instead of listed per family.

During the probe, our eager attention records every call (the module, q, k, v, z, the mask and what the
model passed: scale, soft-cap, sinks) and every module records its first input and output. From that:

- **blocks**: the ``nn.ModuleList`` whose elements each hold one of the attention modules, in call order;
- **o_proj**: the linear map whose input equals z flattened over heads (hook_result and pruning need it);
- **attn_out**: o_proj's output (the attention module's output if no o_proj is found);
- **resid_mid**: in a pre-norm block, the first module after attention whose input is a fresh tensor (neither
  the block's input nor any module's output): the residual stream after the attention sublayer, observe only,
  since the block adds its residual from its own variable. In a post-norm block (the block's output is a
  norm's output, BERT) the first norm after attention whose input is fresh: its output is the residual
  stream, and editable. Parallel blocks (GPT-NeoX, Phi, Cohere) have none: attention and MLP read the same
  input;
- **mlp**: the module whose output is what the MLP branch adds (``y - h``, or for post-norm blocks the final
  norm's input minus ``h``), found by value; when that is a norm (Gemma 2/3, OLMo2), the module that feeds it;
- **per layer**: heads, head sizes, the scale, the soft-cap, the sinks, and the window of keys each query may
  see, read off HF's own mask function for that layer (so ModernBERT's local windows and Gemma's sliding
  layers come from what the model does, not from config fields);
- **projections** (for pruning): q/k/v as separate linears, one concatenated ``[q | k | v]`` linear or one
  per-head interleaved linear (GPT-NeoX), told apart by where v's values appear; anything else is recorded as
  the reason pruning refuses.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch

from ..attention.paths import Recording, softmax_upcasts
from .probe import _close, _find_blocks, _is_linear, _is_norm, _ModuleLog, _probe_ids, probe
from .projections import Projections, _projections
from ..attention.sites import Site
from .probe import attention_keys, set_attention_key  # noqa: F401  (public here, as before)

__all__ = ["Projections", "Structure", "attention_keys", "describe", "discover", "set_attention_key"]

_BIG = 1 << 20  # query position at which a layer's mask function is read (windows longer than this are "none")


@dataclass(frozen=True)
class Structure:
    """The discovered structure; every path is relative to a block unless it says otherwise."""

    layers: str  # from the HF model's root to the ModuleList of blocks
    attn: tuple[str, ...]
    o_proj: tuple[str | None, ...]
    mlp: tuple[str | None, ...]
    resid_mid: tuple[tuple[str, str] | None, ...]  # (module, "input" observe-only | "output")
    post_attn_norm: tuple[str | None, ...]
    post_mlp_norm: tuple[str | None, ...]
    layer_attn: tuple[Site, ...]  # each layer's attention site: the one record of its settings (interp.attention.sites)
    projections: tuple[Projections | str, ...]  # a Projections, or why pruning cannot slice the layer
    kind: str  # "pre-norm", "post-norm" or "parallel"
    d_model: int
    attn_in_norm: tuple[str | None, ...] = ()  # the norm whose output the attention module reads
    final_norm: str | None = None  # from the root: the norm applied to the last block's output, if any

    @property
    def n_layers(self) -> int:
        return len(self.attn)


def discover(hf: torch.nn.Module, n_tokens: int = 6) -> Structure:
    """Run one probe forward of ``hf`` on our eager path and read its structure off what ran."""
    ids = _probe_ids(hf, n_tokens)
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(hf.forward).parameters else {}
    recording, log = probe(hf, lambda: hf(input_ids=ids, **kwargs))
    return _read(hf, recording, log)


def _read(hf, recording: Recording, log: _ModuleLog) -> Structure:
    calls = recording.calls
    if not calls:
        raise NotImplementedError(f"{type(hf).__name__} did not call interp's attention function; it does not dispatch "
                           "through transformers' attention interface, so it is not supported.")
    attn_modules = [c["module"] for c in calls]
    if len(set(map(id, attn_modules))) != len(attn_modules):
        raise NotImplementedError(f"{type(hf).__name__} calls one attention module several times per forward "
                                  "(shared layers); interp needs one attention module per block.")
    layers_path, blocks = _find_blocks(hf, attn_modules)
    per_layer = [_read_block(block, call, recording, log) for block, call in zip(blocks, calls)]
    kinds = {p["kind"] for p in per_layer}
    if len(kinds) != 1:
        raise NotImplementedError(f"{type(hf).__name__} mixes block kinds {sorted(kinds)}; not supported.")
    d_model = int(log.inputs[blocks[0]].shape[-1])
    last = log.outputs.get(blocks[-1])
    final_norm = next((name for name, m in hf.named_modules() if _is_norm(m) and last is not None
                       and log.inputs.get(m) is last), None)
    sites = tuple(replace(p["layer_attn"], name=f"blocks.{l}.attn", block=l, o_proj=p["o_proj"])
                  for l, p in enumerate(per_layer))
    return Structure(
        layers=layers_path, kind=kinds.pop(), d_model=d_model, final_norm=final_norm, layer_attn=sites,
        **{key: tuple(p[key] for p in per_layer) for key in
           ("attn", "o_proj", "mlp", "resid_mid", "post_attn_norm", "post_mlp_norm", "projections", "attn_in_norm")},
    )


def _read_block(block, call: dict, recording: Recording, log: _ModuleLog) -> dict:
    names = {m: n for n, m in block.named_modules()}
    attn = call["module"]
    inside_attn = set(attn.modules())
    x, y = log.inputs.get(block), log.outputs.get(block)
    if x is None or y is None:
        raise NotImplementedError(f"{type(block).__name__}: the block's input or output is not a tensor.")
    z = call["out"]  # (b, q, h, e)
    z_flat = z.reshape(*z.shape[:2], -1)

    o_proj = next((m for m in block.modules() if _is_linear(m) and m not in (attn,)
                   and log.inputs.get(m) is not None and log.inputs[m].shape == z_flat.shape
                   and torch.equal(log.inputs[m], z_flat)), None)
    a = log.outputs.get(o_proj) if o_proj is not None else log.outputs.get(attn)
    after = log.ended.get(o_proj if o_proj is not None else attn, log.ended[attn])
    produced = {id(t) for m, t in log.outputs.items() if t is not None}
    later = sorted((m for m in block.modules() if m is not block and m not in inside_attn and m is not o_proj
                    and log.order.get(m, -1) > after), key=lambda m: log.order[m])
    post_attn_norm = next((m for m in later if _is_norm(m) and log.inputs.get(m) is a), None)

    def fresh(t):
        return t is not None and t is not x and id(t) not in produced

    post_norm = any(m is not block and _is_norm(m) and log.outputs.get(m) is y for m in block.modules())
    tol = 1e-5 * max(float(y.abs().max()), float(x.abs().max()), 1e-6)
    added = [log.outputs[post_attn_norm]] if post_attn_norm is not None else []  # what attention adds
    added += [a] if a is not None else []
    resid_mid, h = None, None
    same = [c.float().reshape(x.shape) for c in added if c.numel() == x.numel()]
    for m in block.modules():  # a module around the attention that returns x + (what attention adds): editable
        t = log.outputs.get(m)
        if (m is not block and m is not attn and attn in set(m.modules()) and t is not None and not post_norm
                and t.numel() == x.numel() and any(_close(t, x.float() + c, tol) for c in same)):
            resid_mid, h = (names[m], "output"), t.reshape(x.shape)
            break
    for m in later if resid_mid is None else ():
        t = log.inputs.get(m)
        if m is post_attn_norm or not fresh(t) or t.numel() != x.numel() or t.shape[-1] != x.shape[-1]:
            continue
        # h = x + (what attention adds); a norm also qualifies, for blocks that scale the branch before the add
        if _is_norm(m) or not post_norm and any(_close(t, x.float() + c, tol) for c in same):
            resid_mid = (names[m], "output" if post_norm else "input")
            h = (log.outputs[m] if post_norm else t).reshape(x.shape)
            break
    kind = "post-norm" if post_norm else "pre-norm" if resid_mid is not None else "parallel"

    # The MLP: the module whose output is what the MLP branch adds, found by value.
    if kind == "pre-norm":
        targets = [y.float() - h.float()]
    elif kind == "post-norm":
        final = next(m for m in block.modules() if m is not block and _is_norm(m) and log.outputs.get(m) is y)
        targets = [log.inputs[final].float() - h.float()] if log.inputs.get(final) is not None else []
    else:
        targets = [y.float() - x.float() - c for c in same]
    mlp = post_mlp_norm = None
    candidates = [m for m in block.modules() if m not in inside_attn and m is not block and m is not o_proj
                  and log.outputs.get(m) is not None and log.order.get(m, -1) > log.order[attn]]
    for target in targets:
        if target.abs().max() <= 10 * tol:
            continue
        matches = [m for m in candidates if _close(log.outputs[m], target, tol)]
        if matches:
            with_params = [m for m in matches if any(True for _ in m.parameters())] or matches
            mlp = min(with_params, key=lambda m: (names[m].count("."), log.order[m]))
            break
    if mlp is not None and _is_norm(mlp):  # a norm on the MLP's output before the residual add
        post_mlp_norm = mlp
        mlp = next((m for m in candidates if log.outputs[m] is log.inputs.get(post_mlp_norm)), None)
    if mlp is None and kind == "pre-norm" and resid_mid is not None:
        # The branch is scaled before the add (Granite's residual_multiplier): the module that reads the
        # norm of the residual stream.
        start = block.get_submodule(resid_mid[0])
        feed = log.outputs.get(start) if _is_norm(start) else log.inputs.get(start)
        mlp = next((m for m in candidates if m is not start and log.inputs.get(m) is feed), None)
    if mlp is None and kind == "parallel":
        children = [m for m in block.children() if m not in inside_attn and not _is_norm(m) and attn not in set(m.modules())]
        mlp = max(children, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)

    attn_input = log.inputs.get(attn)
    attn_in_norm = next((m for m in block.modules() if m is not block and _is_norm(m) and attn_input is not None
                         and log.outputs.get(m) is attn_input), None)
    return dict(
        kind=kind,
        attn_in_norm=names[attn_in_norm] if attn_in_norm is not None else None,
        attn=names[attn],
        o_proj=names.get(o_proj) if o_proj is not None else None,
        mlp=names.get(mlp) if mlp is not None else None,
        resid_mid=resid_mid,
        post_attn_norm=names[post_attn_norm] if post_attn_norm is not None else None,
        post_mlp_norm=names[post_mlp_norm] if post_mlp_norm is not None else None,
        layer_attn=_layer_attention(call, recording, names),
        projections=_projections(block, attn, o_proj, call, log, names),
    )


def _layer_attention(call: dict, recording: Recording, names: dict) -> Site:
    """The layer's attention site as the call shows it (name, block and output projection are set by ``_read``): a
    causal model's stack is a decoder, a bidirectional one's an encoder."""
    q, k, v = call["query"], call["key"], call["value"]
    sinks = None
    if call["sinks"] is not None:
        module = call["module"]
        owner = next((f"{names[module]}.{n}" for n, p in module.named_parameters() if p.data_ptr() ==
                      call["sinks"].data_ptr()), None)
        if owner is None:
            raise NotImplementedError("The attention sinks this model passes are not a parameter of its attention "
                                      "module; interp cannot record them.")
        sinks = owner
    window = _window(call, recording)
    return Site(name="", stack="decoder" if window[1] == 0 else "encoder", block=-1, kind="self", n_heads=q.shape[1],
                n_kv_heads=k.shape[1], d_head=q.shape[-1], d_head_v=v.shape[-1], scale=float(call["scaling"]),
                causal=window[1] == 0, window=window, softcap=call["softcap"], sinks=sinks,
                softmax_fp32=softmax_upcasts(call))


def _window(call: dict, recording: Recording) -> tuple[int | None, int | None]:
    """The keys a query may see, relative to it, read from the mask function HF built this layer's mask with."""
    mask = call["mask"]
    if mask is None:
        causal = bool(getattr(call["module"], "is_causal", False))
        return (None, 0 if causal else None)
    mask_function = recording.masks.get(id(mask))
    if mask_function is None:  # a mask the model built by itself: read causality off the tensor
        allowed = mask[0, 0] > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask[0, 0].bool()
        causal = not bool(allowed.triu(1).any())
        window = call["sliding_window"]
        return ((window - 1) if window else None, 0 if causal else None)
    bands = {_band(mask_function, q) for q in (_BIG, _BIG + 12345)}
    if len(bands) != 1 or None in bands:
        raise NotImplementedError(
            "This model's attention mask is not a band around each query (chunked or block attention); interp "
            "cannot rebuild its patterns, so it is refused."
        )
    return bands.pop()


def _band(mask_function, q_pos: int):
    """(before, after) of the allowed keys of the query at ``q_pos``, or None if they are not one contiguous run."""
    index = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    kv = torch.arange(2 * q_pos, dtype=torch.long)[None, None, None, :]
    try:
        allowed = torch.as_tensor(mask_function(index, index, torch.full_like(index, q_pos), kv))
        allowed = torch.broadcast_to(allowed, kv.shape).reshape(-1)
    except Exception:  # noqa: BLE001  a mask function that needs real positions or vmap
        return None
    hits = allowed.nonzero().flatten()
    if not len(hits):
        return None
    first, last = int(hits[0]), int(hits[-1])
    if not bool(allowed[first:last + 1].all()):
        return None
    return (None if first == 0 else q_pos - first, None if last == 2 * q_pos - 1 else last - q_pos)


def describe(s: Structure) -> list[str]:
    """What the discovery found, in plain lines (``interp info`` prints them)."""
    lines = []
    mid = s.resid_mid[0]
    if s.kind == "parallel":
        lines.append("blocks: parallel attention and MLP (both read the block's input): no hook_resid_mid")
    elif s.kind == "post-norm":
        lines.append(f"blocks: post-norm; hook_resid_mid is the output of {mid[0]} (editable)")
    else:
        where = "output (editable)" if mid[1] == "output" else "input (observe only)"
        lines.append(f"blocks: pre-norm; hook_resid_mid is the {where} of {mid[0]}")
    attn_out = f"hook_attn_out: output of {s.o_proj[0] or s.attn[0]}"
    if s.post_attn_norm[0]:
        attn_out += f"; {s.post_attn_norm[0]} normalises it before the residual add"
    lines.append(attn_out)
    if s.mlp[0]:
        mlp = f"hook_mlp_out: output of {s.mlp[0]}"
        if s.post_mlp_norm[0]:
            mlp += f"; {s.post_mlp_norm[0]} normalises it before the residual add"
        lines.append(mlp)
    layers = s.layer_attn
    scales = sorted({round(a.scale, 6) for a in layers})
    lines.append(f"attention: scale {', '.join(map(str, scales))} (as the model passes it)"
                 + ("; causal" if all(a.causal for a in layers) else "; bidirectional"))
    windows: dict[tuple, list[int]] = {}
    for l, a in enumerate(layers):
        if a.window[0] is not None or (a.window[1] not in (None, 0)):
            windows.setdefault(a.window, []).append(l)
    for (before, after), where in windows.items():
        span = f"{before + 1} keys up to the query" if after == 0 else f"{before} keys before and {after} after"
        lines.append(f"windows: {span} on layers {_spans(where)} of {len(layers)}")
    if any(a.softcap for a in layers):
        lines.append(f"logit soft-cap: {sorted({a.softcap for a in layers if a.softcap})}")
    if any(a.sinks for a in layers):
        lines.append(f"attention sinks ({layers[0].sinks}): pattern rows sum to less than 1")
    if layers[0].d_head != layers[0].d_head_v:
        lines.append(f"head sizes: q/k {layers[0].d_head}, v {layers[0].d_head_v}")
    reasons = {p for p in s.projections if isinstance(p, str)}
    lines.append("pruning: " + (f"refused ({reasons.pop()})" if reasons else f"q/k/v {s.projections[0].layout}"))
    return lines


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2, 4'."""
    out, start = [], None
    for i, l in enumerate(layers):
        if start is None:
            start = l
        if i + 1 == len(layers) or layers[i + 1] != l + 1:
            out.append(f"{start}" if start == l else f"{start}-{l}")
            start = None
    return ", ".join(out)
