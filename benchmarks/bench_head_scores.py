"""Head scores at long context: flash (q, k, logsumexp; O(n) memory) vs eager (n x n patterns), and batching.

A Llama-shaped random model (4 layers, 8 heads on 2 KV heads, d_model 512, vocab 32000) scores every head on
one repeated-random-token prompt of 1k, 4k and 16k tokens. Each case runs in a fresh subprocess so its peak
memory is its own: on CPU the child's peak RSS (``os.wait4``'s ``ru_maxrss``) under an address-space limit
(``RLIMIT_AS``), so that running out of memory is a clean error in the child and nothing else; on CUDA
``torch.cuda.max_memory_allocated``. Cases:

- ``forward``: the model's plain forward (flash path, logits included), no hooks;
- ``base``: the same without the LM head (the transformer body only);
- ``flash`` / ``eager``: ``detect_heads`` on that attention path (it stops after the last attention layer).

Then ``detect_heads`` on 100 prompts of 64 tokens, batched (100 per forward) vs one prompt per forward.

    python benchmarks/bench_head_scores.py                       # CPU, float32
    python benchmarks/bench_head_scores.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback

GIB = 1024**3
CASES = ("forward", "base", "flash", "eager")


SHAPES = {  # Llama-shaped random models: the CPU target's small one, and Llama-3.2-1B's shape for GPUs
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8),
    # Gemma 3 270M's shape (random weights): 18 layers x 4 heads on 1 KV head, head dim 256, a sliding window of
    # 512 on 5 layers of 6, q/k norms, a 262,144-token vocabulary
    "gemma3-270m": dict(family="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=512, vocab_size=262144, rope_theta=1e6),
}
SHAPE = "small"  # set from --shape in main() and passed on to each child


def build_model(device: str, dtype: str, max_len: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import interp

    torch.manual_seed(0)
    spec = dict(SHAPES[SHAPE])
    family = spec.pop("family", None)
    if family is None:
        config = LlamaConfig(**spec, vocab_size=32000, max_position_embeddings=max(16384, max_len))
        hf = LlamaForCausalLM(config).eval()
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(family, **spec, max_position_embeddings=max(32768, max_len))
        hf = AutoModelForCausalLM.from_config(config).eval()
    return interp.load_model(hf, attn="flash", device=device, dtype=dtype)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(case: str, n: int, device: str, dtype: str) -> dict:
    """One case in this (fresh) process: seconds, and on CUDA the peak allocated bytes."""
    import torch

    from analyses.heads.detect import detect_heads
    from analyses.data.prompts import repeated_random_tokens

    model = build_model(device, dtype, n)
    ids = torch.stack(repeated_random_tokens(model, 1, n, torch.Generator().manual_seed(0))).to(model.device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with torch.no_grad():
        if case == "forward":
            model(ids)
        elif case == "base":
            model.hf.model(input_ids=ids, use_cache=False)
        else:
            detect_heads(model.set_attn(case), n_prompts=1, seq_len=n, batch_size=1)
    _sync(device)
    out = {"seconds": time.perf_counter() - start, "baseline_bytes": before}
    if device.startswith("cuda"):
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def child_main(args) -> None:
    import torch

    import interp

    interp.set_threads(args.threads)
    if args.as_limit_gib and not args.device.startswith("cuda"):
        limit = int(args.as_limit_gib * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = run_case(args.child, args.n, args.device, args.dtype)
    except (RuntimeError, MemoryError) as err:  # torch reports a failed allocation as RuntimeError
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "/interp/" in f.filename
                  or "/analyses/" in f.filename or "/transformers/" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        message = str(err).splitlines()[0]
        asked = re.search(r"allocate (\d+) bytes", message)
        if asked:
            message = f"could not allocate {int(asked.group(1)) / GIB:.2f} GiB"
        result = {"error": message[:160], "where": where}
    print("RESULT " + json.dumps(result), flush=True)


def spawn(case: str, n: int, args) -> dict:
    """Run one case in a fresh interpreter; its peak RSS is the child's own, from os.wait4's rusage."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--n", str(n), "--device", args.device,
           "--dtype", args.dtype, "--threads", str(args.threads), "--as-limit-gib", str(args.as_limit_gib),
           "--shape", args.shape]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        err.seek(0)
        stderr = err.read().strip()
    result = next((json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        result = {"error": f"child exited with {proc.returncode}: {stderr.splitlines()[-1][:160] if stderr else ''}"}
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024  # KiB on Linux
    return result


def build_small_model(device: str, dtype: str):
    """A random GPT-2 of the toy model's shape (2 layers, 4 heads, d_model 64, vocab 64, 72 positions)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import interp

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_inner=256, vocab_size=64, n_positions=72, bos_token_id=0,
                        eos_token_id=0)
    return interp.load_model(GPT2LMHeadModel(config).eval(), attn="flash", device=device, dtype=dtype)


def batched_vs_single(model, args) -> dict:
    """detect_heads on n_prompts prompts of prompt_len tokens: all in one batch vs one prompt per forward."""
    from analyses.heads.detect import detect_heads

    kwargs = dict(n_prompts=args.n_prompts, seq_len=args.prompt_len)
    detect_heads(model, n_prompts=4, seq_len=args.prompt_len)  # warm-up
    out, frames = {}, {}
    for name, batch in (("batched", args.n_prompts), ("single", 1)):
        _sync(args.device)
        start = time.perf_counter()
        frames[name] = detect_heads(model, batch_size=batch, **kwargs).select_dtypes("number")
        _sync(args.device)
        out[name] = time.perf_counter() - start
    out["max_abs_diff"] = float((frames["batched"] - frames["single"]).abs().max().max())
    return out


def _fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small",
                   help="small: 4 layers, 8 heads, 2 KV heads, d_model 512; llama-1b: 16 x 32 heads, 8 KV, 2048; "
                        "gemma3-270m: Gemma 3 270M's shape "
                        "(on CUDA: --shape llama-1b --dtype bfloat16 --lengths 8192 32768 131072)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--as-limit-gib", type=float, default=12.0, help="CPU only: address-space limit per case")
    p.add_argument("--n-prompts", type=int, default=100)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global SHAPE
    SHAPE = args.shape
    if args.child:
        child_main(args)
        return 0

    cuda = args.device.startswith("cuda")
    print(f"# bench_head_scores: device={args.device} dtype={args.dtype} threads={args.threads} "
          f"load average at start {os.getloadavg()[0]:.1f}" + ("" if cuda else f", RLIMIT_AS {args.as_limit_gib:g} GiB per case"))
    results = {}
    for n in args.lengths:
        for case in CASES:
            results[n, case] = r = spawn(case, n, args)
            print(f"  n={n:>6} {case:<8} " + (f"{r['seconds']:.2f} s" if "seconds" in r else f"FAILED {r}"), flush=True)

    peak_key = "cuda_peak_bytes" if cuda else "peak_rss_bytes"
    print()
    print(f"| tokens | case | time (s) | peak {'CUDA allocated' if cuda else 'RSS'} (GiB) | note |")
    print("|---:|---|---:|---:|---|")
    for (n, case), r in results.items():
        oom = "error" in r and ("alloc" in r["error"] or "memory" in r["error"])
        note = (f"out of memory at {r.get('where', '?')}: {r['error']}" if oom else
                f"failed at {r.get('where', '?')}: {r['error']}" if "error" in r else "")
        seconds = f"{r['seconds']:.2f}" if "seconds" in r else "-"
        peak = r.get(peak_key) if "error" not in r or not cuda else None
        print(f"| {n} | {case} | {seconds} | {_fmt_bytes(peak)} | {note} |")

    print()
    print("| tokens | flash peak - forward peak (GiB) | flash peak - base peak (GiB) | eager / flash time | "
          "flash extra over baseline (GiB) |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.lengths:
        f, fw, base, e = (results[n, c] for c in ("flash", "forward", "base", "eager"))
        ok = lambda r: "error" not in r  # noqa: E731
        d_fw = f"{(f[peak_key] - fw[peak_key]) / GIB:+.2f}" if ok(f) and ok(fw) else "-"
        d_base = f"{(f[peak_key] - base[peak_key]) / GIB:+.2f}" if ok(f) and ok(base) else "-"
        ratio = f"{e['seconds'] / f['seconds']:.2f}" if ok(f) and ok(e) else "eager failed"
        extra = f"{(f[peak_key] - f['baseline_bytes']) / GIB:.3f}" if ok(f) and not cuda else (
            f"{f[peak_key] / GIB:.3f}" if ok(f) else "-")
        print(f"| {n} | {d_fw} | {d_base} | {ratio} | {extra} |")

    if args.n_prompts:
        import torch

        import interp

        interp.set_threads(args.threads)
        print()
        print(f"detect_heads on {args.n_prompts} prompts of {args.prompt_len} tokens (flash path):")
        print()
        print("| model | batched (s) | one prompt per forward (s) | speed-up | max abs diff of scores |")
        print("|---|---:|---:|---:|---:|")
        for name, build in ((f"Llama-shaped ({args.shape})", lambda: build_model(args.device, args.dtype, 64)),
                            ("toy-shaped GPT-2, d_model 64", lambda: build_small_model(args.device, args.dtype))):
            b = batched_vs_single(build(), args)
            print(f"| {name} | {b['batched']:.2f} | {b['single']:.2f} | {b['single'] / b['batched']:.1f}x | "
                  f"{b['max_abs_diff']:.1e} |", flush=True)
    print(f"# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
