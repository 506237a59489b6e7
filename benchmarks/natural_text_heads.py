"""Induction and duplicate-token heads on natural text against repeated random tokens (issue 38): per model, how
many rows of the corpus prompts have a target at each length, each head's four scores (random-token and corpus
induction and duplicate-token, with intervals) and the share of each head's top-1 attention that falls on the
bigram-induction target (the token right after an earlier occurrence of the query's token) on ordinary passages.

    OMP_NUM_THREADS=1 python benchmarks/natural_text_heads.py --model smollm2 --threads 1 --seq-len 64 256
    OMP_NUM_THREADS=1 python benchmarks/natural_text_heads.py --model gemma3 --defaults
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import interp
from analyses import detect_heads
from analyses.data.prompts import corpus_prompts, haystack
from analyses.heads.rules import duplicate_token, induction

SCORES = ["induction", "induction_text", "duplicate_token", "duplicate_token_text"]


def target_rows(model, lengths, n_prompts=100, seed=0) -> dict:
    """Per prompt length: the share of rows (after the first) with an induction and a duplicate-token target."""
    out = {}
    for n in lengths:
        ids = corpus_prompts(model, n_prompts, n, torch.Generator().manual_seed(seed))
        total = ind = dup = 0
        for row in ids:
            b, q, _ = induction(row[None])
            ind += len(torch.unique(q[q > 0]))
            b, q, _ = duplicate_token(row[None])
            dup += len(torch.unique(q[q > 0]))
            total += len(row) - 1
        out[n] = {"rows": total, "induction_rows": ind, "duplicate_rows": dup,
                  "mean_len": total / len(ids) + 1}
    return out


def top1_on_target(model, n_passages=2, n_tokens=256, seed=0):
    """(layer, head) -> share of rows with a bigram-induction target whose top-1 key is one, over ``n_passages``
    passages of ``n_tokens`` corpus tokens (eager patterns)."""
    g = torch.Generator().manual_seed(seed)
    hits = rows = 0
    for _ in range(n_passages):
        ids = haystack(model.tokenizer, n_tokens, g)
        prefix = model.to_tokens("a")[0].tolist()
        bare = model.tokenizer("a", add_special_tokens=False)["input_ids"]
        frame = prefix[:len(prefix) - len(bare)] if prefix[-len(bare):] == bare else []
        row = torch.tensor(frame + ids)[None]
        b, q, k = induction(row)
        keep = q > 0
        q, k = q[keep], k[keep]
        _, cache = model.run_with_cache(row, names=lambda n: n.endswith("hook_pattern"))
        pats = torch.stack([cache["pattern", l][0] for l in range(model.cfg.n_layers)])  # (l, h, q, k)
        top = pats.argmax(-1)  # (l, h, q)
        target = torch.zeros(row.shape[1], row.shape[1], dtype=torch.bool)
        target[q, k] = True
        with_target = target.any(-1)  # (q,)
        hit = target[torch.arange(row.shape[1])[None, None].expand_as(top), top] & with_target
        hits = hits + hit.sum(-1).double()
        rows += int(with_target.sum())
    return hits / rows, rows


def defaults(name: str) -> None:
    model = interp.load_model(name, attn="flash", device="cpu")
    t = time.process_time()
    df = detect_heads(model)
    print(f"{name}: detect_heads() {time.process_time() - t:.1f} s CPU")
    cols = ["layer", "head", "induction", "induction_lo", "induction_hi", "induction_text", "induction_text_lo",
            "induction_text_hi", "duplicate_token", "duplicate_token_text", "sink", "labels", "evidence"]
    print(df[df.evidence != ""][cols].round(3).to_string(index=False))
    for score, s in df.attrs["stability"].items():
        print(score, {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[64])
    ap.add_argument("--out", default=None)
    ap.add_argument("--defaults", action="store_true",
                    help="only detect_heads(model) with its defaults, flash path: the heads whose evidence is not "
                         "'both', and every score's stability")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.defaults:
        return defaults(a.model)
    t0 = time.process_time()
    model = interp.load_model(a.model, attn="eager")
    result = {"model": a.model, "rows": target_rows(model, a.lengths)}
    print(json.dumps(result["rows"]))
    share, n_rows = top1_on_target(model)
    result["top1_rows"] = n_rows
    tables = {}
    for n in a.seq_len:
        t = time.process_time()
        df = detect_heads(model, scores=SCORES, seq_len=n)
        df["top1_on_bigram_target"] = share.flatten().numpy() if len(df) == share.numel() else float("nan")
        tables[n] = df
        print(f"seq_len {n}: {time.process_time() - t:.1f} s CPU")
        cols = ["layer", "head", *[c for s in SCORES for c in (s, f"{s}_lo", f"{s}_hi")], "top1_on_bigram_target",
                "labels"]
        print(df.sort_values("top1_on_bigram_target", ascending=False)[cols].head(8).round(3).to_string(index=False))
        for s in SCORES:
            print(s, df[s].quantile([0.5, 0.9, 0.95, 0.99, 1.0]).round(3).tolist(), "stability",
                  df.attrs.get("stability", {}).get(s))
        if a.out:
            df.to_csv(f"{a.out}_{n}.csv", index=False)
    print(f"total {time.process_time() - t0:.1f} s CPU")


if __name__ == "__main__":
    main()
