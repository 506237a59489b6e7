"""Where a hook of ours carries something other than TransformerLens's hook of the same name, said the first time a
TransformerLens user touches it: a warning, once per model and difference, when a model loaded with
``HookedTransformer.from_pretrained`` has such a hook added or read from its cache (``notebooks/transformerlens.md``,
"What differs on purpose").

Checked against TransformerLens 4.3's source: its ``hook_q``/``hook_k`` are the projections' outputs before rotary
(``hook_rot_q``/``hook_rot_k`` after it; the bridge's ``q.hook_out``/``k.hook_out`` and ``HookedTransformer``'s
alike), ours are after it, as the kernel multiplies them. Its ``hook_k``/``hook_v`` under grouped-query attention
are per key/value head, as ours (``HookedTransformer`` unless ``cfg.ungroup_grouped_query_attention``; the bridge
reshapes to ``n_key_value_heads``): no warning for those.
"""

from __future__ import annotations

import re
import warnings

__all__ = ["warn_tl_differences"]

_QK = re.compile(r"(?:^|\.)attn\.hook_([qk])$")


def _rotary(model) -> bool:
    return getattr(model.cfg, "positions", None) == "rotary"


def warn_tl_differences(model, names) -> None:
    """Warn, the first time for ``model``, if ``names`` (hook names being hooked or read) include a hook whose
    content differs from TransformerLens's: ``hook_q``/``hook_k`` on a rotary model. Only for models loaded through
    ``HookedTransformer.from_pretrained`` (``model.tl_differences`` is then a set of the differences said)."""
    said = getattr(model, "__dict__", {}).get("tl_differences")
    if said is None or "rotary_qk" in said or not _rotary(model):
        return
    hit = next((n for n in names if isinstance(n, str) and _QK.search(n)), None)
    if hit is None:
        return
    said.add("rotary_qk")
    warnings.warn(f"{hit}: interp's hook_q/hook_k are after rotary embeddings (and any q/k norm), as the attention "
                  "kernel multiplies them, i.e. TransformerLens's hook_rot_q/hook_rot_k; TransformerLens's "
                  "hook_q/hook_k are before rotary. Said once per model; see notebooks/transformerlens.md.",
                  UserWarning, stacklevel=3)
