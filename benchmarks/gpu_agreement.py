"""The device against the CPU on what landed after the GPU suite was first written (issue 51): norm-weighted head
statistics (issue 50: within 1e-4 of the CPU's in fp32) and EAP-IG edge attribution (issue 48: within 1e-3 relative
in fp32; its time in fp32 and bf16). Each is computed from the same random weights on ``--device`` and on the CPU.

    python benchmarks/gpu_agreement.py --device cuda               # on the GPU machine (gpu_suite.py --part 4)
    python benchmarks/gpu_agreement.py --device cpu --quick        # the rehearsal (tests/test_gpu_suite.py)

Random weights of a shape (``bench_forward.SHAPES``, or a tiny Llama with ``--quick``): agreement and time depend on
the shape and the arithmetic, not on what the weights learned. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import interp  # noqa: E402
from analyses import detect_heads, edge_attribution, logit_difference  # noqa: E402
from bench_forward import SHAPES, build  # noqa: E402

TINY = dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)


def _model(shape: str, seq: int, device: str, dtype: torch.dtype):
    if shape == "tiny":
        SHAPES.setdefault("tiny", TINY)
    return interp.load_model(build(shape, seq, torch.device(device), dtype), attn="flash")


def _timed(fn, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def norm_weighted(shape: str, seq: int, device: str) -> tuple[float, float, float]:
    """(largest |device - CPU| over every head's norm-weighted induction and sink score, device s, CPU s), fp32."""
    def scores(dev):
        model = _model(shape, seq, dev, torch.float32)
        return _timed(lambda: detect_heads(model, scores=["induction", "sink"], weighting="norm", seq_len=seq,
                                           n_prompts=4, n_bootstrap=10), dev)
    (ours, t_dev), (ref, t_cpu) = scores(device), scores("cpu")
    cols = ["induction", "sink"]
    return float((ours[cols].to_numpy() - ref[cols].to_numpy()).__abs__().max()), t_dev, t_cpu


def eap_ig(shape: str, seq: int, batch: int, steps: int, device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(max |device - CPU fp32| / max |CPU fp32| over every edge's EAP-IG score, device seconds)."""
    g = torch.Generator().manual_seed(0)
    vocab = (TINY if shape == "tiny" else SHAPES[shape])["vocab_size"]
    clean = torch.randint(3, vocab, (batch, seq), generator=g)
    corrupted = clean.clone()
    corrupted[:, seq // 2] = torch.randint(3, vocab, (batch,), generator=g)  # one token changed, as IOI's names are
    metric = logit_difference(1, 2)

    def run(dev, dt):
        model = _model(shape, seq, dev, dt)
        return _timed(lambda: edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=steps), dev)
    (ours, seconds), (ref, _) = run(device, dtype), run("cpu", torch.float32)
    diff = (ours["score"].to_numpy() - ref["score"].to_numpy())
    return float(abs(diff).max() / abs(ref["score"].to_numpy()).max()), seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="a tiny Llama and short prompts: seconds on the CPU")
    p.add_argument("--shape", default=None, help="bench_forward's shapes (default llama-small; tiny with --quick)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_agreement: --device cuda but torch sees no CUDA device; use --device cpu --quick to rehearse",
              file=sys.stderr)
        return 2
    shape = args.shape or ("tiny" if args.quick else "llama-small")
    seq, batch, steps = (32, 2, 3) if args.quick else (256, 8, 5)
    gap, t_dev, t_cpu = norm_weighted(shape, seq, args.device)
    print(f"| check ({shape}, {args.device}) | value | target | seconds on the device | seconds on the CPU |")
    print("|---|---:|---|---:|---:|")
    print(f"| norm-weighted induction and sink scores, fp32: max abs difference | {gap:.2e} | <= 1e-4 | "
          f"{t_dev:.2f} | {t_cpu:.2f} |")
    for dtype in (torch.float32, torch.bfloat16):
        rel, seconds = eap_ig(shape, seq, batch, steps, args.device, dtype)
        target = "<= 1e-3" if dtype == torch.float32 else "(bf16: reported)"
        print(f"| EAP-IG ({steps} steps, {batch} x {seq}), {str(dtype).split('.')[-1]}: max relative difference "
              f"| {rel:.2e} | {target} | {seconds:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
