"""Structural head pruning speed, and the batched ablation scan against one head per forward.

Pruning: MiniLM (6 layers x 12 heads) and a GPT-2-small-shaped random model (12 layers x 12 heads, d_model
768, the transformer body without the LM head), each with 50% of its heads removed by ``prune_model``
against the unpruned model, at batch 1 and 16 (128 tokens, flash path). Timings are interleaved in one
process (unpruned, pruned, unpruned, ... with the order alternating) and the median is reported; the
speedup is throughput gained, ``t_unpruned / t_pruned - 1`` (Michel et al. 2019 report +17.5% at batch 16
and +1.9% at batch 1 for BERT-base on a GPU).

MiniLM loses the 36 heads its importance ranks lowest on the project's sentences (``head_importance`` with
``embedding_similarity``, never a layer's last head); the random GPT-2 loses heads 6..11 of every layer.

Scan: ``ablation_scan`` over every head, one head per forward (``heads_per_forward=1``) against the default
memory budget (copies of the batch per forward; 16 MiB on CPU, 1 GiB on CUDA) and against every head in a
single forward, on the toy model (8 heads) with 1 and 16 repeated sequences and on MiniLM (72 heads) with 8
and 64 of the project's sentences. Median of 3 runs each (1 for the MiniLM cases).

    python benchmarks/bench_pruning.py                        # CPU, float32
    python benchmarks/bench_pruning.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import interp
from analyses import ablation_scan, embedding_similarity, head_importance, prune_model, second_copy_loss
from analyses.causal import engine
from analyses.causal.ablation import all_heads
from analyses.data.batches import batch_of
from analyses.data.toy import repeated_sequences

SENTENCES = Path(__file__).resolve().parents[1] / "analyses" / "data" / "sentences.txt"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _sentences() -> list[str]:
    return [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]


def _gpt2_body(device, dtype):
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257)
    model = interp.load_model(GPT2Model(config).eval(), device=device, dtype=dtype)
    return model, [(l, h) for l in range(12) for h in range(6, 12)]


def _minilm(device, dtype):
    model = interp.load_model("minilm", device=device, dtype=dtype)
    inputs = model.to_batch(_sentences())
    imp = head_importance(model, inputs, embedding_similarity(model, inputs))
    imp = imp.sort_values(["importance", "layer", "head"])
    left = dict.fromkeys(range(model.cfg.n_layers), model.cfg.n_heads)
    drop = []
    for l, h in zip(imp["layer"], imp["head"]):
        if len(drop) == len(imp) // 2:
            break
        if left[l] > 1:
            drop.append((int(l), int(h)))
            left[l] -= 1
    return model, drop


def _time_pair(a, b, ids, device, reps: int) -> tuple[float, float]:
    """Median seconds of a(ids) and b(ids), interleaved, after one warm-up each."""
    times = {0: [], 1: []}
    with torch.inference_mode():
        for fn in (a, b):
            fn(ids)
        for rep in range(reps):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for i in order:
                _sync(device)
                start = time.perf_counter()
                (a, b)[i](ids)
                _sync(device)
                times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def bench_pruning(device, dtype, reps: int, seq: int) -> list[dict]:
    rows = []
    for name, build in (("MiniLM", _minilm), ("GPT-2-small body (random)", _gpt2_body)):
        model, drop = build(device, dtype)
        pruned = prune_model(model, drop)
        n_full = sum(p.numel() for p in model.hf.parameters())
        n_pruned = sum(p.numel() for p in pruned.hf.parameters())
        vocab = model.cfg.vocab_size
        for batch in (1, 16):
            ids = torch.randint(1000, vocab - 1, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
            full_s, pruned_s = _time_pair(model, pruned, ids, device, reps)
            rows.append({"model": name, "batch": batch, "heads": f"{len(all_heads(pruned))}/{len(all_heads(model))}",
                         "params": f"{n_pruned / 1e6:.1f}M/{n_full / 1e6:.1f}M", "unpruned_ms": 1e3 * full_s,
                         "pruned_ms": 1e3 * pruned_s, "speedup": full_s / pruned_s - 1})
            print(_fmt_prune(rows[-1]), flush=True)
        del model, pruned
    return rows


def _timed_scan(model, inputs, metric, device, **kwargs) -> float:
    _sync(device)
    start = time.perf_counter()
    ablation_scan(model, inputs, metric, **kwargs)
    _sync(device)
    return time.perf_counter() - start


def bench_scan(device, dtype) -> list[dict]:
    cases = []
    toy = interp.load_model("toy-induction", device=device, dtype=dtype)
    for n in (1, 16):
        tokens = repeated_sequences(n, 20, toy.cfg.vocab_size, torch.Generator().manual_seed(0), bos_token_id=0)
        cases.append((f"toy, {n} x 41 tokens", toy, {"input_ids": tokens.to(device)}, second_copy_loss, 3))
    minilm = interp.load_model("minilm", device=device, dtype=dtype)
    for n in (8, 64):
        inputs = minilm.to_batch(_sentences()[:n])
        cases.append((f"MiniLM, {n} sentences", minilm, inputs, embedding_similarity(minilm, inputs), 1))
    rows = []
    for name, model, inputs, metric, reps in cases:
        n_heads = len(all_heads(model))
        _timed_scan(model, inputs, metric, device, heads=all_heads(model)[:2])  # warm-up
        times = {}
        for label, per_forward in (("one", 1), ("default", None), ("all", n_heads)):
            times[label] = statistics.median(
                _timed_scan(model, inputs, metric, device, heads_per_forward=per_forward) for _ in range(reps))
        copies = engine.copies_per_forward(model, batch_of(model, inputs), None)
        rows.append({"case": name, "heads": n_heads, "default_copies": min(copies, n_heads),
                     "one_per_forward_s": times["one"], "default_s": times["default"], "all_in_one_s": times["all"]})
        print(_fmt_scan(rows[-1]), flush=True)
    return rows


def _fmt_prune(r: dict) -> str:
    return (f"| {r['model']} | {r['batch']} | {r['heads']} | {r['params']} | {r['unpruned_ms']:.1f} | "
            f"{r['pruned_ms']:.1f} | {100 * r['speedup']:+.1f}% |")


def _fmt_scan(r: dict) -> str:
    one = r["one_per_forward_s"]
    return (f"| {r['case']} | {r['heads']} | {one:.3f} | {r['default_copies']} | {r['default_s']:.3f} "
            f"({one / r['default_s']:.2f}x) | {r['all_in_one_s']:.3f} ({one / r['all_in_one_s']:.2f}x) |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    parser.add_argument("--reps", type=int, default=7, help="timed forwards per model and batch size (default 7)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence for the pruning timings")
    parser.add_argument("--skip-scan", action="store_true", help="only the pruning timings")
    args = parser.parse_args(argv)
    device = interp.model.loading.resolve_device(args.device)
    dtype = interp.model.loading.resolve_dtype(args.dtype)
    print(f"torch {torch.__version__}, device {device}, dtype {dtype}, threads {torch.get_num_threads()}")
    print(f"\nPruning 50% of heads, {args.seq} tokens, median of {args.reps} interleaved forwards (flash path)\n")
    print("| model | batch | heads | params | unpruned ms | pruned ms | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    bench_pruning(device, dtype, args.reps, args.seq)
    if not args.skip_scan:
        print("\nFull ablation scan (zero ablation, every head), seconds (speedup over one head per forward)\n")
        print("| case | heads | one head per forward | default copies per forward | default budget | "
              "all heads in one forward |")
        print("|---|---:|---:|---:|---:|---:|")
        bench_scan(device, dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
