"""Forward-pass cost of interp's attention paths and hooks, against HF's own attention, in one process.

Variants run interleaved (round-robin) on the same weights; the table shows medians and ratios to HF sdpa.

    python benchmarks/bench_forward.py                                   # GPT-2-small shape, 4 x 512, fp32, CPU
    python benchmarks/bench_forward.py --shape gemma2-small               # soft-cap + sliding window vs HF eager
    python benchmarks/bench_forward.py --device cuda --dtype bfloat16 --shape llama-1b --batch 8 --seq 4096
    python benchmarks/bench_forward.py --device cuda --dtype float16 --kernel   # attention kernel alone, TFLOP/s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import interp  # noqa: E402
from interp.attention.kernels import fused_attention  # noqa: E402
from interp.model.loading import resolve_device, resolve_dtype  # noqa: E402

SHAPES = {
    "gpt2-small": dict(family="gpt2", n_layer=12, n_head=12, n_embd=768, vocab_size=50257),
    "llama-small": dict(family="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
    "llama-1b": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    # Gemma 2's attention: logit soft-capping on every layer and a sliding window (shorter than --seq 512) on
    # every other one; HF has no sdpa path for it, so HF eager is the baseline
    "gemma2-small": dict(family="gemma2", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64,
                         sliding_window=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                         vocab_size=32000),
}


def build(shape: str, seq: int, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    positions = {"gpt2": "n_positions"}.get(family, "max_position_embeddings")
    config = AutoConfig.for_model(family, **spec, **{positions: max(1024, seq)})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def has_sdpa(hf) -> bool:
    try:
        hf.set_attn_implementation("sdpa")
    except (ValueError, ImportError):
        return False
    return hf.config._attn_implementation == "sdpa"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def variants(model, ids, has_tl: bool):
    """name -> (prepare, run): prepare switches the attention implementation (not timed), run is one forward.

    All variants share the same HF weights.
    """
    hf = model.hf
    qkvz = lambda n: n.endswith(("hook_q", "hook_k", "hook_v", "hook_z"))  # noqa: E731

    def hf_run(impl, **kw):
        return (lambda: hf.set_attn_implementation(impl)), (lambda: hf(input_ids=ids, use_cache=False, **kw))

    def ours(attn, names=None):
        run = (lambda: model.run_with_cache(ids, names=names)[1]) if names else (lambda: model(ids))
        return (lambda: model.set_attn(attn)), run

    table = {"HF sdpa": hf_run("sdpa")} if has_sdpa(hf) else {}
    table |= {
        "HF eager": hf_run("eager"),
        "HF eager + output_attentions": hf_run("eager", output_attentions=True),
        "ours flash (no hooks)": ours("flash"),
        "ours flash, capture q,k,v,z all layers": ours("flash", names=qkvz),
        "ours eager, capture patterns": ours("eager", names=lambda n: n.endswith("hook_pattern")),
    }
    if has_tl:
        name, row = transformer_lens_row(hf, ids)
        if name is None:
            print(f"# no TransformerLens row: {row}")
        else:
            table[name] = row
    return table


def transformer_lens_row(hf, ids):
    """(row name, (prepare, run)) for the TransformerLens installed, or (None, why the row is left out).

    3.x: ``HookedTransformer.from_pretrained_no_processing``; 4.x removed it: its ``TransformerBridge``, which wraps
    the same HF model (raw weights, no folding: the like of 3.x's no_processing) and forces eager attention.
    """
    import transformer_lens

    version = getattr(transformer_lens, "__version__", "?")
    if hasattr(transformer_lens, "HookedTransformer"):
        tl = transformer_lens.HookedTransformer.from_pretrained_no_processing("gpt2", hf_model=hf, device=ids.device)
        return "TransformerLens run_with_cache", (lambda: None, lambda: tl.run_with_cache(ids))
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None, (f"TransformerLens {version} has neither HookedTransformer (3.x) nor "
                      "model_bridge.TransformerBridge (4.x)")
    try:
        bridge = TransformerBridge.boot_transformers("gpt2", hf_model=hf, device=ids.device)
    except Exception as e:  # noqa: BLE001 - e.g. offline: the bridge fetches gpt2's tokenizer; the rest still runs
        return None, f"TransformerLens {version}'s TransformerBridge could not wrap the model ({type(e).__name__}: {e})"
    return "TransformerLens bridge run_with_cache", (lambda: hf.set_attn_implementation("eager"),
                                                     lambda: bridge.run_with_cache(ids))


def bench_forward(args) -> None:
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype) or torch.float32
    hf = build(args.shape, args.seq, device, dtype)
    model = interp.load_model(hf, attn="flash")
    ids = torch.randint(0, hf.config.vocab_size, (args.batch, args.seq), device=device)
    try:
        import transformer_lens  # noqa: F401
        has_tl = args.shape == "gpt2-small"
    except ImportError:
        has_tl = False
    table = variants(model, ids, has_tl)
    times = {name: [] for name in table}
    with torch.no_grad():
        for name, (prepare, run) in table.items():  # warm-up
            prepare()
            run()
        for _ in range(args.repeats):
            for name, (prepare, run) in table.items():
                prepare()
                sync(device)
                t0 = time.perf_counter()
                out = run()
                sync(device)
                times[name].append(time.perf_counter() - t0)
                del out
    reference = "HF sdpa" if "HF sdpa" in times else "HF eager"  # Gemma 2 has no sdpa path in HF
    base = statistics.median(times[reference])
    print(f"# {args.shape}, batch {args.batch} x {args.seq}, {str(dtype).removeprefix('torch.')}, {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats (median)")
    print(f"| variant | median ms | x {reference} |\n|---|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f} |")
    eager_attn = statistics.median(times["HF eager + output_attentions"])
    ours_eager = statistics.median(times["ours eager, capture patterns"])
    print(f"\nours eager capturing patterns / HF eager + output_attentions: {ours_eager / eager_attn:.3f}")


def bench_kernel(args) -> None:
    """Achieved TFLOP/s of the flash path's kernel alone (forward: 4 * b * h * n^2 * d, halved if causal)."""
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype) or torch.float16
    print(f"# attention kernel alone, {str(dtype).removeprefix('torch.')}, {device}, torch {torch.__version__}")
    print("| seq | head dim | causal | ms | TFLOP/s |\n|---:|---:|---|---:|---:|")
    for d in (64, 128):
        heads = 2048 // d
        batch = args.kernel_batch or max(1, 16384 // args.kernel_seq)
        q, k, v = (torch.randn(batch, heads, args.kernel_seq, d, device=device, dtype=dtype) for _ in range(3))
        for causal in (False, True):
            run = lambda: fused_attention(q, k, v, None, d**-0.5, 0.0, causal)  # noqa: E731
            run()
            ts = []
            for _ in range(args.repeats):
                sync(device)
                t0 = time.perf_counter()
                run()
                sync(device)
                ts.append(time.perf_counter() - t0)
            sec = statistics.median(ts)
            flop = 4 * batch * heads * args.kernel_seq**2 * d / (2 if causal else 1)
            print(f"| {args.kernel_seq} | {d} | {causal} | {sec * 1e3:.2f} | {flop / sec / 1e12:.1f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (default for the forward), bfloat16, float16")
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-small")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--kernel", action="store_true", help="time the attention kernel alone instead")
    p.add_argument("--kernel-seq", type=int, default=16384)
    p.add_argument("--kernel-batch", type=int, default=None, help="default: 16384 // --kernel-seq, at least 1")
    args = p.parse_args(argv)
    if args.threads:
        interp.set_threads(args.threads)
    bench_kernel(args) if args.kernel else bench_forward(args)


if __name__ == "__main__":
    main()
