"""Exact edge patching: a run of the model on one input in which chosen edges carry the senders' outputs from a run
on another input, every other edge the run's own.

A downstream input ``v`` reads ``x_v = x + sum over patched edges u -> v of (source_u - run_u)``, where ``x`` is the
residual stream the run itself computed there and ``run_u``, ``source_u`` are ``u``'s outputs in this run and in the
source run. ``x_v`` goes through ``v``'s own norm (recomputed, not frozen), then for a head's q, k or v input through
the projection, keeping that head's columns only (under GQA, a k or v input is the key/value head's). Everything
downstream recomputes. With every edge patched the run is the source run; with none, the run itself.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from hooks.names import hook_name

from ..causal.engine import _arguments, _run, kept_logits
from ..causal.patching import paired_batches, scalar_metric
from .graph import Node, Receiver, as_edges

__all__ = ["edge_patching", "node_names", "node_output", "patched_run"]


def node_names(model) -> list[str]:
    """The hooks that carry every node's output: the first block's input, each site's per-head result, each MLP's."""
    names = [hook_name("resid_pre", 0)] + [hook_name("result", s.name) for s in model.cfg.sites]
    return names + [hook_name("mlp_out", l) for l in range(len(model.cfg.sites)) if model.structure.mlp[l]]


def node_output(store, node: Node) -> torch.Tensor:
    """A node's output ``(b, p, m)`` from a cache or dict of the hooks ``node_names`` lists."""
    if node.kind == "input":
        return store[hook_name("resid_pre", 0)]
    if node.kind == "mlp":
        return store[hook_name("mlp_out", node.layer)]
    return store[hook_name("result", node.site)][:, :, node.head]


def _columns(model, site, which: str, head: int) -> tuple[str, slice]:
    """The projection module (path under the site's module) and the columns of its output that hold ``head``'s
    ``which`` (q, k or v)."""
    _, proj = model.projections_of(site)
    if isinstance(proj, str) or proj.layout == "interleaved":
        raise ValueError(f"Edge patching needs {site.name}'s q, k and v projections as separate or concatenated "
                         f"linear maps; {proj if isinstance(proj, str) else 'they are interleaved per head'}.")
    d = site.d_head_v if which == "v" else site.d_head
    start = 0
    if proj.layout == "concat":
        start = {"q": 0, "k": site.n_heads * site.d_head, "v": (site.n_heads + site.n_kv_heads) * site.d_head}[which]
    return getattr(proj, which), slice(start + head * d, start + (head + 1) * d)


def _head_columns(module, y: torch.Tensor, cols: slice) -> torch.Tensor:
    """``module(y)[..., cols]`` computed for those columns only (a linear layer, or GPT-2's transposed Conv1D)."""
    if isinstance(module, torch.nn.Linear):
        bias = None if module.bias is None else module.bias[cols]
        return torch.nn.functional.linear(y, module.weight[cols], bias)
    if type(module).__name__ == "Conv1D":
        return y @ module.weight[:, cols] + module.bias[cols]
    return module.forward(y)[..., cols]


class _Patcher:
    """The hooks of one run: node outputs captured as they are computed, receivers' inputs rebuilt. A receiver's
    input is the run's stream plus, for each patched edge into it, ``source_u - run_u``, plus (``opened``) a zero
    tensor that needs a gradient: its gradient is the metric's derivative with respect to that input alone."""

    def __init__(self, model, source: dict | None, edges: list[tuple[Node, Receiver]], opened=()):
        self.model, self.source, self.run, self.x, self.zeros = model, source, {}, {}, {}
        self.into: dict[Receiver, list[Node]] = {r: [] for r in opened}
        self.opened = set(opened)
        for u, r in edges:
            self.into.setdefault(r, []).append(u)

    def delta(self, receiver: Receiver, like: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(like)
        for u in self.into[receiver]:
            total = total + (node_output(self.source, u).to(like.dtype) - node_output(self.run, u))
        if receiver in self.opened:
            self.zeros[receiver] = torch.zeros_like(like, requires_grad=True)
            total = total + self.zeros[receiver]
        return total

    def _keep(self, act, point):
        self.run[point.name] = act

    def _stream(self, receiver: Receiver):
        def pre(module, args):
            return (args[0] + self.delta(receiver, args[0]), *args[1:])
        return pre

    def _grab(self, site):
        def pre(module, args):
            self.x[site.name] = args[0]
        return pre

    def _project(self, site, norm, entries):
        def post(module, args, out):
            out = out.clone()
            x = self.x[site.name]
            for receiver, cols in entries:
                out[..., cols] = _head_columns(module, norm.forward(x + self.delta(receiver, x)), cols)
            return out
        return post

    @contextmanager
    def active(self):
        model = self.model
        with ExitStack() as stack:
            stack.enter_context(model.hooks([(node_names(model), self._keep)]))
            handles = []
            by_module: dict = {}
            for r in self.into:
                if r.input == "logits":
                    handles.append(model.final_norm().register_forward_pre_hook(self._stream(r)))
                elif r.input == "mlp":
                    handles.append(model.block_norm(r.layer, mlp_input=True).register_forward_pre_hook(self._stream(r)))
                else:
                    site = model.sites[r.site]
                    path, cols = _columns(model, site, r.input, r.head)
                    by_module.setdefault((site.name, path), []).append((r, cols))
            for site_name in dict.fromkeys(s for s, _ in by_module):
                site = model.sites[site_name]
                handles.append(model.in_norm_of(site).register_forward_pre_hook(self._grab(site)))
            for (site_name, path), entries in by_module.items():
                site = model.sites[site_name]
                block = model.projections_of(site)[0]
                hook = self._project(site, model.in_norm_of(site), entries)
                handles.append(block.get_submodule(path).register_forward_hook(hook))
            try:
                yield self
            finally:
                for handle in handles:
                    handle.remove()


def source_outputs(model, batch, **keep) -> tuple[object, dict]:
    """A run's output and every node's output (the hooks of ``node_names``)."""
    args, kwargs = _arguments(batch)
    output, cache = model.run_with_cache(*args, names=node_names(model), **kwargs, **keep)
    return output, {name: cache[name] for name in node_names(model)}


def patched_run(model, batch, source: dict, edges, **keep):
    """The model's output on ``batch`` with ``edges`` carrying ``source``'s node outputs (``source_outputs``)."""
    edges = as_edges(model, edges)
    with _Patcher(model, source, edges).active():
        return _run(model, batch, **keep)


def edge_patching(model, clean, corrupted, edges, metric=None, run: str = "clean"):
    """One exactly patched run. run ``"clean"``: the clean input with ``edges`` carrying the corrupted run's sender
    outputs; ``"corrupted"``: the corrupted input with ``edges`` carrying the clean run's. edges: ``(upstream,
    downstream)`` names (``("blocks.0.attn:1", "blocks.1.attn:0.k")``, ``("input", "mlp.1")``, ``("mlp.0",
    "logits")``) or a frame from ``edge_attribution``. Returns ``metric(output, inputs)`` on the patched run's
    inputs, or the output itself without a metric."""
    if run not in ("clean", "corrupted"):
        raise ValueError(f"run must be 'clean' or 'corrupted'; got {run!r}.")
    clean, corrupted = paired_batches(model, clean, corrupted)
    base, other = (clean, corrupted) if run == "clean" else (corrupted, clean)
    metric = None if metric is None else scalar_metric(metric)
    keep = {} if metric is None else kept_logits(model, metric, base)
    edges = as_edges(model, edges)
    with model.studying(), torch.no_grad():
        _, source = source_outputs(model, other, **keep)
        output = patched_run(model, base, source, edges, **keep)
    return output if metric is None else metric(output, base)
