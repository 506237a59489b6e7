"""A toy Llama-style (RoPE) model trained on repeated random tokens, where induction heads are studied.

Each training sequence is ``[BOS, x, x]``: ``x`` is ``L`` uniform random tokens and ``L`` is drawn
fresh per batch from U[min_len, max_len]. The first copy is unpredictable (loss about ln(63) with 63
non-special tokens); the second copy is predictable only by looking back to the token after the
earlier occurrence of the current token, which is what an induction head does. A fixed ``L`` would
let the model learn a positional shortcut (attend ``L - 1`` back) instead.

Why RoPE and not GPT-2: with GPT-2's learned absolute positions this recipe found another circuit
(layer-0 heads copy the tokens near ``p / 2`` into position ``p`` and layer 1 matches on that pair;
second-copy loss 0.27 but no previous-token head and layer-1 induction scores near 0.01, over four
seeds and up to 15,500 steps). Rotary positions are relative only, so that shortcut is unavailable and
the textbook circuit forms within 1,000 steps: previous-token heads in layer 0, induction heads in
layer 1 (Olsson et al. 2022).

The recipe follows Olsson et al. 2022's attention-only toy models (2 layers, repeated random tokens), except
that an HF Llama cannot be attention-only: each block keeps a small MLP (``intermediate_size`` 256). The checkpoint is an
ordinary HF folder:

    python -m analyses.data.toy --out interp/models/toy-induction --seed 0 --steps 3000 --threads 1
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from interp.tokens.inputs import fix_permissions

__all__ = ["repeated_sequences", "toy_config", "train_toy_model", "copy_losses", "main"]

BOS_TOKEN_ID = 0
_DEFAULT_STEPS = 3_000


def repeated_sequences(
    batch: int,
    length: int,
    vocab_size: int,
    generator: torch.Generator,
    bos_token_id: int | None = None,
) -> torch.Tensor:
    """Random sequences repeated twice, ``[bos?, x, x]``: (batch, [1 +] 2 * length), int64.

    ``x`` is uniform over the token ids other than ``bos_token_id`` (over all ``vocab_size`` ids when
    it is None). Only ``generator`` is drawn from, so the same generator state gives the same batch.

    >>> t = repeated_sequences(2, 3, 8, torch.Generator().manual_seed(0), bos_token_id=0)
    >>> t.shape, bool((t[:, 1:4] == t[:, 4:7]).all()), bool((t[:, 1:] != 0).all())
    (torch.Size([2, 7]), True, True)
    """
    if length < 1 or batch < 1:
        raise ValueError(f"batch and length must be >= 1; got batch={batch}, length={length}")
    if bos_token_id is not None and not 0 <= bos_token_id < vocab_size:
        raise ValueError(f"bos_token_id must be in [0, {vocab_size}); got {bos_token_id}")
    n_ordinary = vocab_size - (bos_token_id is not None)
    if n_ordinary < 1:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary tokens to draw from")
    x = torch.randint(0, n_ordinary, (batch, length), generator=generator)  # (b, p)
    if bos_token_id is not None:
        x = x + (x >= bos_token_id).long()  # skip over the BOS id
    parts = [x, x]
    if bos_token_id is not None:
        parts.insert(0, torch.full((batch, 1), bos_token_id, dtype=torch.long))
    return torch.cat(parts, dim=1)


def toy_config(
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    vocab_size: int = 64,
    n_positions: int = 72,
    n_inner: int = 256,
    **kwargs,
) -> LlamaConfig:
    """The toy model's ``LlamaConfig``: 2 layers, 4 heads of dim 16, d_model 64, vocab 64, RoPE, no dropout.

    Token 0 is reserved as BOS (also ``eos_token_id``); sequences are ``[BOS, x, x]`` with ``x`` up
    to 32 tokens, so 1 + 2 * 32 = 65 positions must fit in ``n_positions``. An HF Llama cannot be
    attention-only, so each block keeps a small MLP of width ``n_inner``. ``kwargs`` override any
    other ``LlamaConfig`` field.
    """
    fields = dict(
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        hidden_size=n_embd,
        intermediate_size=n_inner,
        vocab_size=vocab_size,
        max_position_embeddings=n_positions,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=BOS_TOKEN_ID,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        rope_theta=10_000.0,
    )
    fields.update(kwargs)
    return LlamaConfig(**fields)


def _copy_losses_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``copy_losses``; logits: (batch, pos, vocab), tokens: (batch, pos)."""
    offset = tokens.shape[1] - 2 * length  # 1 with a BOS, 0 without
    if offset not in (0, 1) or length < 2:
        raise ValueError(
            f"tokens must be [bos?, x, x] with len(x) = length >= 2; got tokens of shape "
            f"{tuple(tokens.shape)} and length={length}"
        )
    # logits[:, p] predicts tokens[:, p + 1]
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), tokens[:, 1:], reduction="none")
    # target positions: first copy offset .. offset+L-1 (the first x_0 only with a BOS before it),
    # second copy offset+L+1 .. offset+2L-1 (x_1 .. x_{L-1}; x_0 of the second copy is not inferable)
    first = nll[:, max(offset - 1, 0) : offset - 1 + length]
    second = nll[:, offset + length : offset - 1 + 2 * length]
    return first.mean(), second.mean()


def copy_losses(
    hf_model: torch.nn.Module, tokens: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy inside the first copy and inside the second copy.

    tokens: (batch, [1 +] 2 * length) built by ``repeated_sequences``. The first-copy loss covers
    every target token of the first ``x`` (unpredictable: about ln(63) for the toy vocab). The
    second-copy loss covers targets ``x_1 .. x_{L-1}`` of the second copy, each predicted from a
    position after its earlier occurrence; ``x_0`` is left out, since nothing says where the
    second copy starts. Returns two 0-dim tensors, differentiable (wrap in ``torch.no_grad()``
    when only the values are wanted).
    """
    logits = hf_model(tokens).logits  # (b, p, vocab)
    return _copy_losses_from_logits(logits, tokens, length)


def _eval_losses(model, seed: int, min_len: int, max_len: int, batch: int = 128) -> tuple[float, float]:
    """Copy losses on a fixed held-out set: ``batch`` sequences at each of min, mid and max length."""
    generator = torch.Generator().manual_seed(seed + 1_000_003)
    firsts, seconds = [], []
    with torch.no_grad():
        for length in sorted({min_len, (min_len + max_len) // 2, max_len}):
            tokens = repeated_sequences(batch, length, model.config.vocab_size, generator, BOS_TOKEN_ID)
            first, second = copy_losses(model, tokens, length)
            firsts.append(first.item())
            seconds.append(second.item())
    return sum(firsts) / len(firsts), sum(seconds) / len(seconds)


def train_toy_model(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = _DEFAULT_STEPS,
    batch_size: int = 64,
    lr: float = 1e-3,
    min_len: int = 8,
    max_len: int = 32,
    log_every: int = 500,
    progress: Callable[[dict], None] | None = None,
    *,
    command: str | None = None,
) -> dict:
    """Train the toy Llama-style model from scratch on ``[BOS, x, x]`` and save it as an HF folder in ``out_dir``.

    Each step draws ``L`` from U[min_len, max_len] and a batch of fresh sequences; the loss is the
    standard causal LM loss over all positions; AdamW with constant ``lr`` and no weight decay.
    Everything is drawn from ``seed`` (weights via ``torch.manual_seed``, data via a
    ``torch.Generator``), so a rerun on the same machine and versions gives the same weights.

    ``progress`` (if given) receives ``{"step", "loss", "loss_first_copy", "loss_second_copy",
    "seconds"}`` every ``log_every`` steps, measured on the training batch. ``out_dir`` gets
    ``config.json``, ``model.safetensors`` and ``TRAINING.md`` (recipe, final losses and
    ``command``, by default the equivalent Python call). Returns the final held-out
    ``loss_first_copy`` and ``loss_second_copy`` with ``steps`` and ``seconds``.
    """
    if not 2 <= min_len <= max_len:
        raise ValueError(f"need 2 <= min_len <= max_len; got min_len={min_len}, max_len={max_len}")
    config = toy_config()
    if 1 + 2 * max_len > config.max_position_embeddings:
        raise ValueError(
            f"max_len={max_len} needs {1 + 2 * max_len} positions; the toy config has "
            f"{config.max_position_embeddings}. Use max_len <= {(config.max_position_embeddings - 1) // 2}"
        )
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    history = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        tokens = repeated_sequences(batch_size, length, config.vocab_size, generator, BOS_TOKEN_ID)
        logits = model(tokens).logits  # (b, p, vocab)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % log_every == 0 or step == steps:
            first, second = _copy_losses_from_logits(logits.detach(), tokens, length)
            record = dict(step=step, loss=loss.item(), loss_first_copy=first.item(),
                          loss_second_copy=second.item(), seconds=time.perf_counter() - start)
            history.append(record)
            if progress is not None:
                progress(record)
    seconds = time.perf_counter() - start

    model.eval()
    loss_first, loss_second = _eval_losses(model, seed, min_len, max_len)
    metrics = dict(loss_first_copy=loss_first, loss_second_copy=loss_second, steps=steps,
                   seconds=seconds)
    hparams = dict(seed=seed, steps=steps, batch_size=batch_size, lr=lr, min_len=min_len,
                   max_len=max_len)
    if command is None:
        args = ", ".join(f"{k}={v!r}" for k, v in hparams.items())
        command = f"train_toy_model({str(out_dir)!r}, {args})"
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    fix_permissions(out_dir)
    (out_dir / "TRAINING.md").write_text(_training_md(config, hparams, metrics, history, command))
    return metrics


def _training_md(config: LlamaConfig, hparams: dict, metrics: dict, history: list, command: str) -> str:
    """The text of TRAINING.md: how the checkpoint was made and how well it copies."""
    rows = "\n".join(
        f"| {r['step']} | {r['loss']:.4f} | {r['loss_first_copy']:.4f} | {r['loss_second_copy']:.4f} |"
        for r in history
    )
    return f"""# Toy induction model

Llama-style, RoPE ({config.num_hidden_layers} layers, {config.num_attention_heads} heads, d_model {config.hidden_size},
MLP {config.intermediate_size}, vocab {config.vocab_size} with token {BOS_TOKEN_ID} as BOS,
max_position_embeddings {config.max_position_embeddings}, dropout 0)
trained from scratch by `analyses/data/toy.py` on `[BOS, x, x]`, x uniform over tokens 1..{config.vocab_size - 1},
len(x) drawn per batch from U[{hparams['min_len']}, {hparams['max_len']}]; causal LM loss on all
positions; AdamW lr {hparams['lr']}, no weight decay, batch {hparams['batch_size']},
{hparams['steps']} steps, seed {hparams['seed']}.

Command (run from the repository root):

    {command}

Trained in {metrics['seconds']:.0f} s on CPU ({torch.get_num_threads()} threads), torch {torch.__version__},
transformers {transformers.__version__}.

Final held-out losses (128 sequences at each of len(x) = {hparams['min_len']},
{(hparams['min_len'] + hparams['max_len']) // 2}, {hparams['max_len']}):

- first copy: {metrics['loss_first_copy']:.4f} (chance: ln({config.vocab_size - 1}) = 4.1431)
- second copy (x_1 .. x_{{L-1}}): {metrics['loss_second_copy']:.4f}

Training log (training batch at each step):

| step | loss | first copy | second copy |
|---:|---:|---:|---:|
{rows}
"""


def main(argv: list[str] | None = None) -> int:
    """``python -m analyses.data.toy --out DIR [--seed S] [--steps N]``: train and save the toy model."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m analyses.data.toy", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to save the HF checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=_DEFAULT_STEPS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def progress(r: dict) -> None:
        print(f"step {r['step']:6d}  loss {r['loss']:.4f}  first {r['loss_first_copy']:.4f}  "
              f"second {r['loss_second_copy']:.4f}  {r['seconds']:.0f}s", file=sys.stderr, flush=True)

    metrics = train_toy_model(args.out, seed=args.seed, steps=args.steps, progress=progress,
                              command="python -m analyses.data.toy " + shlex.join(argv))
    print(f"saved {args.out}: first-copy loss {metrics['loss_first_copy']:.4f}, second-copy loss "
          f"{metrics['loss_second_copy']:.4f}, {metrics['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
