"""TransformerLens's loading line: ``HookedTransformer.from_pretrained(name)`` gives a ``HookedModel`` that answers
``model(tokens)`` with logits, as TransformerLens's does (``interp.load_model`` gives one that answers with the HF
output); everything else is the same model (``notebooks/transformerlens.md``)."""

from __future__ import annotations

import warnings

from ..tokens.inputs import adds_bos
from .loading import load_model
from .hooked import HookedModel

__all__ = ["HookedTransformer"]


class HookedTransformer:
    """Only a namespace for ``from_pretrained``: the model it returns is a ``HookedModel``."""

    def __init__(self, *args, **kwargs):
        raise TypeError("interp has no HookedTransformer class to build: load a model with "
                        "HookedTransformer.from_pretrained(name) or interp.load_model(name).")

    @staticmethod
    def from_pretrained(model_name, fold_ln: bool = True, device="auto", dtype=None, attn: str = "flash",
                        center_writing_weights: bool = True, center_unembed: bool = True,
                        fold_value_biases: bool = True, **kwargs) -> HookedModel:
        """``interp.load_model(model_name, attn, device, dtype)`` with TransformerLens's defaults: ``model(tokens)``
        returns logits (``model.return_type = "logits"``) and ``model.W_*`` have the norms folded in
        (``fold_ln``). ``center_writing_weights``, ``center_unembed`` and ``fold_value_biases`` are accepted
        and do nothing: interp never rewrites a model's weights, so its activations are the HF model's.
        ``torch_dtype`` is taken for ``dtype``; other TransformerLens options are refused by name."""
        dtype = kwargs.pop("torch_dtype", dtype)
        unknown = sorted(set(kwargs) - {"tokenizer", "device_map"})
        if unknown:
            raise TypeError(f"HookedTransformer.from_pretrained does not take {unknown}; it takes fold_ln, device, "
                            "dtype, attn, tokenizer and device_map.")
        model = load_model(model_name, attn=attn, device=device, dtype=dtype, **kwargs)
        model.return_type = "logits"
        model.fold_ln = fold_ln
        model.tl_differences = set()  # where our hooks differ from TransformerLens's: said once (interp.lens.differences)
        tok = model.tokenizer
        if getattr(tok, "bos_token_id", None) is not None and not adds_bos(tok):
            warnings.warn(f"{model_name}: text is tokenized without a BOS token, as its tokenizer does; "
                          "TransformerLens would prepend one. Pass prepend_bos=True to to_tokens / the forward for "
                          "TransformerLens's tokens (model.cfg.default_prepend_bos is False).", stacklevel=2)
        return model
