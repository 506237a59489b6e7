"""Our attention step, registered with transformers' attention interface under two keys.

HF keeps its weights, projections and RoPE and calls us with ``query: (b, h, q, d)``, ``key: (b, g, k, d)`` and
``value: (b, g, k, e)``; we return ``(out: (b, q, h, e), pattern or None)``.

- ``eager`` (key ``interp_exact``) mirrors HF's eager attention step by step (repeat_kv, scale, soft-cap,
  position bias, additive mask, softmax in the dtype the family's own eager function takes it in
  (``softmax_upcasts``) or the attention-sink softmax, transpose), so that with no hooks it equals HF eager
  exactly, and it fires every attention hook inside the computation: an edit to q, scores, pattern or z
  changes what follows.
- ``flash`` (key ``interp_fused``) runs a kernel that also returns each row's logsumexp and never builds the
  n x n matrix (``interp.attention.kernels``); it fires q, k, v, z and lse. A layer with a hook on ``hook_attn_scores`` or
  ``hook_pattern`` runs the eager step instead, for that call only (the mask eager would get, rebuilt from the
  flash one): you pay for n x n only where you look.

What the model passes is what we compute with: the score scale comes from the call (``scaling``), as do the
soft-cap (``softcap``) and attention sinks (``s_aux``); sliding windows arrive inside the mask. Any other
keyword argument that could change the math is refused by name rather than ignored.

Key names contain neither "flash" nor "sdpa": HF matches those substrings and would take over dispatch.
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.nn.functional as F

from hooks import HookPoint

from .kernels import fused_attention, repeat_kv, windowed_attention

__all__ = ["EAGER_KEY", "FLASH_KEY", "ATTN_KEYS", "LayerHooks", "attach_layer_hooks", "attached_layer_hooks",
           "detach_layer_hooks", "eager_attention", "flash_attention", "fused_attention", "repeat_kv",
           "REFUSED_KWARGS", "Recording", "softmax_upcasts"]

EAGER_KEY = "interp_exact"
FLASH_KEY = "interp_fused"
ATTN_KEYS = {"eager": EAGER_KEY, "flash": FLASH_KEY}

# Keyword arguments that change the attention math in a way we do not implement.
REFUSED_KWARGS = {
    "alibi": "ALiBi position bias",
}
# Keyword arguments models pass that do not change what this function computes: bookkeeping for other
# backends (flash-attn's varlen arguments, cache positions) or for the model, and the sliding window, which
# HF's mask functions already apply to the mask we receive.
_PASSTHROUGH = frozenset({
    "position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "layer_idx",
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "query_length", "deterministic",
    "sliding_window", "is_causal", "encoder_hidden_states", "head_mask", "token_type_ids", "logits_to_keep",
})


class LayerHooks:
    """The attention hook points of one layer; ``any`` is kept up to date by the model.

    ``owner`` is a weak reference to the HookedModel these points belong to. A copy of the HF model
    (``copy.deepcopy``, pickling) carries no hooks: they belong to the wrapper, not to the weights.
    """

    __slots__ = ("q", "k", "v", "attn_scores", "pattern", "z", "lse", "any", "owner", "bias", "causal", "window",
                 "softmax_fp32")

    def __init__(self, points: dict[str, HookPoint], owner=None):
        for kind in ("q", "k", "v", "attn_scores", "pattern", "z", "lse"):
            setattr(self, kind, points[kind])
        self.any = False
        self.owner = weakref.ref(owner) if owner is not None else (lambda: None)
        self.bias = None  # the position bias of the last hooked call (T5), for rebuilding patterns from q and k
        self.causal = None  # whether the layer is causal, as discovered (None: unknown, the module's is_causal says)
        self.window = None  # a causal layer's sliding window, keys before the query (as discovered), or None
        self.softmax_fp32 = True  # whether the family's eager softmax runs in float32 (``softmax_upcasts``)

    def refresh(self) -> None:
        self.any = any(bool(getattr(self, kind)) for kind in ("q", "k", "v", "attn_scores", "pattern", "z", "lse"))

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


# The hook points live on the attention module itself, as a plain attribute (not a submodule, parameter or
# buffer: state_dict, repr and save_pretrained never see it). A global weak table keyed by module made
# torch.compile guard on the table's changing contents.
_HOOKS_ATTR = "_interp_hooks"
_STREAM_ATTR = "_interp_stream"  # interp.streaming.cache.STREAM_ATTR (not imported: streaming builds on this module)


def attach_layer_hooks(module: torch.nn.Module, hooks: LayerHooks) -> None:
    module.__dict__[_HOOKS_ATTR] = hooks


def attached_layer_hooks(module: torch.nn.Module) -> LayerHooks | None:
    return module.__dict__.get(_HOOKS_ATTR)


def detach_layer_hooks(module: torch.nn.Module) -> None:
    module.__dict__.pop(_HOOKS_ATTR, None)


def _active_hooks(module: torch.nn.Module) -> LayerHooks | None:
    hooks = getattr(module, _HOOKS_ATTR, None)
    return hooks if hooks is not None and hooks.any else None


# -- recording a probe forward (structure discovery) -------------------------------------------------------
class Recording:
    """While active (``with Recording() as rec``), every attention call is recorded in ``rec.calls`` and
    every mask our mask functions build in ``rec.masks`` (id of the mask -> HF's mask function), with mask
    shortcuts switched off, so that each layer's mask can be traced back to the function that made it."""

    active: Recording | None = None

    def __init__(self):
        self.calls: list[dict] = []
        self.masks: dict[int, object] = {}

    def __enter__(self) -> Recording:
        Recording.active = self
        return self

    def __exit__(self, *exc) -> None:
        Recording.active = None


def _record(module, query, key, value, attention_mask, out, scaling, softcap, sinks, kwargs, bias=None) -> None:
    Recording.active.calls.append(dict(
        module=module, query=query, key=key, value=value, out=out, mask=attention_mask, scaling=scaling,
        softcap=softcap, sinks=None if sinks is None else sinks.detach(), sliding_window=kwargs.get("sliding_window"),
        position_bias=bias,
    ))


def softmax_upcasts(call: dict) -> bool:
    """Whether the family's own eager attention takes its softmax in float32 (``softmax(s, dtype=torch.float32)
    .to(query.dtype)``: Llama and most decoders) rather than in the scores' dtype (``softmax(s)``: T5, BART, BERT,
    GPT-2, ...), for the module of a recorded call. The two agree in float32, bfloat16 and float16 and differ in
    float64, where float32 keeps 7 digits. Found by running the function HF falls back to for this module
    (``eager_attention_forward`` of its modeling file) once on random float64 inputs of the call's shapes: weights
    that survive a round trip through float32 were rounded there. True (float32) when it cannot be run."""
    module = call["module"]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        return True
    q, k, v = call["query"], call["key"], call["value"]
    g = torch.Generator().manual_seed(0)
    shapes = [(1, q.shape[1], 3, q.shape[-1]), (1, k.shape[1], 4, k.shape[-1]), (1, v.shape[1], 4, v.shape[-1])]
    inputs = [torch.randn(shape, generator=g, dtype=torch.float64).to(q.device) for shape in shapes]
    extra = {} if call["softcap"] is None else {"softcap": call["softcap"]}
    try:
        with torch.no_grad():
            weights = eager(module, *inputs, None, scaling=call["scaling"], dropout=0.0, **extra)[1]
    except Exception:  # noqa: BLE001  a function that needs more than a plain call (module state, other arguments)
        return True
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float64:
        return True
    return bool(torch.equal(weights, weights.float().double()))


# Families whose eager attention applies the sinks as a scale on the output, not as an extra softmax column (the
# same numbers, rounded differently). Which form a family uses cannot be seen in the call; it is in its modeling code.
_SINK_SCALES_OUTPUT = frozenset({"granite_swa", "granitemoe_swa"})


def _sinks_scale_output(module) -> bool:
    return getattr(getattr(module, "config", None), "model_type", None) in _SINK_SCALES_OUTPUT


def _check_kwargs(kwargs: dict) -> None:
    for key, value in kwargs.items():
        if value is None or key in _PASSTHROUGH:
            continue
        what = REFUSED_KWARGS.get(key, "an argument interp's attention does not know")
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise NotImplementedError(
            f"This model passes {what} ({key}={shown}) to its attention function, which interp's attention does "
            "not implement; computing without it would silently give a different pattern, so it is refused."
        )


def _same_batch(query, key, value, mask):
    """q, k, v and the mask with one batch size, broadcast as HF's eager matmuls broadcast them (a batch of 1 serves
    every row: a decoder batch of 3 reading one source), else a clear error (HF's eager attention raises there too).
    The fused kernels do not broadcast: given keys of batch 1 and queries of batch 3 the CPU one reads past the keys."""
    sizes = {"query": query.shape[0], "key": key.shape[0], "value": value.shape[0]}
    if mask is not None:
        sizes["attention mask"] = mask.shape[0]
    batch = max(sizes.values())
    if any(n not in (1, batch) for n in sizes.values()):
        raise ValueError(
            "The attention's inputs have batch sizes that do not broadcast: "
            + ", ".join(f"{k} {v}" for k, v in sizes.items()) + ". In an encoder-decoder model the source batch "
            "(input_ids) and the target batch (decoder_input_ids) must have the same number of rows (or the "
            "source one row, shared by every target).")
    if batch == 1 or all(n == batch for n in sizes.values()):
        return query, key, value, mask
    grow = lambda t: t if t.shape[0] == batch else t.expand(batch, *t.shape[1:])  # noqa: E731
    return grow(query), grow(key), grow(value), None if mask is None else grow(mask)


def _fire_qkv(hooks: LayerHooks, query, key, value):
    """Hooks see (b, p, h, d) as TransformerLens does; the kernel gets (b, h, p, d) back."""
    if hooks.q:
        query = hooks.q(query.transpose(1, 2)).transpose(1, 2)
    if hooks.k:
        key = hooks.k(key.transpose(1, 2)).transpose(1, 2)
    if hooks.v:
        value = hooks.v(value.transpose(1, 2)).transpose(1, 2)
    return query, key, value


# -- the two paths ---------------------------------------------------------------------------------------
def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None,
                    position_bias=None, **kwargs):
    """HF's eager attention, with our hooks inside. query: (b, h, q, d); key: (b, g, k, d); value: (b, g, k, e).

    softcap: Gemma 2's ``tanh(s / softcap) * softcap`` on the scaled scores, before the mask. s_aux: one sink
    logit per head (GPT-OSS): a column appended to every row's scores before the softmax and dropped after it,
    so that the pattern's rows sum to less than 1. position_bias: T5's relative position bias ``(1 or b, h, q, k)``,
    added to the scaled scores before the mask, as T5's eager attention adds it.
    """
    _check_kwargs(kwargs)
    hooks = _active_hooks(module)
    if hooks is not None:
        hooks.bias = position_bias
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    stream = module.__dict__.get(_STREAM_ATTR)  # interp.streaming: heads that see only sinks and a recent window
    if not isinstance(key, torch.Tensor):  # a StreamingCache's SplitKV
        return _streaming_cached(module, stream, hooks, query, key, attention_mask, scaling, softcap), None
    if hooks is not None:
        query, key, value = _fire_qkv(hooks, query, key, value)
    _same_batch(query, key, value, attention_mask)  # a clear error where HF's matmul would raise

    n_rep = query.shape[1] // key.shape[1]
    key_states = repeat_kv(key, n_rep)
    value_states = repeat_kv(value, n_rep)
    scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling  # (b, h, q, k)
    if softcap is not None:
        scores = scores / softcap
        scores = torch.tanh(scores)
        scores = scores * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    if stream is not None:
        scores = stream.mask_scores(scores, attention_mask)
    if hooks is not None and hooks.attn_scores:
        scores = hooks.attn_scores(scores)
    sink_scale = None
    if s_aux is None:
        if hooks is not None and hooks.lse:
            hooks.lse(torch.logsumexp(scores.float(), dim=-1))
        attached = module.__dict__.get(_HOOKS_ATTR)
        if attached is None or attached.softmax_fp32:
            pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (b, h, q, k)
        else:  # as the family's eager function takes it: in the scores' dtype (T5, BART, BERT, GPT-2, ...)
            pattern = F.softmax(scores, dim=-1)
    elif _sinks_scale_output(module):  # Granite SWA: the usual softmax, then out * sigmoid(lse - sink)
        lse = torch.logsumexp(scores, dim=-1)
        sink_scale = (lse - s_aux.view(1, -1, 1)).to(torch.float32).sigmoid()  # (b, h, q)
        if hooks is not None and hooks.lse:
            hooks.lse(torch.logaddexp(lse.float(), s_aux.float().view(1, -1, 1)))
        pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:  # as GPT-OSS: the sink logit joins each row, the row max is subtracted, the sink column is dropped
        sinks = s_aux.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        combined = torch.cat([scores, sinks], dim=-1)
        if hooks is not None and hooks.lse:
            hooks.lse(torch.logsumexp(combined.float(), dim=-1))
        combined = combined - combined.max(dim=-1, keepdim=True).values
        pattern = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    if hooks is not None and hooks.pattern:  # hooks see the weights on the keys: rows sum to less than 1
        shown = pattern if sink_scale is None else pattern * sink_scale[..., None].to(pattern.dtype)
        edited = hooks.pattern(shown)
        if edited is not shown:
            pattern, sink_scale = edited, None
    attn = F.dropout(pattern, p=dropout, training=module.training).to(value_states.dtype)
    out = torch.matmul(attn, value_states)
    if sink_scale is not None:
        out = out * sink_scale.unsqueeze(-1).to(out.dtype)
    return _z(out, hooks, module, query, key, value, attention_mask, scaling, softcap, s_aux, kwargs,
              position_bias), pattern


def flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                    softcap=None, s_aux=None, position_bias=None, **kwargs):
    """Attention that never builds the n x n matrix. Same arguments as ``eager_attention``.

    With attention sinks the output is exact from the logsumexp: the sink takes ``sigmoid(sink - lse)`` of
    each row, so ``out * sigmoid(lse - sink)``, and the row's logsumexp becomes ``logaddexp(lse, sink)``.
    A position bias (T5) is folded into the additive mask, so the kernel's logsumexp is that of the biased scores.
    """
    _check_kwargs(kwargs)
    hooks = _active_hooks(module)
    stream = module.__dict__.get(_STREAM_ATTR)
    if not isinstance(key, torch.Tensor):  # a StreamingCache's SplitKV
        return _streaming_cached(module, stream, hooks, query, key, attention_mask, scaling, softcap), None
    # As HF's sdpa integration: causal via the kernel flag when no mask was built. The mask function skips the mask
    # for a causal layer without padding; whether the layer is causal is what discovery found (NLLB-MoE's decoder
    # self-attention says is_causal=False, and HF refuses sdpa for it), else the call's or module's flag.
    attached = getattr(module, _HOOKS_ATTR, None)
    causal = is_causal if is_causal is not None else (
        attached.causal if attached is not None and attached.causal is not None else getattr(module, "is_causal", True))
    causal = bool(causal and query.shape[2] > 1 and attention_mask is None)
    if hooks is not None and (hooks.attn_scores or hooks.pattern):  # n x n only where a user looks: this layer, now
        mask = _eager_mask(attention_mask, causal, getattr(attached, "window", None), query, key)
        return eager_attention(module, query, key, value, mask, scaling=scaling, dropout=dropout, softcap=softcap,
                               s_aux=s_aux, position_bias=position_bias, **kwargs)[0], None
    if hooks is not None:
        hooks.bias = position_bias
        query, key, value = _fire_qkv(hooks, query, key, value)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    if causal and key.shape[2] > query.shape[2]:  # prefill into a larger static cache, as HF does
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    if position_bias is not None:
        attention_mask = _with_bias(position_bias, attention_mask, causal, query.shape[2], key.shape[2])
        causal = False

    query, key, value, attention_mask = _same_batch(query, key, value, attention_mask)
    need_lse = (hooks is not None and bool(hooks.lse)) or s_aux is not None
    window = getattr(attached, "window", None)  # only our hooks' modules get no mask for their window (interp.attention.masks)
    if causal and window is not None and query.shape[2] == key.shape[2] > window + 1 and stream is None and not dropout:
        out, lse = windowed_attention(query, key, value, window, scaling, need_lse, softcap)  # _fused_mask skipped it
    elif stream is not None:
        out, lse = stream.attend(query, key, value, attention_mask, scaling, causal, need_lse, softcap, dropout=dropout)
    else:
        out, lse = fused_attention(query, key, value, attention_mask, scaling, dropout, causal, need_lse, softcap)
    if s_aux is not None:
        sink = s_aux.float().reshape(1, -1, 1)  # (1, h, 1)
        out = out * torch.sigmoid(lse - sink)[..., None].to(out.dtype)
        lse = torch.logaddexp(lse, sink)
    if hooks is not None and hooks.lse:
        hooks.lse(lse)
    return _z(out, hooks, module, query, key, value, attention_mask, scaling, softcap, s_aux, kwargs,
              position_bias), None


def _z(out, hooks, module, query, key, value, attention_mask, scaling, softcap, s_aux, kwargs, position_bias):
    """Both paths' last step: out (b, h, q, e) -> z (b, q, h, e), through ``hook_z``, recorded for a probe
    forward (``Recording``) when one runs."""
    out = out.transpose(1, 2).contiguous()  # (b, q, h, e)
    if hooks is not None and hooks.z:
        out = hooks.z(out)
    if Recording.active is not None:
        _record(module, query, key, value, attention_mask, out, scaling, softcap, s_aux, kwargs, position_bias)
    return out


def _eager_mask(mask, causal: bool, window: int | None, query, key) -> torch.Tensor | None:
    """The additive mask HF's eager mask function builds for a call that got the flash key's mask: ``-inf`` (the
    flash mask) becomes the dtype's minimum, and a causal layer whose mask was skipped gets its triangle (and
    sliding window) back, queries being the last of the keys' positions."""
    low = torch.finfo(query.dtype).min
    if mask is not None:
        return torch.where(torch.isneginf(mask), low, 0.0).to(query.dtype)
    if not causal:
        return None
    n_q, n_k = query.shape[2], key.shape[2]
    offset = torch.arange(n_k, device=query.device)[None] - torch.arange(n_k - n_q, n_k, device=query.device)[:, None]
    allowed = offset <= 0
    if window is not None:
        allowed &= offset >= -window
    return torch.where(allowed, 0.0, low).to(query.dtype)[None, None]  # (1, 1, q, k)


def _streaming_cached(module, stream, hooks, query, key, mask, scaling, softcap):
    """Attention over a streaming cache's split keys (``interp.streaming.cache.SplitKV``): (b, q, h, e). The cache must
    have been made for the streaming this module runs now (``stream``, None outside a block): else a ValueError."""
    check = getattr(key, "check_reader", None)
    if check is None:
        raise TypeError(f"Attention got keys of type {type(key).__name__}; expected a tensor (or a StreamingCache's "
                        "SplitKV).")
    check(getattr(stream, "block", None), getattr(module, "layer_idx", "?"))
    if hooks is not None or module.training or Recording.active is not None:
        raise ValueError("A StreamingCache runs without attention hooks and in eval mode: remove the hooks (or use a "
                         "plain cache, under which the masked model computes the same).")
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    return stream.attend_cached(query, key, mask, scaling, softcap).transpose(1, 2).contiguous()


def _with_bias(bias: torch.Tensor, mask: torch.Tensor | None, causal: bool, n_q: int, n_k: int) -> torch.Tensor:
    """The additive mask with a position bias folded in: bias + mask, and the causal triangle made explicit when
    the kernel's causal flag stood for it (queries are the last ``n_q`` of ``n_k`` positions)."""
    if causal:
        offset = torch.arange(n_k, device=bias.device)[None] - torch.arange(n_q, device=bias.device)[:, None]
        bias = bias.masked_fill(offset > n_k - n_q, float("-inf"))
    return bias if mask is None else bias + mask
