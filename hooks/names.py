"""The one table of hook names, with the shape and meaning of what each one carries.

Axis glossary: ``b`` batch, ``p`` position, ``q`` query position, ``k`` key position, ``h`` head,
``g`` key/value head (grouped-query attention), ``d`` query/key head dim, ``e`` value head dim (equal to ``d``
except in multi-head latent attention), ``m`` d_model.

Names follow TransformerLens. Where our meaning differs from TransformerLens, ``meaning`` says so.
Tests read this table: every name must fire once per layer with the documented shape.
"""

from __future__ import annotations

import difflib
import numbers
import re
from dataclasses import dataclass

__all__ = ["HookSpec", "HOOK_TABLE", "attn_site", "expand_names", "get_act_name", "hook_name", "spec_for", "suggest_names",
           "unknown_name_error"]


_NORM_RE = re.compile(r"(?:^|\.)(ln1|ln2|ln_cross|ln_final)\.hook_")


@dataclass(frozen=True)
class HookSpec:
    """One row of the hook table.

    template: the name, with ``{l}`` standing for the layer index.
    shape: named dims of the tensor a hook receives, e.g. ``"(b, p, h, d)"``.
    eager_only: the tensor is an n x n matrix that only the eager path builds.
    opt_in: not captured by ``run_with_cache`` unless asked for by name (costs memory or compute).
    optional: only present for model families whose table names the module it comes from.
    """

    template: str
    shape: str
    meaning: str
    eager_only: bool = False
    opt_in: bool = False
    optional: bool = False

    @property
    def per_layer(self) -> bool:
        return "{l}" in self.template

    @property
    def norm(self) -> str | None:
        """``"ln1"``, ``"ln2"`` or ``"ln_final"`` for a norm's hook (``blocks.{l}.ln1.hook_scale``), else None."""
        found = _NORM_RE.search(self.template)
        return found.group(1) if found else None

    @property
    def short(self) -> str:
        """``"blocks.{l}.attn.hook_q"`` -> ``"q"``; used by the cache's ``cache["q", 3]`` shorthand."""
        return self.template.rsplit("hook_", 1)[1]

    def name(self, layer: int | None = None) -> str:
        return self.template.format(l=layer) if self.per_layer else self.template


HOOK_TABLE: tuple[HookSpec, ...] = (
    HookSpec("hook_embed", "(b, p, m)", "token embeddings: the output of the model's input embedding module"),
    HookSpec("blocks.{l}.hook_resid_pre", "(b, p, m)", "residual stream entering block l"),
    HookSpec(
        "blocks.{l}.hook_resid_mid",
        "(b, p, m)",
        "residual stream between the attention and MLP sublayers (pre-norm blocks: the input of the module "
        "after attention, observe only; post-norm blocks such as BERT: the attention sublayer's normed output). "
        "Parallel blocks (GPT-NeoX, Phi, Cohere) have none: attention and MLP read the same input",
        optional=True,
    ),
    HookSpec("blocks.{l}.hook_resid_post", "(b, p, m)", "residual stream leaving block l"),
    HookSpec(
        "blocks.{l}.hook_attn_out",
        "(b, p, m)",
        "attention output: the output projection's output, before any norm the block applies to it (Gemma 2/3, "
        "OLMo2) and before the residual add (and BERT's LayerNorm)",
    ),
    HookSpec(
        "blocks.{l}.hook_mlp_out",
        "(b, p, m)",
        "MLP output, before any norm the block applies to it and before the residual add",
        optional=True,
    ),
    HookSpec(
        "blocks.{l}.attn.hook_q",
        "(b, p, h, d)",
        "queries as the attention kernel sees them: after RoPE and q-norms (TransformerLens: before rotary)",
    ),
    HookSpec(
        "blocks.{l}.attn.hook_k",
        "(b, p, g, d)",
        "keys as the kernel sees them: after RoPE, in key/value heads for GQA (TransformerLens: before rotary)",
    ),
    HookSpec("blocks.{l}.attn.hook_v", "(b, p, g, e)", "values, in key/value heads for GQA"),
    HookSpec(
        "blocks.{l}.attn.hook_attn_scores",
        "(b, h, q, k)",
        "scaled (and soft-capped) masked scores before softmax (masked entries hold the dtype's minimum); "
        "eager only",
        eager_only=True,
    ),
    HookSpec("blocks.{l}.attn.hook_pattern", "(b, h, q, k)",
             "attention pattern, softmax of the scores; with attention sinks (GPT-OSS) the sink's share is left "
             "out, so rows sum to less than 1; eager only",
             eager_only=True),
    HookSpec("blocks.{l}.attn.hook_z", "(b, p, h, e)", "per-head output, pattern @ v, before the output projection"),
    HookSpec(
        "blocks.{l}.attn.hook_lse",
        "(b, h, q)",
        "fp32 logsumexp of each query row's scores, the sink included (not in TransformerLens); any weight is "
        "exp(score - lse)",
    ),
    HookSpec(
        "blocks.{l}.attn.hook_result",
        "(b, p, h, m)",
        "per-head output projected to d_model, without the output bias; they sum to attn_out minus the bias",
        opt_in=True,
        optional=True,
    ),
    *(HookSpec(f"{where}.hook_{kind}", shape, f"{what}: {meaning}", opt_in=True, optional=True)
      for where, what in (("blocks.{l}.ln1", "the norm attention reads the stream through (pre-norm and parallel "
                                               "blocks)"),
                          ("blocks.{l}.ln2", "the norm the MLP reads hook_resid_mid through (pre-norm blocks)"),
                          ("ln_final", "the norm before the output layer"))
      for kind, shape, meaning in (
          ("scale", "(b, p, 1)", "the scale it divides by: the standard deviation (LayerNorm) or root mean square "
                                 "(RMSNorm) with its epsilon, in the stream's dtype (TransformerLens: float32); an "
                                 "edit changes the norm's output (centred x / scale * w + b)"),
          ("normalized", "(b, p, m)", "the stream centred (LayerNorm) and divided by hook_scale, before the "
                                      "norm's weight and bias (TransformerLens's); an edit changes the norm's output"))),
)

_BY_TEMPLATE = {spec.template: spec for spec in HOOK_TABLE}
_LAYER_RE = re.compile(r"\.(\d+)\.")


_STACK_RE = re.compile(r"^(encoder|decoder)\.")


def spec_for(name: str) -> HookSpec:
    """The table row of a concrete hook name, e.g. ``"blocks.3.attn.hook_z"``. Encoder-decoder names
    (``encoder.blocks.0.attn.hook_q``, ``decoder.blocks.1.cross_attn.hook_z``, ``...hook_cross_attn_out``) share
    the rows of their decoder-only counterparts; in cross-attention q comes from the decoder and k, v from the
    encoder's output."""
    name = _STACK_RE.sub("", name).replace(".cross_attn.", ".attn.").replace("hook_cross_attn_out", "hook_attn_out")
    name = name.replace(".ln_cross.", ".ln1.")  # the norm cross-attention's queries read the stream through
    return _BY_TEMPLATE[_LAYER_RE.sub(".{l}.", name, count=1)]


def expand_names(n_layers: int, skip_optional: tuple[str, ...] = ()) -> list[str]:
    """All concrete hook names for a model with ``n_layers`` blocks, in firing order per block.

    ``skip_optional`` lists the optional templates the model's family does not have.
    """
    names = [spec.template for spec in HOOK_TABLE if not spec.per_layer and spec.norm is None]
    layer_specs = [s for s in HOOK_TABLE if s.per_layer and s.template not in skip_optional]
    for layer in range(n_layers):
        names.extend(spec.name(layer) for spec in layer_specs)
    return names + [s.template for s in HOOK_TABLE if not s.per_layer and s.norm is not None  # ln_final: last
                    and s.template not in skip_optional]


def suggest_names(name: str, valid: list[str], n: int = 3) -> list[str]:
    """The closest valid names to a misspelt one."""
    return difflib.get_close_matches(name, valid, n=n, cutoff=0.5)


def unknown_name_error(name: str, valid: list[str]) -> ValueError:
    norm = _NORM_RE.search(name)
    if norm is not None and name.endswith((".hook_scale", ".hook_normalized")):
        return ValueError(
            f"This model has no hook {name!r}: interp makes a norm's hook_scale/hook_normalized only where a norm "
            f"reads the residual stream: ln1 before attention (pre-norm and parallel blocks), ln2 before the MLP "
            f"(pre-norm blocks), ln_final before the output layer (an encoder-decoder model: per stack, "
            f"encoder.blocks.0.ln1, decoder.blocks.0.ln_cross before cross-attention, encoder.ln_final); post-norm "
            f"blocks (BERT, BART) normalise after each sublayer. This model's: "
            f"{[n for n in valid if _NORM_RE.search(n)][:6] or 'none'}."
        )
    close = suggest_names(name, valid)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    layers = sorted({int(m) for v in valid for m in _LAYER_RE.findall(v)})
    span = f" Layers run 0..{layers[-1]}." if layers else ""
    return ValueError(
        f"Unknown hook name {name!r}.{hint}{span} See model.hook_names for the full list."
    )


# TransformerLens's other names for a kind; "in"/"out" are TransformerLens 4's block hooks (blocks.{l}.hook_in is its
# alias of hook_resid_pre, hook_out of hook_resid_post), what its demos ask get_act_name("in", l) for
_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
            "in": "resid_pre", "out": "resid_post"}
_SUBLAYERS = {None, "", "a", "attn", "attention", "b", "block", "blocks"}
_SHORTHAND = re.compile(r"^([a-z_]+?)(\d+)([a-z]*\d?)$")
_NORM_KINDS = ("scale", "normalized")  # TransformerLens's norm hooks (blocks.{l}.ln1.hook_scale, ...)


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """A hook's full name from TransformerLens's shorthand (``transformer_lens.utils.get_act_name``):
    ``get_act_name("pattern", 3) == "blocks.3.attn.hook_pattern"``, ``get_act_name("resid_pre", 0)``,
    ``get_act_name("embed") == "hook_embed"``, ``get_act_name("k6") == "blocks.6.attn.hook_k"``; its aliases
    (``attn`` for ``pattern``, ``attn_logits`` for ``attn_scores``, ``key``/``query``/``value``; TransformerLens 4's
    block ``in``/``out``: ``resid_pre``/``resid_post``) too. A full name
    comes back as it is. Kinds interp has no hook for (MLP neurons ``pre``/``post``) are refused;
    the norms' ``scale``/``normalized`` are ``ln_final.hook_scale``, ``blocks.4.ln1.hook_scale`` (layer_type ln1/ln2).

    >>> get_act_name("attn", 2, "attn"), get_act_name("v1")
    ('blocks.2.attn.hook_pattern', 'blocks.1.attn.hook_v')
    """
    if not isinstance(name, str):
        raise TypeError(f"get_act_name takes a kind such as 'pattern' or 'resid_pre'; got {name!r}.")
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = _SHORTHAND.match(name) if layer is None else None
    if match is not None and match.group(1).rstrip("_") in {*_ALIASES, *_NORM_KINDS, *(s.short for s in HOOK_TABLE)}:
        name, layer, layer_type = match.group(1).rstrip("_"), int(match.group(2)), match.group(3) or None
    kind = _ALIASES.get(name, name)
    if kind in _NORM_KINDS:
        if layer is None:
            return f"ln_final.hook_{kind}"
        if layer_type not in ("ln1", "ln2"):
            raise ValueError(f"get_act_name({kind!r}, {layer}) needs layer_type 'ln1' or 'ln2'; got {layer_type!r}.")
        return f"blocks.{layer}.{layer_type}.hook_{kind}"
    spec = next((s for s in HOOK_TABLE if s.short == kind), None)
    if spec is None:
        kinds = sorted({s.short for s in HOOK_TABLE} | set(_ALIASES))
        raise ValueError(f"interp has no hook of kind {name!r} (TransformerLens's MLP neurons 'pre'/'post' have none "
                         f"here); kinds are {kinds}.")
    if layer_type not in _SUBLAYERS and not (layer_type in ("m", "mlp") and kind == "mlp_out"):
        raise ValueError(f"get_act_name: layer_type {layer_type!r} does not fit {kind!r} in interp's names.")
    if spec.per_layer != (layer is not None):
        need = "a layer" if spec.per_layer else "no layer"
        raise ValueError(f"{kind!r} takes {need}; got layer={layer!r}.")
    return spec.name(layer)


_SITE_TEMPLATE = next(s.template for s in HOOK_TABLE if s.short == "z").rsplit(".hook_", 1)[0]  # "blocks.{l}.attn"
_SITE_KINDS = frozenset(s.short for s in HOOK_TABLE if s.template.startswith(_SITE_TEMPLATE + ".hook_"))


def attn_site(layer: int) -> str:
    """The attention site of layer ``layer`` where each layer has one (decoder-only and encoder-only models), the
    prefix of its attention hooks: ``attn_site(3) == "blocks.3.attn"``."""
    return _SITE_TEMPLATE.format(l=layer)


def hook_name(kind: str, where, stack: str | None = None) -> str:
    """A hook's full name from its kind and where it fires: a layer number (as ``get_act_name``:
    ``hook_name("resid_pre", 0) == "blocks.0.hook_resid_pre"``; in an encoder-decoder model with its ``stack``:
    ``hook_name("resid_post", 1, "decoder") == "decoder.blocks.1.hook_resid_post"``, and ``"cross_attn_out"`` for
    a decoder block's cross-attention output), or, for the kinds an attention site has (q, k, v, attn_scores,
    pattern, z, lse, result), a site's name or anything with a ``name`` (an ``interp.attention.sites.Site``), on any model:
    ``hook_name("z", "decoder.blocks.0.cross_attn") == "decoder.blocks.0.cross_attn.hook_z"``.

    >>> hook_name("pattern", 2), hook_name("q", "encoder.blocks.1.attn"), hook_name("cross_attn_out", 0, "decoder")
    ('blocks.2.attn.hook_pattern', 'encoder.blocks.1.attn.hook_q', 'decoder.blocks.0.hook_cross_attn_out')
    """
    if isinstance(where, numbers.Integral) and not isinstance(where, bool):
        if stack not in (None, "encoder", "decoder"):
            raise ValueError(f"stack is 'encoder' or 'decoder' (an encoder-decoder model's), or None; got {stack!r}.")
        cross = kind == "cross_attn_out"
        if cross and stack != "decoder":
            raise ValueError("cross_attn_out is a hook of an encoder-decoder model's decoder blocks: give "
                             "stack='decoder'.")
        name = get_act_name("attn_out" if cross else kind, int(where))
        name = name.replace("hook_attn_out", "hook_cross_attn_out") if cross else name
        return name if stack is None else f"{stack}.{name}"
    site = getattr(where, "name", where)
    if not isinstance(site, str) or not site:
        raise TypeError(f"hook_name takes a layer number or an attention site's name such as 'blocks.3.attn'; "
                        f"got {where!r}.")
    kind = _ALIASES.get(kind, kind)
    if kind not in _SITE_KINDS:
        raise ValueError(f"An attention site's hooks are of kinds {sorted(_SITE_KINDS)}; got {kind!r}. Per-block kinds "
                         "(resid_pre, attn_out, ...) take a layer number: hook_name('resid_pre', 3).")
    return f"{site}.hook_{kind}"
