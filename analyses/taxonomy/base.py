"""What the literature's head classes share (``analyses.taxonomy.weights``, ``taxonomy_ioi``, ``function_vectors``, and
``detect_heads``'s dispatch): the refusals for models they cannot read (several stacks; no next-token logits) and
the check of copy suppression's k. It sits below those modules, so none of them imports another back. Their
intervals come from ``analyses.data.bootstrap``."""

from __future__ import annotations

from interp.attention.sites import is_layered

__all__ = ["refuse_stacks", "refuse_non_lm", "check_k"]


def refuse_stacks(model, what: str) -> None:
    """A clear refusal for models with several stacks (encoder-decoder): these scores need one residual stream."""
    if not is_layered(model):
        raise TypeError(f"{what} reads one residual stream and its unembedding; an encoder-decoder model has two "
                        "stacks. Compute it on a decoder-only model, or use the attention-pattern scores "
                        "(detect_heads's defaults), which work per (site, head).")


def refuse_non_lm(model, what: str) -> None:
    """A clear refusal for models whose next-token logits these scores read and that have none: several stacks
    (``refuse_stacks``), an encoder (bidirectional: BERT, MiniLM), or no output layer or final norm."""
    refuse_stacks(model, what)
    has_head, has_norm = model.hf.get_output_embeddings() is not None, model.structure.final_norm is not None
    if model.cfg.causal and has_head and has_norm:
        return
    why = ("is an encoder (bidirectional attention, as BERT and MiniLM): it predicts no next token"
           if not model.cfg.causal else "has no output layer (unembedding)" if not has_head
           else "has no final norm before its output layer")
    raise TypeError(f"{what} reads next-token logits through the unembedding, and this model {why}. Compute it "
                    "on a causal language model (decoder-only, with its LM head), or use the attention-pattern "
                    "scores (detect_heads's defaults), which every model has.")


def check_k(model, k) -> None:
    """k (copy suppression's top-k): a positive integer below the vocabulary size, where a token among the k
    extreme logits still says something."""
    vocab = model.cfg.vocab_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer; got {k!r}.")
    if k >= vocab:
        raise ValueError(f"k must be less than the vocabulary's {vocab} tokens: with k >= {vocab} every token is "
                         f"among the k extreme logits and every head would count every token; got {k}.")

