"""Edge attribution: every edge of the graph scored at once.

- **EAP** (Syed, Rager and Conmy 2023): edge ``u -> v`` scores ``(a_u(clean) - a_u(corrupted)) . d metric / d x_v``,
  ``x_v`` the stream ``v`` reads (before its norm), the gradient taken at the corrupted run and summed over the
  batch and positions: the first-order estimate of ``m(corrupted with that edge clean) - m(corrupted)``. One clean
  forward (the node outputs), one corrupted forward and one backward for every edge.
- **EAP-IG** (Hanna, Pezzelle and Belinkov 2024), "inputs" variant: the gradient averaged over ``steps`` points on
  the straight line from the corrupted to the clean input embeddings (the first block's input),
  ``alpha = k / steps`` for ``k = 0 .. steps - 1``; ``steps=1`` is EAP.

Each gradient ``d metric / d x_v`` is that of a zero added to ``v``'s own input (its norm recomputed on the run), so
one backward gives every receiver's; on the flash path the backward runs through the kernels' logsumexp and no
``n x n`` matrix is held. The first step (alpha 0) is the corrupted run itself and gives its node outputs too.

Cost (``benchmarks/bench_circuits.py``, in forwards of the batch): EAP 3 model passes (clean forward, corrupted
forward, its backward), EAP-IG ``1 + 2 * steps``, plus the graph's own arithmetic: each head's output apart in two runs
and one score product per receiver layer (``2 x edges x tokens x d_model`` FLOPs; 0.56 forwards on SmolLM2).
"""

from __future__ import annotations

import pandas as pd
import torch

from hooks.names import hook_name
from interp.runtime.progress import progress

from ..causal.attribution import _contiguous_output_layer
from ..causal.engine import _run, kept_logits
from ..causal.patching import paired_batches, scalar_metric
from .graph import edge_frame
from .patching import EdgeIndex, _Patcher, node_names, node_output, source_outputs

__all__ = ["METHODS", "edge_attribution"]

METHODS = ("eap", "eap-ig")


def _interpolate(clean_input: torch.Tensor, alpha: float):
    def hook(act, point):  # the corrupted run's input embeddings moved alpha of the way to the clean ones
        return act + alpha * (clean_input.to(act.dtype) - act)
    return hook


def _edge_scores(index: EdgeIndex, clean_nodes: dict, corrupted_nodes: dict, grads: list) -> list[float]:
    """Every edge's ``(a_u(clean) - a_u(corrupted)) . grad_r`` summed over the batch and positions: one matrix
    product per group of receivers that read the same senders (a layer's inputs), over those senders only."""
    diff = torch.stack([(node_output(clean_nodes, u) - node_output(corrupted_nodes, u)).float().flatten()
                        for u in index.nodes])  # (nodes, b * p * m)
    reach = [0] * len(index.receivers)
    for e in range(len(index)):
        r = int(index.receiver_of[e])
        reach[r] = max(reach[r], int(index.node_of[e]) + 1)
    table = torch.zeros(len(index.receivers), len(index.nodes))
    for n in sorted(set(reach)):
        rows = [r for r in range(len(reach)) if reach[r] == n and torch.is_tensor(grads[r])]
        if rows:
            table[rows, :n] = torch.stack([grads[r].flatten() for r in rows]) @ diff[:n].T
    return table[index.receiver_of, index.node_of].tolist()


def edge_attribution(model, clean, corrupted, metric, method: str = "eap-ig", steps: int = 5) -> pd.DataFrame:
    """Score every edge of the model's graph (``analyses.circuits.graph``) by EAP or EAP-IG.

    clean, corrupted: inputs of the same shape (as for ``activation_patching``). metric: ``metric(output, inputs)``
    with a gradient (``analyses.data.metrics``: ``logit_difference``, ...), taken as the mean over examples. method:
    ``"eap"`` or ``"eap-ig"``; steps: EAP-IG's interpolation points.

    Returns one row per edge: the upstream columns (``upstream``, ``up_kind``, ``up_layer``, ``up_site``,
    ``up_head``), the downstream ones (``downstream``, ``input`` in q/k/v/mlp/logits, ``down_layer``,
    ``down_site``, ``down_head``; k and v inputs are key/value heads), ``score`` (the estimate of the metric's
    change when that edge alone is made clean in the corrupted run) and ``abs_score``; ``df.attrs`` holds the clean
    and corrupted metric values, the method and steps.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer (EAP-IG's interpolation points); got {steps!r}.")
    steps = 1 if method == "eap" else steps
    index = EdgeIndex(model)
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    keep = kept_logits(model, metric, corrupted)
    receivers = index.receivers
    with model.studying():
        with torch.no_grad():
            out, clean_nodes = source_outputs(model, clean, **keep)
            clean_value = metric(out, clean)
        grads, corrupted_nodes = [0.0] * len(receivers), {}
        names = node_names(model)
        for k in progress(range(steps), total=steps, desc=f"{method} gradients", unit="step"):
            patcher = _Patcher(model, None, opened=receivers)
            hooks = [(hook_name("resid_pre", 0), _interpolate(clean_nodes[hook_name("resid_pre", 0)], k / steps))]
            if k == 0:  # alpha 0 is the corrupted run itself: its node outputs are read on the way
                hooks.append((names, lambda act, point: corrupted_nodes.__setitem__(point.name, act.detach())))
            with torch.enable_grad():
                for p in model.hf.parameters():
                    p.requires_grad_(False)
                with model.hooks(hooks), patcher.active(), _contiguous_output_layer(model):
                    out = _run(model, corrupted, **keep)
                value = metric.per_example(out, corrupted).float().mean()
                if not value.requires_grad:
                    raise TypeError(f"edge_attribution differentiates the metric; {metric.name} returned a value "
                                    "without a gradient. Use a metric from analyses.data.metrics or one returning a tensor "
                                    "computed from the model's output.")
                found = torch.autograd.grad(value, [patcher.zeros[r] for r in receivers], allow_unused=True)
            if k == 0:
                with torch.no_grad():
                    corrupted_value = metric(out, corrupted)
            grads = [g_sum if g is None else g_sum + g.detach().float() / steps for g_sum, g in zip(grads, found)]
        with torch.no_grad():
            scores = _edge_scores(index, clean_nodes, corrupted_nodes, grads)

    df = edge_frame(index.edges)
    df["score"] = scores
    df["abs_score"] = df["score"].abs()
    df.attrs.update(method=method, steps=steps, metric=metric.name, clean=clean_value, corrupted=corrupted_value)
    return df
