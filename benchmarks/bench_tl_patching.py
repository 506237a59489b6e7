"""CPU seconds per patched forward of ``analyses.causal.tl_patching`` on SmolLM2, and what several copies per
forward change, on the batches of TransformerLens's Activation_Patching_in_TL_Demo (issue 53).

    OMP_NUM_THREADS=1 python benchmarks/bench_tl_patching.py

Prints, for the demo's IOI batch (8 prompts x 14 tokens) and an induction batch of its size (4 x 41 random tokens):
the CPU seconds of one patched forward averaged over the 30 layers it starts from (``resid_pre`` at the last
position, one index per layer: the blocks before the layer are replayed, so a forward from layer l costs the blocks
from l on), and for 16 indices at layer 15 the CPU seconds with 1, 4, 8 and 16 patched copies per forward (the
values must agree: printed). ``run_tl_demos.py``'s reasons quote the first numbers.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's interp

import pandas as pd  # noqa: E402
import torch  # noqa: E402

PROMPTS = ["When John and Mary went to the shops, John gave the bag to",
           "When John and Mary went to the shops, Mary gave the bag to",
           "When Tom and James went to the park, James gave the ball to",
           "When Tom and James went to the park, Tom gave the ball to",
           "When Dan and Sid went to the shops, Sid gave an apple to",
           "When Dan and Sid went to the shops, Dan gave an apple to",
           "After Martin and Amy went to the park, Amy gave a drink to",
           "After Martin and Amy went to the park, Martin gave a drink to"]  # the demo's


def _cpu(fn) -> tuple[float, torch.Tensor]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def main() -> int:
    import interp
    from analyses.causal import tl_patching as patching

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the BOS warning of from_pretrained
    model = interp.HookedTransformer.from_pretrained("smollm2")
    clean = model.to_tokens(PROMPTS)
    corrupted = clean[[i + 1 if i % 2 == 0 else i - 1 for i in range(len(clean))]]  # the demo's pairs swapped
    induction = torch.randint(100, 10000, (4, 41), generator=torch.Generator().manual_seed(0))

    def metric(logits):  # reads the last position, as the demo's logit difference
        return logits[:, -1, 5].mean() - logits[:, -1, 7].mean()

    n = model.cfg.n_layers
    every_layer = pd.DataFrame({"layer": range(n)})
    for label, (patched, source) in {"IOI 8 x 14": (corrupted, clean), "induction 4 x 41": (induction, induction)}.items():
        _, cache = model.run_with_cache(source)
        df = every_layer.assign(pos=source.shape[1] - 1)
        seconds, _ = _cpu(lambda: patching.generic_activation_patch(
            model, patched, cache, metric, patching.layer_pos_patch_setter, "resid_pre", index_df=df, per_forward=1))
        print(f"{label}: {seconds / (n + 1):.3f} s CPU a patched forward (mean over the {n} layers; "
              f"{n} + 1 baseline forwards in {seconds:.1f} s)")
    _, cache = model.run_with_cache(clean)
    df = pd.DataFrame({"layer": [n // 2] * 16, "pos": [i % clean.shape[1] for i in range(16)]})
    values = {}
    for copies in (1, 4, 8, 16):
        seconds, values[copies] = _cpu(lambda: patching.generic_activation_patch(
            model, corrupted, cache, metric, patching.layer_pos_patch_setter, "resid_pre", index_df=df,
            per_forward=copies))
        print(f"16 resid_pre patches at layer {n // 2}, {copies:2d} copies a forward: {seconds:.2f} s CPU; largest "
              f"difference from one a forward {float((values[copies] - values[1]).abs().max()):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
