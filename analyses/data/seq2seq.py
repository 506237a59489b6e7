"""Encoder-decoder models (a ``HookedModel`` with encoder and decoder sites, ``is_seq2seq``): their batches and
tasks.

Their heads are scored by ``detect_heads`` like every model's, over one pass across the sites: the encoder's
self-attention heads as a bidirectional model's (with next-token), the decoder's as a causal model's, and the
cross-attention heads (decoder queries on the encoder's output) with the registry's cross-attention scores
(``alignment``, ``source_sink``, ``source_positional``; ``analyses.heads.registry``). On the copy task here (the decoder
reproduces the source, teacher-forced: target i is source i) alignment is the weight on the token being copied.

The circuit studies (ablation, patching, attribution, importance, pruning curves) are the same functions on every
model (``analyses.ablation_scan`` ...; heads are ``(site, head)``, ``interp.attention.sites``); the teacher-forced metrics
are ``analyses.data.metrics.target_loss`` and ``target_accuracy``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["copy_accuracy", "copy_patching_task", "copy_study_inputs", "copy_task", "is_seq2seq", "pair_batch",
           "train_copy_model"]


def is_seq2seq(model) -> bool:
    """Whether a model (or the cache of its run) has an encoder and a decoder stack: data on its sites, not its
    class (every model is an ``interp.HookedModel``)."""
    cfg = getattr(model, "cfg", None)
    sites = cfg.sites if cfg is not None else getattr(model, "sites", ())
    return {"encoder", "decoder"} <= {getattr(s, "stack", None) for s in sites}


def pair_batch(model, inputs) -> dict:
    """``{"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask"}`` (masks None where there is
    no padding) from a ``(source, target)`` pair (texts or token ids; the target is fed shifted right behind the
    decoder's start token, teacher-forced, ``model.decoder_inputs``) or a batch dict with ``input_ids`` and
    ``decoder_input_ids`` (or ``labels``, shifted)."""
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs or not {"decoder_input_ids", "labels"} & set(inputs):
            raise ValueError(f"A batch for an encoder-decoder view needs input_ids and decoder_input_ids (or labels); "
                             f"got keys {sorted(inputs)}.")
        src, src_mask = model._ids(inputs["input_ids"], inputs.get("attention_mask"), "input_ids")
        if "decoder_input_ids" in inputs:
            tgt, tgt_mask = model._ids(inputs["decoder_input_ids"], inputs.get("decoder_attention_mask"),
                                       "decoder_input_ids")
            return {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt,
                    "decoder_attention_mask": tgt_mask}
        labels, labels_mask = model._ids(inputs["labels"], inputs.get("decoder_attention_mask"), "labels")
    elif isinstance(inputs, (tuple, list)) and len(inputs) == 2:
        src, src_mask = model._ids(inputs[0], None, "input_ids")  # text is tokenized, padded on the right
        labels, labels_mask = model._ids(inputs[1], None, "labels")
    else:
        raise ValueError("An encoder-decoder view needs a source and a target: pass (source, target) (texts or token "
                         "ids) or a batch dict with input_ids and decoder_input_ids; got "
                         f"{'nothing' if inputs is None else type(inputs).__name__}.")
    tgt_mask = None if labels_mask is None else torch.cat([torch.ones_like(labels_mask[:, :1]), labels_mask[:, :-1]], 1)
    return {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": model.decoder_inputs(labels),
            "decoder_attention_mask": tgt_mask}


def copy_task(model, n: int = 64, length: int = 10, seed: int = 0) -> dict:
    """Random source sequences and their teacher-forced copy: ``{"input_ids", "attention_mask",
    "decoder_input_ids", "labels"}`` where the labels are the source (the decoder must reproduce it)."""
    generator = torch.Generator().manual_seed(seed)
    special = {getattr(model.hf.config, a, None) for a in ("pad_token_id", "eos_token_id", "bos_token_id",
                                                             "decoder_start_token_id")}
    pool = torch.tensor([t for t in range(model.cfg.vocab_size) if t not in special])
    if len(pool) < 2:
        raise ValueError(f"copy_task needs at least 2 ordinary tokens; the vocabulary has {len(pool)}.")
    source = pool[torch.randint(len(pool), (n, length), generator=generator)].to(model.device)
    return {"input_ids": source, "attention_mask": torch.ones_like(source),
            "decoder_input_ids": model.decoder_inputs(source), "labels": source}


def copy_patching_task(model, n: int = 16, length: int = 10, seed: int = 0, fraction: float = 0.5):
    """``(clean, corrupted, metric)`` for patching on the copy task: ``copy_task`` pairs (clean); the same pairs with
    the first ``fraction`` of each source replaced by other ordinary tokens (corrupted; the targets stay the clean
    ones); the metric is the teacher-forced loss of the clean targets (``target_loss``). The corruption reaches the
    encoder and the cross-attention, never the decoder's self-attention before its first cross-attention."""
    from .metrics import target_loss

    clean = copy_task(model, n, length, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    special = {getattr(model.hf.config, a, None) for a in ("pad_token_id", "eos_token_id", "bos_token_id",
                                                             "decoder_start_token_id")}
    pool = torch.tensor([t for t in range(model.cfg.vocab_size) if t not in special], device=clean["input_ids"].device)
    k = max(1, round(fraction * length))
    source = clean["input_ids"].clone()
    shift = torch.randint(1, len(pool), (n, k), generator=generator).to(source.device)  # never the clean token
    where = torch.searchsorted(pool, source[:, :k].contiguous())
    source[:, :k] = pool[(where + shift) % len(pool)]
    return clean, {**clean, "input_ids": source}, target_loss(labels=clean["labels"])


COPY_LENGTH = 10  # tokens of a copy-task source where a report or the CLI picks the task


def copy_study_inputs(model, prompts: list | None = None, n: int = 16, seed: int = 0):
    """``(batch, metric, description)`` for the studies of an encoder-decoder model: ``n`` copy-task pairs of random
    tokens, or the given texts (or token-id lists) as both source and target (what a denoising model such as BART was
    trained to do); the metric is the teacher-forced loss of the targets (``target_loss``)."""
    from interp.tokens.inputs import pad_ids

    from .metrics import target_loss

    if prompts is None:
        return (copy_task(model, n, COPY_LENGTH, seed), target_loss(),
                f"{n} copy-task pairs of {COPY_LENGTH} random tokens (the target is the source), teacher-forced")
    if all(isinstance(p, str) for p in prompts):
        source = model.to_batch(list(prompts[:n]))
    else:
        ids, mask = pad_ids([torch.as_tensor(p) for p in prompts[:n]], left=False, pad_id=model.pad_token_id)
        source = {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}
    labels = source["input_ids"].masked_fill(source["attention_mask"] == 0, -100)
    batch = {**source, "decoder_input_ids": model.decoder_inputs(labels), "labels": labels,
             "decoder_attention_mask": torch.cat([torch.ones_like(source["attention_mask"][:, :1]),
                                                  source["attention_mask"][:, :-1]], 1)}
    return batch, target_loss(), f"{len(labels)} given prompts, each copied (source = target), teacher-forced"


def copy_accuracy(model, batch: dict) -> float:
    """Fraction of target tokens predicted right (argmax) with teacher forcing."""
    with model.studying(), torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=batch["decoder_input_ids"]).logits
    return float((logits.argmax(-1) == batch["labels"]).float().mean())


def train_copy_model(steps: int = 400, seed: int = 0, length: int = 10, vocab: int = 24, d_model: int = 64,
                     n_heads: int = 4, batch_size: int = 64, lr: float = 3e-3, attn: str = "flash"):
    """A 1 + 1-layer BART-style encoder-decoder trained here to copy random sequences (learned positions, no
    shortcuts): returns the HookedModel. About 10-30 s on a 2-core CPU with the defaults."""
    from transformers import BartConfig, BartForConditionalGeneration

    import interp

    config = BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=n_heads, decoder_attention_heads=n_heads,
                        encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model, max_position_embeddings=2 * length + 4,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, scale_embedding=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = BartForConditionalGeneration(config)
        model = interp.load_model(hf, attn=attn)
        optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
        hf.train()
        for step in range(steps):
            batch = copy_task(model, batch_size, length, seed=seed * 100_003 + step + 1)
            loss = hf(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"],
                      labels=batch["labels"], use_cache=False).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        hf.eval()
    return model

