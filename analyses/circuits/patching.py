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
from interp.structure.probe import _is_norm

from ..causal.engine import _arguments, _run, kept_logits
from ..causal.patching import paired_batches, scalar_metric
from .graph import Node, Receiver, as_edges, mlp_norm, node_readers

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


def _columns(model, site, which: str, head: int):
    """Where ``head``'s ``which`` (q, k or v) input is written: ``(path, cols, compute)``, the module (path under the
    site's block) whose output holds it, its columns there, and ``compute(y)``, those columns from the normed
    stream ``y``. That module is the projection, or a norm over every head's q (or k) together (OLMo2's
    ``q_norm``), after which one head's columns depend on its own projection alone."""
    block, proj = model.projections_of(site)
    if isinstance(proj, str):
        raise ValueError(f"Edge patching needs {site.name}'s q, k and v projections as linear maps; {proj}.")
    d = site.d_head_v if which == "v" else site.d_head
    start = 0
    if proj.layout == "interleaved":  # [q_h | k_h | v_h] per head (GPT-NeoX)
        start = head * 3 * d + {"q": 0, "k": d, "v": 2 * d}[which]
        cols = slice(start, start + d)
    else:
        if proj.layout == "concat":
            start = {"q": 0, "k": site.n_heads * site.d_head, "v": (site.n_heads + site.n_kv_heads) * site.d_head}[which]
        cols = slice(start + head * d, start + (head + 1) * d)
    linear = block.get_submodule(getattr(proj, which))
    side = "q" if which == "q" else "kv"
    across = [path.rsplit(".", 1)[0] for path, on, width in proj.per_head if on == side and width == d and which != "v"
              and _is_norm(block.get_submodule(path.rsplit(".", 1)[0]))]
    if not across:
        return getattr(proj, which), cols, lambda y: _head_columns(linear, y, cols)
    norm = block.get_submodule(across[0])
    return across[0], cols, lambda y: norm.forward(linear(y))[..., cols]


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
        self.read = node_readers(model)
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
        read = self.read.get(point.name)
        self.run[point.name] = act if read is None else read(act)

    def _stream(self, receiver: Receiver):
        def pre(module, args):
            x = args[0]
            if x.ndim == 2:  # an MLP run on (b * p, m) (OPT): the nodes' outputs are (b, p, m)
                y = x.reshape(*self.run[hook_name("resid_pre", 0)].shape[:-1], x.shape[-1])
                return ((y + self.delta(receiver, y)).reshape(x.shape), *args[1:])
            return (x + self.delta(receiver, x), *args[1:])
        return pre

    def _grab(self, key):
        def pre(module, args):
            self.x[key] = args[0]
        return pre

    def _project(self, site, norm, entries):
        """q/k/v columns recomputed from the receiver's stream (read at its norm, or at q's projection where the
        attention reads the stream with no norm)."""
        def post(module, args, out):
            out = out.clone()
            x = self.x[site.name]
            for receiver, cols, compute in entries:
                y = x + self.delta(receiver, x)
                out[..., cols] = compute(y if norm is None else norm.forward(y))
            return out
        return post

    def _mlp_input(self, receiver: Receiver, norm):
        """A parallel block's MLP input rebuilt from the block's input (grabbed at the MLP's norm)."""
        def pre(module, args):
            x = self.x[("mlp", receiver.layer)]
            return (norm.forward(x + self.delta(receiver, x)), *args[1:])
        return pre

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
                elif r.input == "mlp" and model.structure.kind == "parallel":
                    norm, block = mlp_norm(model, r.layer), model._blocks[r.layer]
                    handles.append(norm.register_forward_pre_hook(self._grab(("mlp", r.layer))))
                    mlp = block.get_submodule(model.structure.mlp[r.layer])
                    handles.append(mlp.register_forward_pre_hook(self._mlp_input(r, norm)))
                elif r.input == "mlp":  # the norm on the stream after attention, or the MLP itself (no norm)
                    module = model._blocks[r.layer].get_submodule(model.structure.resid_mid[r.layer][0])
                    handles.append(module.register_forward_pre_hook(self._stream(r)))
                else:
                    site = model.sites[r.site]
                    path, cols, compute = _columns(model, site, r.input, r.head)
                    by_module.setdefault((site.name, path), []).append((r, cols, compute))
            for site_name in dict.fromkeys(s for s, _ in by_module):
                site = model.sites[site_name]
                block, proj = model.projections_of(site)
                reads = model.in_norm_of(site) or block.get_submodule(proj.q)  # no norm: q's projection reads it
                handles.append(reads.register_forward_pre_hook(self._grab(site.name)))
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
    read = node_readers(model)
    return output, {name: read[name](cache[name]) if name in read else cache[name] for name in node_names(model)}


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
