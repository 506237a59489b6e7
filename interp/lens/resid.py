"""``ModelCache``: the cache ``run_with_cache`` returns, with TransformerLens's residual-stream methods
(``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ``stack_activation``, ``apply_ln_to_stack``,
``logit_attrs``, ``get_full_resid_decomposition``, ``remove_batch_dim``), taking ``layer``, ``pos_slice``,
``incl_mid``, ``mlp_input``, ``apply_ln`` and ``return_labels`` as TransformerLens does.

Shapes: every stack is ``(component, *batch_and_pos, m)``; a cache after ``remove_batch_dim()`` has no batch axis.
``layer`` counts blocks of the stack read (None or -1: all of them, the stream the final norm reads). The norms
are TransformerLens's with ``fold_ln``: ``apply_ln_to_stack`` centres (LayerNorm) and divides by the scale the
norm computed on this run, and the norm's weight lives in ``model.W_U`` (``model.fold_ln``, default True).

Refused in one line: a decomposition whose parts do not add up to the stream (post-norm blocks, Gemma's normed
sublayer outputs, scaled branches), MLP neurons (no hook inside an MLP), the norm of a block that has none.
"""

from __future__ import annotations

import functools
import re

import torch

from hooks import ActivationCache, get_act_name
from hooks.names import unknown_name_error

from .circuits import head_weights
from .differences import warn_tl_differences
from ..structure.norms import norm_centres, norm_divide, norm_scale

__all__ = ["ModelCache"]


def _pos(tensor: torch.Tensor, pos_slice, dim: int = -2) -> torch.Tensor:
    """TransformerLens's ``Slice`` on one axis: None (all), an int (that position, the axis dropped), a
    ``(start, stop[, step])`` tuple or a slice, a list or tensor of positions."""
    if pos_slice is None:
        return tensor
    if isinstance(pos_slice, tuple) and all(isinstance(i, int) for i in pos_slice):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, (list, torch.Tensor)):
        at, n = torch.as_tensor(pos_slice, device=tensor.device).reshape(-1), tensor.shape[dim]
        if at.is_floating_point() or at.dtype == torch.bool or bool(((at < -n) | (at >= n)).any()):
            raise ValueError(f"pos_slice's positions are integers in [-{n}, {n}) (negative from the end); got "
                             f"{at.tolist()}.")
        return tensor.index_select(dim % tensor.ndim, at % n)
    if not isinstance(pos_slice, (int, slice)):
        raise TypeError(f"pos_slice is None, an int, a (start, stop) tuple, a slice or a list of positions; got "
                        f"{pos_slice!r}.")
    index = [slice(None)] * tensor.ndim
    index[dim] = pos_slice
    return tensor[tuple(index)]


_NORM_NAME = re.compile(r"^((?:encoder\.|decoder\.)?(?:blocks\.\d+\.(?:ln1|ln2|ln_cross)|ln_final))"
                        r"\.hook_(scale|normalized)$")


class ModelCache(ActivationCache):
    """An ``ActivationCache`` that knows its model (``cache.model``), as TransformerLens's does."""

    def __init__(self, store: dict, meta=None, model=None, has_batch_dim: bool = True):
        super().__init__(store, meta)
        self.model = model
        self.has_batch_dim = has_batch_dim

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, tuple) and key and key[0] in ("scale", "normalized"):
            key = get_act_name(*key)
        norm = _NORM_NAME.match(key) if isinstance(key, str) and key not in self._store else None
        if norm is not None:
            return self._norm_hook(*norm.groups())
        if self.model is not None and self.model.__dict__.get("tl_differences") is not None:
            warn_tl_differences(self.model, [self._name(key)])  # read by a TransformerLens user
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        try:
            self[key] if isinstance(key, str) and _NORM_NAME.match(key) else self._name(key)
        except (KeyError, NotImplementedError):
            return False
        return True

    def _norm_hook(self, where: str, kind: str) -> torch.Tensor:
        """A norm's ``hook_scale``/``hook_normalized`` (opt-in), built on access from the stream the norm reads, as
        the hook points compute them; name them in ``run_with_cache(names=...)`` to keep values a hook edited."""
        model = self._require_model(f"{where}.hook_{kind}")
        if where not in model._norms:
            raise KeyError(str(unknown_name_error(f"{where}.hook_{kind}", list(model.hook_names))))
        norm, x = self._norm_stream(where)
        scale = norm_scale(norm, x).to(x.dtype)  # as the hook point computes it (interp.model.norm_hooks)
        return scale if kind == "scale" else norm_divide(x, scale, norm_centres(norm, x.shape[-1]))

    def _norm_stream(self, where: str) -> tuple[torch.nn.Module, torch.Tensor]:
        """The norm ``where`` names (``"blocks.3.ln2"``, ``"decoder.ln_final"``) and its input on this run: the sum,
        in the model's order, of the cached streams ``model._norms`` says it reads."""
        norm, reads = self.model._norms[where]
        return norm, functools.reduce(torch.add, (self[name] for name in reads))

    def to(self, device, dtype=None) -> ModelCache:
        moved = super().to(device, dtype)
        return ModelCache(moved._store, moved.meta, self.model, self.has_batch_dim)

    def remove_batch_dim(self) -> ModelCache:
        """Drop the batch axis of a one-sequence cache, in place (TransformerLens's ``remove_batch_dim``)."""
        if not self.has_batch_dim:
            return self
        sizes = {t.shape[0] for t in self._store.values() if t.ndim}
        if sizes != {1}:
            raise ValueError(f"remove_batch_dim needs a cache of one sequence; this one has batch {sorted(sizes)}.")
        self._store = {k: t[0] if t.ndim else t for k, t in self._store.items()}
        self.has_batch_dim = False
        return self

    def pattern(self, layer, heads=None) -> torch.Tensor:
        """``ActivationCache.pattern``, also after ``remove_batch_dim()`` (then ``(h, q, k)``)."""
        if self.has_batch_dim:
            return super().pattern(layer, heads)
        return self._batched().pattern(layer, heads)[0]

    def attn_scores(self, layer, heads=None) -> torch.Tensor:
        """``ActivationCache.attn_scores``, also after ``remove_batch_dim()`` (then ``(h, q, k)``)."""
        if self.has_batch_dim:
            return super().attn_scores(layer, heads)
        return self._batched().attn_scores(layer, heads)[0]

    def _batched(self) -> ModelCache:
        return ModelCache({k: t[None] for k, t in self._store.items()}, self.meta, self.model)

    # -- the stack read ------------------------------------------------------------------------------------------
    def _stack_prefix(self, stack: str | None) -> tuple[str, int]:
        """``(hook prefix, blocks)`` of the residual stack read: ``blocks`` of a model with one stack, else
        ``encoder.blocks`` or ``decoder.blocks`` as ``stack`` names it."""
        stacks = sorted({name.split(".blocks.")[0] for name in self._store if ".blocks." in name})
        if not stacks:
            if stack not in (None, "encoder", "decoder"):
                raise ValueError(f"stack is 'encoder' or 'decoder' (an encoder-decoder model); got {stack!r}.")
            prefix = "blocks"
        else:
            if stack not in stacks:
                raise ValueError(f"This cache holds an encoder-decoder model's two residual streams: give "
                                 f"stack='encoder' or stack='decoder'; got {stack!r}.")
            prefix = f"{stack}.blocks"
        layers = [int(n[len(prefix) + 1:].split(".")[0]) for n in self._store
                  if n.startswith(prefix + ".") and n.endswith("hook_resid_pre")]
        if not layers:
            raise KeyError(f"No {prefix}.*.hook_resid_pre in this cache; run_with_cache captures it by default.")
        return prefix, max(layers) + 1

    def _single(self, what: str) -> int:
        """The block count of a one-stream cache; an encoder-decoder model's is refused for ``what``."""
        if any(".blocks." in name for name in self._store):
            raise NotImplementedError(f"{what} splits one residual stream into sublayer outputs; an encoder-decoder "
                                      "model has two (and cross-attention). Use accumulated_resid(stack="
                                      "'encoder' or 'decoder') or stack_activation.")
        return self._stack_prefix(None)[1]

    def _get(self, prefix: str, layer: int, kind: str) -> torch.Tensor:
        name = f"{prefix}.{layer}.hook_{kind}"
        if name not in self._store:
            why = (" (parallel blocks have no resid_mid; post-norm ones have it after their norm)" if kind == "resid_mid"
                   else " (an encoder-decoder's: {encoder,decoder}.blocks.N.hook_mlp_out)" if kind == "mlp_out" else "")
            raise KeyError(f"{name} is not in this cache{why}.")
        return self._store[name]

    @staticmethod
    def _layer(layer, n: int) -> int:
        if layer is None or layer == -1:
            return n
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
            raise ValueError(f"layer counts blocks: an integer in [0, {n}], or None/-1 for all {n}; got {layer!r}.")
        return layer

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False,
                          stack: str | None = None):
        """The residual stream entering each block up to ``layer`` (``{l}_pre``; with ``incl_mid`` also ``{l}_mid``),
        and at ``layer=None`` the stream the final norm reads (``final_post``): ``(component, *b, p, m)``."""
        prefix, n = self._stack_prefix(stack)
        layer = self._layer(layer, n)
        parts, labels = [], []
        for l in range(layer + 1):
            if l == n:
                parts.append(self._get(prefix, n - 1, "resid_post"))
                labels.append("final_post")
                continue
            parts.append(self._get(prefix, l, "resid_pre"))
            labels.append(f"{l}_pre")
            if (incl_mid and l < layer) or (mlp_input and l == layer):
                parts.append(self._get(prefix, l, "resid_mid"))
                labels.append(f"{l}_mid")
        out = torch.stack([_pos(p, pos_slice) for p in parts])
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, mlp_input, pos_slice, recompute_ln=layer == n, stack=stack)
        return (out, labels) if return_labels else out

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None,
                         stack: str | None = None) -> torch.Tensor:
        """One kind of activation of every block before ``layer`` stacked: ``(l, ...)``."""
        prefix, n = self._stack_prefix(stack)
        layer = self._layer(layer, n)
        if prefix == "blocks":
            return torch.stack([self[activation_name, l, sublayer_type] for l in range(layer)])
        names = [n_ for n_ in self._store if n_.startswith(prefix) and n_.endswith(f"hook_{activation_name}")]
        return torch.stack([self._store[n_] for n_ in names if int(n_.split(".")[2]) < layer])

    # -- norms ---------------------------------------------------------------------------------------------------
    def _norm_and_input(self, layer: int, n: int, mlp_input: bool, stack: str | None):
        """The norm a stack is read through and the stream it normalised on this run, or (None, None)."""
        model = self._require_model("apply_ln")
        prefix, _ = self._stack_prefix(stack)
        where = f"{prefix.removesuffix('blocks')}ln_final" if layer == n else f"{prefix}.{layer}.ln{1 + int(mlp_input)}"
        if where in model._norms:
            return self._norm_stream(where)
        if layer == n:
            return None, None
        if prefix == "blocks":
            model.block_norm(layer, mlp_input)  # raises why this block has no such norm
        raise NotImplementedError(f"apply_ln: {stack} block {layer} has no {where.rsplit('.', 1)[1]} (post-norm blocks "
                                  "normalise after each sublayer); use apply_ln=False.")

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice=None, batch_slice=None, has_batch_dim: bool = True, recompute_ln: bool = False,
                          stack: str | None = None) -> torch.Tensor:
        """Each component as the input of ``layer``'s norm sees it (None: the final norm): centred if the norm is a
        LayerNorm, divided by the scale the norm computed on this run (``recompute_ln`` at the final norm: by each
        component's own scale, the logit lens). The norm's weight and bias are not applied: they are folded into
        the weights that read the stream (``model.W_U``, ``model.W_Q`` with ``model.fold_ln``), as in
        TransformerLens. A model with no norm there gets the stack back unchanged."""
        _, n = self._stack_prefix(stack)
        layer = self._layer(layer, n)
        if has_batch_dim and batch_slice is not None:
            residual_stack = _pos(residual_stack, batch_slice, dim=1)
        norm, stream = self._norm_and_input(layer, n, mlp_input, stack)
        if norm is None:
            return residual_stack
        d_model = residual_stack.shape[-1]
        centred = norm_centres(norm, d_model)
        if recompute_ln and layer == n:
            scale = norm_scale(norm, residual_stack)
        else:
            scale = _pos(norm_scale(norm, stream), pos_slice)
            if self.has_batch_dim and batch_slice is not None:
                scale = _pos(scale, batch_slice, dim=0)
            dims = scale.shape[:-1]  # the run's (batch, pos) as sliced: the stack must end with them, never broadcast
            if residual_stack.ndim <= len(dims) or residual_stack.shape[-len(dims) - 1:-1] != dims:
                raise ValueError(f"apply_ln_to_stack: the stack {tuple(residual_stack.shape)} must end with the run's "
                                 f"{tuple(dims)} positions and d_model; for a stack at some positions pass the same "
                                 "pos_slice (and batch_slice) that took them (e.g. pos_slice=-1).")
        if centred:
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        return residual_stack / scale.to(residual_stack.dtype)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                    batch_slice=None, has_batch_dim: bool = True) -> torch.Tensor:
        """Each component's direct contribution to the logit of ``tokens`` (minus ``incorrect_tokens``): the stack
        through the final norm (``apply_ln_to_stack``) dotted with ``model.tokens_to_residual_directions``."""
        model = self._require_model("logit_attrs")
        directions = model.tokens_to_residual_directions(tokens)
        if incorrect_tokens is not None:
            wrong = model.tokens_to_residual_directions(incorrect_tokens)
            if wrong.shape != directions.shape:
                raise ValueError(f"tokens and incorrect_tokens must have the same shape; got {tuple(directions.shape)}"
                                 f" and {tuple(wrong.shape)}.")
            directions = directions - wrong
        scaled = self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim)
        if (has_batch_dim and scaled.ndim == 4 and directions.ndim == 2
                and directions.shape[0] == scaled.shape[1]):  # one direction per sequence: broadcast over positions
            directions = directions[:, None]
        return (scaled * directions.to(scaled.dtype)).sum(-1)

    # -- decompositions ------------------------------------------------------------------------------------------
    def _embeds(self, pos_slice) -> tuple[list, list]:
        """The embedding's parts of the stream entering block 0: ``embed`` and, with a learned position table,
        ``pos_embed`` (what the embedding layer added to ``hook_embed``)."""
        first = self._get("blocks", 0, "resid_pre")
        embed = self._store.get("hook_embed")
        if embed is None or torch.equal(embed, first):
            return [_pos(first, pos_slice)], ["embed"]
        if self.model is not None and self.model.position_table() is not None:
            return [_pos(embed, pos_slice), _pos(first - embed, pos_slice)], ["embed", "pos_embed"]
        return [_pos(first, pos_slice)], ["embed"]

    def _check_sum(self, parts: torch.Tensor, layer: int, n: int, mlp_input: bool, pos_slice, what: str):
        """Refuse a decomposition whose parts do not add up to the stream they decompose."""
        if getattr(getattr(self.model, "cfg", None), "block", "") == "post-norm":
            raise NotImplementedError(f"{what}: post-norm blocks (BERT) normalise the stream after each sublayer, so "
                                      "it is not the sum of the sublayers' outputs; use accumulated_resid.")
        target = (self._get("blocks", n - 1, "resid_post") if layer == n else
                  self._get("blocks", layer, "resid_mid" if mlp_input else "resid_pre"))
        target = _pos(target, pos_slice).float()
        tol = (1e-4 if parts.dtype == torch.float32 else 5e-2) * max(1.0, float(target.abs().max()))
        error = float((parts.float().sum(0) - target).abs().max())
        if error > tol:
            kind = getattr(getattr(self.model, "cfg", None), "block", "")
            raise NotImplementedError(
                f"{what}: this model's blocks do not add hook_attn_out and hook_mlp_out to the residual stream as they "
                f"are ({kind} blocks; the parts miss the stream by {error:.3g}), so there is no exact split; use "
                "accumulated_resid, or analyses.direct_logit_attribution (which carries each part through the norms).")

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice=None, incl_embeds: bool = True, return_labels: bool = False):
        """The stream entering ``layer`` (None: the final norm's input) as the sum of its parts: ``embed``
        (``pos_embed``), then each block's ``{l}_attn_out`` and ``{l}_mlp_out`` (``mode``: "all", "attn", "mlp")."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode is 'all', 'attn' or 'mlp'; got {mode!r}.")
        prefix, n = "blocks", self._single("decompose_resid")
        layer = self._layer(layer, n)
        parts, labels = self._embeds(pos_slice) if incl_embeds else ([], [])
        for l in range(layer + (1 if mlp_input and layer < n else 0)):
            for kind in ("attn_out", "mlp_out"):
                if l == layer and kind == "mlp_out":
                    continue
                if mode == "all" or mode == kind[:-4]:
                    parts.append(_pos(self._get(prefix, l, kind), pos_slice))
                    labels.append(f"{l}_{kind}")
        out = torch.stack(parts)
        if mode == "all" and incl_embeds:
            self._check_sum(out, layer, n, mlp_input, pos_slice, "decompose_resid")
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, mlp_input, pos_slice)
        return (out, labels) if return_labels else out

    def _head_results(self, layer: int) -> torch.Tensor:
        """Every head's output in d_model ``(*b, p, h, m)`` of one layer: its ``hook_result`` if captured, else its
        ``hook_z`` times the head's rows of the output projection (TransformerLens's ``compute_head_results``)."""
        name = f"blocks.{layer}.attn.hook_result"
        if name in self._store:
            return self._store[name]
        z = self[f"blocks.{layer}.attn.hook_z"]
        model = self._require_model("stack_head_results (without hook_result in the cache)")
        w_o = head_weights(model, layer, fold_norms=False)["W_O"].to(device=z.device, dtype=z.dtype)  # (h, e, m)
        return torch.einsum("...phe,hem->...phm", z, w_o)

    def stack_head_results(self, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False, *, layers=None):
        """Every head's output in d_model of the blocks before ``layer``: ``(l * h, *b, p, m)``, labels ``L{l}H{h}``
        (``incl_remainder``: plus the rest of the stream). ``layers=[...]`` (keyword, the form before) returns
        ``(stack, labels)`` of those layers."""
        if layers is not None:
            return super().stack_head_results(layers)
        n = self._single("stack_head_results")
        layer = self._layer(layer, n)
        parts, labels = [], []
        for l in range(layer):
            result = _pos(self._head_results(l), pos_slice, dim=-3)  # (*b, p, h, m)
            parts.append(result.movedim(-2, 0))
            labels += [f"L{l}H{h}" for h in range(result.shape[-2])]
        if parts:
            out = torch.cat(parts)
        else:
            embed = _pos(self._get("blocks", 0, "resid_pre"), pos_slice)
            out = embed.new_zeros((0, *embed.shape))
        if incl_remainder:
            stream = _pos(self._get("blocks", layer - 1, "resid_post") if layer else
                          self._get("blocks", 0, "resid_pre"), pos_slice)
            out = torch.cat([out, (stream - out.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, pos_slice=pos_slice)
        return (out, labels) if return_labels else out

    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False, pos_slice=None,
                                     return_labels: bool = False, project_output_onto: torch.Tensor | None = None):
        """The stream entering ``layer`` as every head's output (``L{l}H{h}``), each block's MLP output
        (``{l}_mlp_out``), the embeddings and the output projections' biases (``bias``), summing to the stream.
        ``expand_neurons`` (TransformerLens's default) is refused: interp has no hook inside an MLP."""
        if expand_neurons:
            raise NotImplementedError("interp has no hook on MLP neurons, so they cannot be expanded; pass "
                                      "expand_neurons=False for one row per MLP.")
        model = self._require_model("get_full_resid_decomposition")
        n = self._single("get_full_resid_decomposition")
        layer = self._layer(layer, n)
        upto = layer + (1 if mlp_input and layer < n else 0)
        heads, labels = self.stack_head_results(upto, return_labels=True, pos_slice=pos_slice)
        parts = [heads]
        if layer > 0:
            mlps, mlp_labels = self.decompose_resid(layer, mlp_input, "mlp", pos_slice=pos_slice, incl_embeds=False,
                                                    return_labels=True)
            parts.append(mlps)
            labels += mlp_labels
        embeds, embed_labels = self._embeds(pos_slice)
        parts.append(torch.stack(embeds))
        labels += embed_labels
        bias = sum((model.b_O[l] for l in range(upto)), torch.zeros(heads.shape[-1], dtype=heads.dtype,
                                                                      device=heads.device))
        parts.append(bias.to(heads.dtype).expand(1, *heads.shape[1:]))
        labels.append("bias")
        out = torch.cat(parts)
        self._check_sum(out, layer, n, mlp_input, pos_slice, "get_full_resid_decomposition")
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, mlp_input, pos_slice)
        if project_output_onto is not None:
            out = out @ project_output_onto.to(out.dtype)
        return (out, labels) if return_labels else out

    def _require_model(self, what: str):
        if self.model is None:
            raise ValueError(f"{what} needs the model: use the cache run_with_cache returns (it knows its model).")
        return self.model
