"""benchmarks/bench_vs_kvpress.py's bookkeeping, in the project's environment (kvpress itself lives in a virtualenv
of its own and is not needed here): SnapKV's ratio gives it the KV budget our StreamingCache holds, the head sets
stream whole key/value heads, and the bytes it reports are what a cache holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import interp
from analyses.data.needles import needle_prompts
from interp.streaming import streaming_kv_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vs_kvpress as bench  # noqa: E402


@pytest.fixture(scope="module")
def toy():
    return interp.load_model("toy-induction")


def test_snapkv_budget_equals_our_streaming_cache(toy, tmp_path):
    sets = bench.head_sets(toy, "toy-induction", [(1, 0), (1, 3)], gate_share=0.5, gate_steps=1,
                           wanted=("retrieval",))  # gates would be fitted and cached under ~/.cache
    cfg = toy.cfg
    group = cfg.heads_per_layer[1] // cfg.kv_heads_per_layer[1]
    assert {(1, 0 // group), (1, 3 // group)}.isdisjoint(sets["retrieval"])  # the retrieval heads' kv heads stay
    for n in (300, 1000):
        spec = bench._spec(toy, "toy-induction", "kvpress snapkv", sets["retrieval"], n, "prompts.json")
        ours = streaming_kv_bytes(toy, [tuple(h) for h in spec["stream_heads"]], n, bench.SINK, bench.WINDOW)
        full = streaming_kv_bytes(toy, [], n, bench.SINK, bench.WINDOW)
        assert 0 < spec["snap_ratio"] < 1
        assert spec["snap_ratio"] == pytest.approx(1 - ours / full, abs=1e-12)


def test_cache_bytes_and_needles_on_our_streaming_cache(toy):
    p = needle_prompts(toy, [64], [0.5], needle_len=6)[0]
    prompts = [{"ids": p.ids.tolist(), "needle": list(p.needle)}]
    from contextlib import nullcontext

    with interp.stream_heads(toy, [(0, h) for h in range(4)], sink=2, window=8) as s:
        acc, _, _, kv = bench._needles(toy.hf, prompts, s.new_cache, nullcontext)
        cache = s.new_cache()
        with torch.no_grad():
            toy.hf(input_ids=p.ids[None], use_cache=True, **{interp.cache_kwarg(toy.hf): cache})
        assert bench._cache_bytes(cache) == interp.kv_cache_bytes(cache) > 0
    assert kv == streaming_kv_bytes(toy, [(0, h) for h in range(4)], 64 + 6, 2, 8)
    assert 0 <= acc[0] <= 1
