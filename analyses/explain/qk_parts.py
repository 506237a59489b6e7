"""The exact split of a head's attention score into (query component, key component) terms: what one forward records
at the positions the pairs use, and the frozen maps that carry each residual component to q and k.

A site's query at position i is ``rope_i(qnorm(norm(x_i) @ W_Q + b_Q))`` (each step present or not), with ``x_i`` the
residual stream its block reads. Every norm on that way is affine once its scale (standard deviation or root mean
square) is frozen at the value of this run's forward, as TransformerLens's ``apply_ln_to_stack`` does: the input
norm, a q/k norm (Gemma 3, OLMo 2), a norm on a sublayer's output (Gemma 2/3's post-attention norm, whose scale
is that of the whole attention output) and an encoder's final norm (the keys of cross-attention). RoPE is a
rotation per position. So q_i is a sum over the components of ``x_i`` plus a constant, and so is k_j, and the
scaled score ``scale * q_i . k_j`` (before soft-cap, bias and mask) is the sum of their pairwise products.

Components of a stream (one stack's): ``embed`` (and ``pos_embed``, a learned position table), each upstream head's
output through the output projection (and through its block's frozen post-attention norm), ``out_bias`` (the
output projections' biases, summed over blocks), each block's ``mlp`` (what its MLP branch adds, norm included).
Every map is checked on the run: the components must add up to the norm's real input and their images to the real
``hook_q``/``hook_k``; an architecture where they do not (post-norm blocks) is refused, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hooks.names import hook_name
from interp.lens.circuits import head_biases, head_weights
from interp.structure.norms import norm_bias, norm_centres, norm_eps, norm_weight

from ..causal.engine import _arguments

# The q/k norms are children of the attention module that no hook of ours sees; these are HF's names for them.
QK_NORMS = {"q": ("q_norm", "q_layernorm", "query_layernorm"), "k": ("k_norm", "k_layernorm", "key_layernorm")}


class _Stop(Exception):
    """Raised once the last head asked about has run: the rest of the forward (the logits) is not needed."""


def run_until(model, batch, hooks: list, sites) -> None:
    """One forward of ``batch`` with ``hooks``, stopped after the last of ``sites`` (call order) has attended: the
    blocks after it and the output layer (at 8k tokens SmolLM2's logits alone are 1.6 GB) never run."""
    order = {s.name: i for i, s in enumerate(model.cfg.sites)}
    last = max(sites, key=lambda s: order[s.name]).name

    def stop(t, hook):
        raise _Stop

    try:
        with model.studying(), torch.no_grad(), model.hooks([*hooks, (hook_name("z", last), stop)]):
            args, kwargs = _arguments(batch)
            model(*args, **kwargs)
    except _Stop:
        pass


def prefix_of(site) -> str:
    """Where a site's stack keeps its block hooks: ``blocks``, ``encoder.blocks`` or ``decoder.blocks``."""
    return site.name.rsplit(".", 2)[0]


def block_hook(kind: str, prefix: str, block: int) -> str:
    """A block hook's name in the stack at ``prefix`` (``prefix_of``): ``hooks.names.hook_name`` with its stack."""
    return hook_name(kind, block, None if prefix == "blocks" else prefix.split(".")[0])


def key_prefix(model, site) -> str:
    """The stack a site's keys come from: its own, or for cross-attention the stack fed its ``keys`` entry."""
    if site.kind != "cross":
        return prefix_of(site)
    return next(prefix_of(s) for s in model.cfg.sites if s.kind == "self" and s.queries == site.keys)


def stack_sites(model, prefix: str) -> list:
    return [s for s in model.cfg.sites if prefix_of(s) == prefix]


def out_hook(prefix: str, site) -> str:
    return block_hook("cross_attn_out" if site.kind == "cross" else "attn_out", prefix, site.block)


@dataclass
class Rows:
    """The (batch, position) rows of one stack kept by a record, and where each sits among them."""

    b: torch.Tensor
    p: torch.Tensor
    where: dict = field(default_factory=dict)

    @classmethod
    def of(cls, pairs) -> Rows:
        kept = sorted(set(pairs))
        rows = cls(torch.tensor([b for b, _ in kept], dtype=torch.long), torch.tensor([p for _, p in kept],
                                                                                      dtype=torch.long))
        rows.where = {bp: i for i, bp in enumerate(kept)}
        return rows

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """``t: (b or 1, p, ...)`` at the rows: ``(n, ...)``, detached, on the CPU."""
        b = self.b.clamp(max=t.shape[0] - 1).to(t.device)
        return t.detach()[b, self.p.to(t.device)].cpu()


class Record:
    """One forward's tensors at the kept rows: stream hooks, every site's z, the target sites' q, k, lse, position
    bias, RoPE tables, and the inputs of their norms and projections (torch hooks, removed by ``close``)."""

    def __init__(self, model, rows: dict, targets: list):
        self.model, self.rows, self.targets = model, rows, targets
        self.hooks, self.at, self.bias, self.handles, self._weights = [], {}, {}, [], {}
        self.post_norms: dict = {}  # site -> the norm its block puts its output through (Gemma 2/3), or None
        self.final_norm = None  # the norm between the key stack and cross-attention keys (T5's encoder), or None
        # how closely the run's own tensors must agree with their sums (float32: 1e-4 of their size; bf16 rounds)
        self.tol = 1e-4 if model.dtype in (torch.float32, torch.float64) else 2e-2
        names = set(model.hook_names())
        for prefix, kept in rows.items():
            wanted = [n for n in names if n.startswith(prefix + ".") and (".hook_resid_" in n or "attn_out" in n
                                                                           or n.endswith(".hook_z"))]
            if prefix == "blocks" and "hook_embed" in names:
                wanted.append("hook_embed")
            self.hooks.append((wanted, self._saver(kept)))
        for site in targets:
            q_rows, k_rows = rows[prefix_of(site)], rows[key_prefix(model, site)]
            self.hooks += [(hook_name("q", site.name), self._saver(q_rows, bias_of=site)),
                           (hook_name("lse", site.name), self._lse(q_rows)), (hook_name("k", site.name), self._saver(k_rows))]
            attn = model._site_modules[site.name]
            self._torch(attn.register_forward_pre_hook(self._rope(site, q_rows, k_rows), with_kwargs=True))
            norm = model.in_norm_of(site)
            if norm is not None:
                self._torch(norm.register_forward_pre_hook(self._input(f"{site.name}.in_norm", q_rows)))
            if site.kind == "cross":
                k_proj = projection(model, site, "k")
                self._torch(k_proj.register_forward_pre_hook(self._input(f"{site.name}.k_input", k_rows)))

    def weights(self, site) -> dict:
        """A site's W_Q, W_K, W_O and biases in float64 on the CPU, read once per record (no norm folded in)."""
        if site.name not in self._weights:
            found = {**head_weights(self.model, site.name, fold_norms=False), **head_biases(self.model, site.name)}
            self._weights[site.name] = {k: v.cpu() for k, v in found.items()}
        return self._weights[site.name]

    def _torch(self, handle) -> None:
        self.handles.append(handle)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _saver(self, rows: Rows, bias_of=None):
        def save(t, hook):
            self.at[hook.name] = rows.take(t)
            if bias_of is not None:  # the attention function has just stored this call's position bias (T5)
                b = self.model._layer_hooks[bias_of.name].bias
                self.bias[bias_of.name] = None if b is None else b.detach()
        return save

    def _lse(self, rows: Rows):
        def save(lse, hook):  # (b, h, q)
            self.at[hook.name] = rows.take(lse.transpose(1, 2))  # (n, h)
        return save

    def _input(self, name: str, rows: Rows):
        def grab(module, args):
            if name not in self.at:  # a module called more than once (a shared norm): its first call
                self.at[name] = rows.take(args[0])
        return grab

    def _rope(self, site, q_rows: Rows, k_rows: Rows):
        def grab(module, args, kwargs):
            table = kwargs.get("position_embeddings")
            if isinstance(table, (tuple, list)) and len(table) == 2:
                self.at[f"{site.name}.rope_q"] = tuple(q_rows.take(t) for t in table)
                self.at[f"{site.name}.rope_k"] = tuple(k_rows.take(t) for t in table)
        return grab


def projection(model, site, side: str) -> torch.nn.Module:
    """The linear module that computes a site's q or k (a fused module for several)."""
    module, proj = model.projections_of(site)
    return module.get_submodule(getattr(proj, side))


def qk_norm(attn: torch.nn.Module, side: str) -> torch.nn.Module | None:
    for name in QK_NORMS[side]:
        found = getattr(attn, name, None)
        if isinstance(found, torch.nn.Module) and any(True for _ in found.parameters()):
            return found
    return None


# -- frozen norms ---------------------------------------------------------------------------------------------------
def frozen(norm, x: torch.Tensor):
    """``(apply, const)`` in float64 with ``apply(c) + const == norm(x)`` for the norm's real input ``x: (n, m)``
    and ``apply`` linear: the scale frozen at ``x``'s (LayerNorm: centre, divide by the standard deviation;
    RMSNorm: divide by the root mean square; then the effective weight, Gemma's ``1 + w`` included)."""
    if norm is None:
        return (lambda c: c), 0.0
    m = x.shape[-1]
    eps, centred = norm_eps(norm, m), norm_centres(norm, m)
    weight = norm_weight(norm, m).cpu()
    bias = norm_bias(norm, m)
    x = x.double()
    if centred:
        x = x - x.mean(-1, keepdim=True)
    scale = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def apply(c: torch.Tensor) -> torch.Tensor:
        c = c - c.mean(-1, keepdim=True) if centred else c
        return weight * c / scale

    return apply, (0.0 if bias is None else bias.cpu())


def _norms(modules, width: int, skip=()) -> list:
    """The norm modules among ``modules`` over ``width`` features (not a q/k norm over a head's)."""
    return [m for m in modules if "Norm" in type(m).__name__ and m not in skip
            and all(p.shape[-1] == width for p in m.parameters())]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-3) -> bool:
    return a.shape == b.shape and float((a.double() - b.double()).abs().max()) <= rel * max(1.0, float(b.abs().max()))


def _refuse(what: str, error: float) -> None:
    raise NotImplementedError(f"{what} (off by {error:.3g}), so the score has no exact split into residual components "
                              "on this model. Supported: pre-norm and parallel blocks, with or without norms on the "
                              "sublayers' outputs (Gemma 2/3), RoPE, q/k norms, T5's position bias.")


# -- the residual stream as a sum of components ---------------------------------------------------------------------
def stream_parts(model, rec: Record, prefix: str, upto=None) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """The stream of stack ``prefix`` at its kept rows, entering site ``upto`` (None: leaving the last block), as
    ``(labels, parts (c, n, m) float64, stream (n, m))`` with ``parts.sum(0) == stream`` (checked by the caller
    against the norm's real input)."""
    at = rec.at
    sites = stack_sites(model, prefix)
    layered = prefix == "blocks"
    short = "" if layered else prefix.split(".")[0][:3] + "."
    first = at[block_hook("resid_pre", prefix, 0)].double()
    embed = at.get("hook_embed") if layered else None
    if embed is not None and model.position_table() is not None and not torch.equal(embed.double(), first):
        labels, parts = [_label("embed"), _label("pos_embed")], [embed.double(), first - embed.double()]
    else:
        labels, parts = [_label(f"{short}embed")], [first]
    out_bias = torch.zeros_like(first)
    n_blocks = 1 + max(s.block for s in sites)
    stream = first
    for block in range(n_blocks):
        for site in [s for s in sites if s.block == block]:
            if upto is not None and site.name == upto.name:
                return labels + [_label(f"{short}out_bias")], torch.stack(parts + [out_bias]), stream
            z = at[hook_name("z", site.name)].double()  # (n, h, e)
            weights = rec.weights(site)
            heads = torch.einsum("nhe,hem->hnm", z, weights["W_O"])
            bias = weights["b_O"].expand_as(first)
            attn_out = at[out_hook(prefix, site)].double()
            apply, const, rec.post_norms[site.name] = _post_norm(model, rec, prefix, site, attn_out, stream)
            parts += list(apply(heads))
            out_bias = out_bias + apply(bias) + const
            labels += [_label("head", site, h, f"{short}L{site.block}{'x' if site.kind == 'cross' else ''}H{h}")
                       for h in range(heads.shape[0])]
            stream = stream + apply(attn_out) + const
        post = at[block_hook("resid_post", prefix, block)].double()
        parts.append(post - stream)
        labels.append({**_label("mlp"), "source_stack": sites[0].stack, "source_layer": block,
                       "label": f"{short}mlp{block}"})
        stream = post
    return labels + [_label(f"{short}out_bias")], torch.stack(parts + [out_bias]), stream


def _label(name: str, site=None, head: int | None = None, label: str | None = None) -> dict:
    kind = "head" if site is not None else name.split(".")[-1]
    return {"label": label or name, "component": kind, "source_stack": None if site is None else site.stack,
            "source_site": None if site is None else site.name, "source_layer": None if site is None else site.block,
            "source_head": head}


def _post_norm(model, rec: Record, prefix: str, site, attn_out: torch.Tensor, stream: torch.Tensor):
    """How the block adds ``site``'s output to the stream: as it is, or through a norm (frozen at the whole
    output's scale), found where the block's ``hook_resid_mid`` says what was added."""
    mid = rec.at.get(block_hook("resid_mid", prefix, site.block))
    first = min((s for s in stack_sites(model, prefix) if s.block == site.block), key=lambda s: s.kind != "self")
    if mid is None or site.name != first.name:
        return (lambda c: c), 0.0, None
    added = mid.double() - stream
    if close(attn_out, added, rec.tol):
        return (lambda c: c), 0.0, None
    blocks = model._blocks[prefix.split(".")[0]] if isinstance(model._blocks, dict) else model._blocks
    for norm in _norms(blocks[site.block].modules(), attn_out.shape[-1], skip=(model.in_norm_of(site),)):
        with torch.no_grad():
            param = next(norm.parameters(), None)
            dtype = param.dtype if param is not None else torch.float32
            out = norm(attn_out.to(device=model.device, dtype=dtype)).double().cpu()
        if close(out, added, rec.tol):
            return (*frozen(norm, attn_out), norm)
    _refuse(f"{prefix}.{site.block}: the stream does not grow by the attention output or a norm of it",
            float((added - attn_out).abs().max()))


def _final_norm(model, rec: Record, prefix: str, stream: torch.Tensor, k_input: torch.Tensor):
    """The norm between a stack's last block and what reads it (an encoder's final norm), frozen; or none."""
    if close(stream, k_input, rec.tol):
        return (lambda c: c), 0.0
    blocks = model._blocks[prefix.split(".")[0]] if isinstance(model._blocks, dict) else model._blocks
    inside = {id(m) for b in blocks for m in b.modules()}
    for norm in _norms(model.hf.modules(), stream.shape[-1]):
        if id(norm) not in inside:
            with torch.no_grad():
                param = next(norm.parameters(), None)
                out = norm(stream.to(device=model.device, dtype=param.dtype if param is not None else torch.float32))
            if close(out.double().cpu(), k_input, rec.tol):
                rec.final_norm = norm
                return frozen(norm, stream)
    _refuse(f"the keys' input is neither the {prefix} stack's output nor a norm of it",
            float((stream - k_input.double()).abs().max()))


# -- components to q and k ------------------------------------------------------------------------------------------
def _rotate(v: torch.Tensor, table) -> torch.Tensor:
    """HF's rotate-half RoPE at each row: ``v: (..., n, d)``, cos/sin ``(n, r)`` with ``r <= d`` (partial rotary)."""
    cos, sin = (t.double() for t in table)
    r = cos.shape[-1]
    rot, rest = v[..., :r], v[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], -1)
    return torch.cat([rot * cos + half * sin, rest], -1)


def side_vectors(model, rec: Record, site, side: str, index: int, cache: dict):
    """One side of one head: ``(labels, vectors (c + 1, n, d) float64, real (n, d))`` at the side's kept rows; row
    ``c`` is the constant (``qk_bias``: the norm's bias and the projection's), the others the components' images,
    summing to the run's ``hook_q``/``hook_k`` (checked). ``index``: the query head, or the key/value head."""
    prefix = prefix_of(site) if side == "q" else key_prefix(model, site)
    cross_k = site.kind == "cross" and side == "k"
    key = (prefix, None if cross_k else site.name)
    if key not in cache:
        for s in stack_sites(model, prefix) + [site]:
            if model.in_norm_of(s) is None:
                raise NotImplementedError(f"{s.name} reads the residual stream without a norm of its own (post-norm "
                                          "blocks, BERT and BART): the stream is normalised after each sublayer and "
                                          "is not a sum of the sublayers' outputs, so scores have no exact split.")
        labels, parts, stream = stream_parts(model, rec, prefix, None if cross_k else site)
        if cross_k:
            apply, const = _final_norm(model, rec, prefix, stream, rec.at[f"{site.name}.k_input"])
        else:
            real = rec.at[f"{site.name}.in_norm"]
            if not close(parts.sum(0), real, rec.tol):
                _refuse(f"{site.name}: the components do not add up to the stream its norm reads",
                        float((parts.sum(0) - real.double()).abs().max()))
            apply, const = frozen(model.in_norm_of(site), real)
        cache[key] = (labels, apply(parts), const)
    labels, normed, const = cache[key]
    rows = rec.rows[prefix]
    weights = rec.weights(site)
    w = weights["W_Q" if side == "q" else "W_K"][index]  # (m, d)
    b = weights["b_Q" if side == "q" else "b_K"][index]  # (d,)
    raw = normed @ w  # (c, n, d)
    const = torch.as_tensor(const, dtype=torch.float64).expand(w.shape[0])
    fixed = (const @ w + b).expand(raw.shape[1:])
    vectors = torch.cat([raw, fixed[None]])
    qkn = qk_norm(model._site_modules[site.name], side)
    if qkn is not None:  # its input, all heads: the norm's output (the components' sum) through the projection
        all_w, all_b = weights["W_Q" if side == "q" else "W_K"], weights["b_Q" if side == "q" else "b_K"]
        raw_all = torch.einsum("nm,hmd->nhd", normed.sum(0) + const, all_w) + all_b
        vectors = _through_qk_norm(qkn, raw_all, vectors, index, site)
    table = rec.at.get(f"{site.name}.rope_{side}")
    if table is not None:
        vectors = _rotate(vectors, table)
    real = rec.at[hook_name(side, site.name)][:, index].double()  # (n, d)
    if not close(vectors.sum(0), real, 10 * rec.tol):
        _refuse(f"{site.name}: the components' images do not add up to its {side} (head {index})",
                float((vectors.sum(0) - real).abs().max()))
    return labels + [_label("qk_bias")], vectors, real, rows


def _through_qk_norm(norm, raw_all: torch.Tensor, vectors: torch.Tensor, index: int, site) -> torch.Tensor:
    """A q/k norm frozen at the run's q (or k) ``raw_all: (n, heads, d)``: per head (Gemma 3, a weight of size d) or
    over all heads at once (OLMo 2: an RMSNorm over ``heads * d``, each head's slice a slice of its weight)."""
    n, heads, d = raw_all.shape
    size = sum(p.numel() for p in norm.parameters())
    if size != heads * d or heads == 1:
        apply, const = frozen(norm, raw_all[:, index])
        out = apply(vectors)
        out[-1] = out[-1] + const
        return out
    if norm_centres(norm, heads * d):
        raise NotImplementedError(f"{site.name}: a LayerNorm over all heads' q or k at once couples the heads; "
                                  "not supported.")
    eps = norm_eps(norm, heads * d)
    scale = torch.sqrt(raw_all.reshape(n, -1).pow(2).mean(-1, keepdim=True) + eps)  # (n, 1)
    weight = norm_weight(norm, heads * d).cpu()[index * d:(index + 1) * d]
    return weight * vectors / scale
