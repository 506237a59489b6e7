"""Edge attribution: every edge of the graph scored at once.

- **EAP** (Syed, Rager and Conmy 2023): edge ``u -> v`` scores ``(a_u(clean) - a_u(corrupted)) . d metric / d x_v``,
  ``x_v`` the stream ``v`` reads (before its norm), the gradient taken at the corrupted run and summed over the
  batch and positions: the first-order estimate of ``m(corrupted with that edge clean) - m(corrupted)``. One clean
  forward (the node outputs), one corrupted forward and one backward for every edge.
- **EAP-IG** (Hanna, Pezzelle and Belinkov 2024), "inputs" variant: the gradient averaged over ``steps`` points on
  the straight line from the corrupted to the clean input embeddings (the first block's input),
  ``alpha = k / steps`` for ``k = 0 .. steps - 1``; ``steps=1`` is EAP.

Each gradient ``d metric / d x_v`` is that of ``v``'s input alone: one backward of the run gives the gradient at each
norm's output (for a head's q, k or v input, at its columns of the projection's output), and each receiver's is that
one's slice carried back through its weights and the norm's Jacobian at the run's own stream, then contracted at once
with every upstream node's ``a_u(clean) - a_u(corrupted)``, a chunk of positions at a time. What is held is a few
residual-sized tensors per layer (the heads' ``z`` differences, the MLPs' output differences, the norms' inputs and
the projections' output gradients), never a tensor per edge or per receiver for the whole sequence; on the flash path
the backward runs through the kernels' logsumexp and no ``n x n`` matrix is held: the memory of a forward and backward
of the model, plus O(n) per layer.
"""

from __future__ import annotations

import pandas as pd
import torch

from hooks.names import hook_name
from interp.runtime.progress import progress

from ..causal.attribution import _contiguous_output_layer
from ..causal.engine import _arguments, _run, kept_logits
from ..causal.patching import paired_batches, scalar_metric
from .graph import Node, Receiver, edge_frame, graph_edges
from .patching import _columns

__all__ = ["METHODS", "edge_attribution"]

METHODS = ("eap", "eap-ig")
_CHUNK_ELEMENTS = 1 << 25  # elements of one chunk's stacked node differences (128 MiB in fp32)


def _interpolate(clean_input: torch.Tensor, alpha: float, taps: dict):
    def hook(act, point):  # the corrupted run's input embeddings moved alpha of the way to the clean ones
        moved = (act + alpha * (clean_input.to(act.dtype) - act)).detach().requires_grad_(True)
        taps["input"] = moved
        return moved
    return hook


# -- the node differences a_u(clean) - a_u(corrupted), kept compact --------------------------------------------------
def _compact_names(model) -> list[str]:
    """What a run keeps to rebuild every node's output: the first block's input, each site's z, each MLP's output."""
    names = [hook_name("resid_pre", 0)] + [hook_name("z", s.name) for s in model.cfg.sites]
    return names + [hook_name("mlp_out", l) for l in range(len(model.cfg.sites)) if model.structure.mlp[l]]


def _node_differences(model, clean, corrupted, keep):
    """The clean and corrupted runs' outputs, the clean run's input embeddings, and each node's output difference
    kept compactly: ``z`` per site (a head's output is its ``z`` through its columns of the output projection,
    without the bias, as ``hook_result`` has it), the MLPs' outputs and the input."""
    names, outputs, diff = _compact_names(model), [], {}
    for sign, batch in ((1.0, clean), (-1.0, corrupted)):
        args, kwargs = _arguments(batch)
        out, cache = model.run_with_cache(*args, names=names, **kwargs, **keep)
        outputs.append(out)
        if sign > 0:
            clean_input = cache[names[0]]
            diff = {name: cache[name].float().clone() for name in names}  # subtracted from in place
        else:
            for name in names:
                diff[name] -= cache[name].float()
        del cache
    return *outputs, clean_input, diff


def _output_weight(model, site) -> torch.Tensor:
    """The output projection as ``(m, h * e)``: a head's output is ``z_h @ W[:, cols].T``."""
    o = model.o_proj_of(site)
    if o is None:
        raise ValueError(f"Edge attribution reads each head's output through {site.name}'s output projection; this "
                         "site has none.")
    return o.weight.float() if isinstance(o, torch.nn.Linear) else o.weight.float().T  # GPT-2's Conv1D: (h * e, m)


def _stacked(model, nodes: list[Node], diff: dict, rows: slice) -> torch.Tensor:
    """``(N, b, c, m)``: every node's output difference at positions ``rows``."""
    out = []
    for node in nodes:
        if node.kind == "input":
            out.append(diff[hook_name("resid_pre", 0)][:, rows])
        elif node.kind == "mlp":
            out.append(diff[hook_name("mlp_out", node.layer)][:, rows])
        else:
            out.append(None)
    heads: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        if node.kind == "head":
            heads.setdefault(node.site, []).append(i)
    for site_name, index in heads.items():
        site = model.sites[site_name]
        z = diff[hook_name("z", site_name)][:, rows]  # (b, c, h, e)
        w = _output_weight(model, site).reshape(-1, site.n_heads, z.shape[-1])  # (m, h, e)
        result = torch.einsum("bche,mhe->hbcm", z, w)
        for i in index:
            out[i] = result[nodes[i].head]
    return torch.stack(out)


# -- the receivers' gradients from one backward ---------------------------------------------------------------------
class _Taps:
    """Hooks of one run that keep, for each norm a receiver reads through, its input (the run's stream) and the
    gradient at what the receivers read after it: the q/k/v projections' outputs (a head's columns are its input's)
    or the norm's output (an MLP, the logits)."""

    def __init__(self, model, receivers: list[Receiver]):
        self.model, self.x, self.grad, self.handles = model, {}, {}, []
        self.groups: dict[object, list] = {}  # norm key -> [(receiver, projection key or None, cols)]
        for r in receivers:
            if r.input == "logits":
                self.groups.setdefault("final", []).append((r, None, None))
            elif r.input == "mlp":
                self.groups.setdefault(("mlp", r.layer), []).append((r, None, None))
            else:
                site = model.sites[r.site]
                path, cols = _columns(model, site, r.input, r.head)
                self.groups.setdefault(("site", r.site), []).append((r, (r.site, path), cols))

    def norm(self, key) -> torch.nn.Module:
        if key == "final":
            return self.model.final_norm()
        if key[0] == "mlp":
            return self.model.block_norm(key[1], mlp_input=True)
        return self.model.in_norm_of(self.model.sites[key[1]])

    def _keep_grad(self, key):
        def post(module, args, out):
            if out.requires_grad:
                out.register_hook(lambda g: self.grad.__setitem__(key, g.detach()))
        return post

    def _keep_x(self, key):
        def pre(module, args):
            self.x[key] = args[0].detach()
        return pre

    def __enter__(self):
        for key, entries in self.groups.items():
            norm = self.norm(key)
            self.handles.append(norm.register_forward_pre_hook(self._keep_x(key)))
            if key == "final" or key[0] == "mlp":
                self.handles.append(norm.register_forward_hook(self._keep_grad(key)))
            else:
                block = self.model.projections_of(self.model.sites[key[1]])[0]
                for proj in dict.fromkeys(p for _, p, _ in entries):
                    self.handles.append(block.get_submodule(proj[1]).register_forward_hook(self._keep_grad(proj)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def stream_gradients(self, key, rows: slice) -> tuple[list[Receiver], torch.Tensor | None]:
        """The receivers reading through norm ``key`` and ``(R, b, c, m)``: each one's gradient with respect to
        its own input stream at positions ``rows``."""
        entries, x = self.groups[key], self.x.get(key)
        if x is None:
            return [e[0] for e in entries], None
        after = []
        for r, proj, cols in entries:
            if proj is None:
                g = self.grad.get(key)
                after.append(None if g is None else g[:, rows].float())
                continue
            g = self.grad.get(proj)
            if g is None:
                after.append(None)
                continue
            module = self.model.projections_of(self.model.sites[proj[0]])[0].get_submodule(proj[1])
            w = module.weight.float()
            w = w[cols] if isinstance(module, torch.nn.Linear) else w[:, cols].T  # (d, m)
            after.append(g[:, rows, cols].float() @ w)
        if all(a is None for a in after):
            return [e[0] for e in entries], None
        like = next(a for a in after if a is not None)
        g_after = torch.stack([torch.zeros_like(like) if a is None else a for a in after])
        with torch.enable_grad():
            xs = x[:, rows].unsqueeze(0).expand(len(entries), *x[:, rows].shape).clone().requires_grad_(True)
            y = self.norm(key)(xs)
            (g_x,) = torch.autograd.grad(y, xs, g_after.to(y.dtype))
        return [e[0] for e in entries], g_x.float()


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
    edges = graph_edges(model)
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    keep = kept_logits(model, metric, corrupted)
    receivers = list(dict.fromkeys(r for _, r in edges))
    nodes = list(dict.fromkeys(u for u, _ in edges))
    node_index = {u: i for i, u in enumerate(nodes)}
    receiver_index = {r: j for j, r in enumerate(receivers)}
    scores = torch.zeros(len(nodes), len(receivers), dtype=torch.float64)
    with model.studying():
        with torch.no_grad():
            out_clean, out_corrupted, clean_input, diff = _node_differences(model, clean, corrupted, keep)
            clean_value, corrupted_value = metric(out_clean, clean), metric(out_corrupted, corrupted)
            del out_clean, out_corrupted
        for p in model.hf.parameters():
            p.requires_grad_(False)
        for k in progress(range(steps), total=steps, desc=f"{method} gradients", unit="step"):
            taps = _Taps(model, receivers)
            moved = {}
            hooks = [(hook_name("resid_pre", 0), _interpolate(clean_input, k / steps, moved))]
            with torch.enable_grad():
                with model.hooks(hooks), taps, _contiguous_output_layer(model):
                    out = _run(model, corrupted, **keep)
                value = metric.per_example(out, corrupted).float().mean()
                if not value.requires_grad:
                    raise TypeError(f"edge_attribution differentiates the metric; {metric.name} returned a value "
                                    "without a gradient. Use a metric from analyses.data.metrics or one returning a "
                                    "tensor computed from the model's output.")
                torch.autograd.grad(value, [moved["input"]], allow_unused=True)
            del out, value, moved
            _contract(model, taps, nodes, node_index, receiver_index, diff, scores, steps)
            del taps
    df = edge_frame(edges)
    df["score"] = [float(scores[node_index[u], receiver_index[r]]) for u, r in edges]
    df["abs_score"] = df["score"].abs()
    df.attrs.update(method=method, steps=steps, metric=metric.name, clean=clean_value, corrupted=corrupted_value)
    return df


def _contract(model, taps: _Taps, nodes, node_index, receiver_index, diff, scores, steps: int) -> None:
    """``scores[u, v] += (a_u(clean) - a_u(corrupted)) . d metric / d x_v / steps`` summed over the batch and
    positions, a chunk of positions at a time (the stacked node differences of a chunk stay under
    ``_CHUNK_ELEMENTS``)."""
    b, p, m = diff[hook_name("resid_pre", 0)].shape
    chunk = max(1, _CHUNK_ELEMENTS // max(1, len(nodes) * b * m))
    with torch.no_grad():
        for start in range(0, p, chunk):
            rows = slice(start, min(p, start + chunk))
            stacked = _stacked(model, nodes, diff, rows).flatten(1)  # (N, b * c * m)
            for key in taps.groups:
                receivers, g = taps.stream_gradients(key, rows)
                if g is None:
                    continue
                found = (stacked @ g.flatten(1).T).double() / steps  # (N, R)
                columns = [receiver_index[r] for r in receivers]
                scores[:, columns] += found
