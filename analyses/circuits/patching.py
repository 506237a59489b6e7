"""Exact edge patching: a run of the model on one input in which chosen edges carry the senders' outputs from a run
on another input, every other edge the run's own.

A downstream input ``v`` reads ``x_v = x + sum over patched edges u -> v of (source_u - run_u)``, where ``x`` is the
residual stream the run itself computed there and ``run_u``, ``source_u`` are ``u``'s outputs in this run and in the
source run. ``x_v`` goes through ``v``'s own norm (recomputed, not frozen), then for a head's q, k or v input through
the projection, keeping that head's columns only (under GQA, a k or v input is the key/value head's). Everything
downstream recomputes. With every edge patched the run is the source run; with none, the run itself.

Cost: the node outputs are stacked once per run, ``source_u - run_u`` for every sender, and each receiver's patched
input is one matrix product of its 0/1 row over the senders with that stack, so a run costs one forward plus one
product per receiver, whatever the number of edges patched (a complement of 72k edges as one of 1). Several edge
sets run in one forward, as copies of the batch (``patched_runs``), as the scans in ``analyses.causal`` do.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

import pandas as pd

from hooks.names import hook_name
from interp.runtime.progress import progress

from ..causal.engine import Prefix, _arguments, _run, _same_output, copies_per_forward, kept_logits, slice_output
from ..causal.patching import paired_batches, scalar_metric
from .graph import Node, Receiver, as_edges, edge_frame, graph_edges, node_readers, reading, senders
from .postnorm import Carrier, is_post_norm, recording_scales, replayable_blocks

__all__ = ["EdgeIndex", "circuits_per_forward", "edge_effects", "edge_patching", "node_hook", "node_names",
           "node_output", "patched_run", "patched_runs"]


def node_names(model) -> list[str]:
    """The hooks that carry every node's output: the first block's input (of each stack, in an encoder-decoder
    model), each site's per-head result, each MLP's."""
    return list(dict.fromkeys(node_hook(u) for u in senders(model)))


def node_hook(node: Node) -> str:
    """The hook (one of ``node_names``) that carries ``node``'s output."""
    if node.kind == "input":
        return hook_name("resid_pre", 0, node.stack or None)
    return hook_name("mlp_out", node.layer, node.stack or None) if node.kind == "mlp" else hook_name("result", node.site)


def node_output(store, node: Node) -> torch.Tensor:
    """A node's output ``(b, p, m)`` from a cache or dict of the hooks ``node_names`` lists."""
    value = store[node_hook(node)]
    return value[:, :, node.head] if node.kind == "head" else value


class EdgeIndex:
    """The graph's edges as numbers: ``nodes`` (senders, in the order the model computes them), ``receivers``, and
    for edge ``e`` (``graph_edges``' order) its sender ``node_of[e]`` and receiver ``receiver_of[e]``. ``streams``:
    per residual stream (``Node.stack``: ``""``, or an encoder-decoder model's ``"encoder"`` and ``"decoder"``) the
    span ``(first, end)`` of its nodes; ``stream_of``: the stream each receiver reads."""

    def __init__(self, model):
        self.edges = graph_edges(model)
        self.nodes = senders(model, self.edges)
        self.receivers = list(dict.fromkeys(r for _, r in self.edges))
        self.stream_of = {r: u.stack for u, r in self.edges}
        self.streams: dict[str, tuple[int, int]] = {}
        for i, u in enumerate(self.nodes):
            self.streams[u.stack] = (self.streams.get(u.stack, (i, i))[0], i + 1)
        node_at = {u: i for i, u in enumerate(self.nodes)}
        receiver_at = {r: i for i, r in enumerate(self.receivers)}
        self.node_of = torch.tensor([node_at[u] for u, _ in self.edges], dtype=torch.long)
        self.receiver_of = torch.tensor([receiver_at[r] for _, r in self.edges], dtype=torch.long)
        self.at = {(u.name, r.name): e for e, (u, r) in enumerate(self.edges)}
        self.model = model

    def __len__(self) -> int:
        return len(self.edges)

    def positions(self, edges) -> list[int]:
        """The positions of ``edges`` (names, nodes, or a frame: as ``as_edges`` takes them) in ``self.edges``."""
        if isinstance(edges, pd.DataFrame):
            pairs = list(zip(edges["upstream"], edges["downstream"]))
        else:
            pairs = [(getattr(u, "name", u), getattr(r, "name", r)) for u, r in edges]
        found = [self.at.get(pair) for pair in pairs]
        if any(e is None for e in found):  # the clear error for the first one that is not an edge
            missing = [pair for pair, e in zip(pairs, found) if e is None][0]
            as_edges(self.model, [missing])
            raise ValueError(f"{missing[0]} -> {missing[1]} is not an edge of this model's graph.")
        return found

    def masks(self, chosen: torch.Tensor) -> torch.Tensor:
        """``chosen``: bool ``(c, E)`` (edge ``e`` patched in copy ``i``) -> ``(c, receivers, nodes)`` 0/1."""
        out = torch.zeros(chosen.shape[0], len(self.receivers), len(self.nodes))
        out[:, self.receiver_of, self.node_of] = chosen.float()
        return out


class _Patcher:
    """The hooks of one run over ``c`` copies of a batch, copy ``i`` patching the edges of ``masks[i]``.

    Node outputs are written as they are computed into one stack per residual stream ``D: (c, nodes, b * p * m)``
    (an encoder-decoder model's encoder and decoder have two, of their own lengths) holding ``source_u - run_u``
    (prefilled with ``source_u - base_u`` from ``base``, the run's own node outputs where it has them, so that
    blocks replayed instead of recomputed still count). A receiver's patched input is its stream plus the
    matrix product of its row of the 0/1 mask over senders with ``D``: one product per receiver, whatever the number
    of edges. Where the model norms a sublayer's output (sandwich norms), a node's output is read as
    ``node_readers`` has it, as it is computed. Post-norm blocks: the senders' contributions in this run and in the
    source run are each carried through the norms as the run passes them (``postnorm.Carrier``), and the stack is
    their difference at the stream the run is at."""

    def __init__(self, model, source: dict | None, masks: torch.Tensor | None = None, index: EdgeIndex | None = None,
                 base: dict | None = None):
        self.model, self.source, self.base, self.index = model, source, base, index
        self.x, self.stacks, self.read, self.carrier = {}, {}, node_readers(model), None
        self.rows: dict[Receiver, int] = {}
        self.reach = {}
        if masks is not None and bool(masks.any()):
            used = masks.flatten(0, 1).any(0)  # senders used at all
            for i, r in enumerate(index.receivers):
                senders = masks[:, i].any(0).nonzero()
                if len(senders):
                    self.rows[r], self.reach[r] = i, int(senders.max()) + 1
            self.masks, self.copies = masks, masks.shape[0]
            self.width = int(used.nonzero().max()) + 1  # senders past the last used one are never read
        self.receivers = list(self.rows)

    def _allocate(self, copies: int):
        """Per stream, ``(its first node, the stack (c, its nodes up to the last one used, b * p * m))`` in the
        source's dtype, every node's output in a stream having one shape (post-norm: one stream, whose stack the
        ``Carrier`` keeps)."""
        one = node_output(self.source, self.index.nodes[0])
        self.masks, self.dtype = self.masks.to(one.device, one.dtype), one.dtype
        post = is_post_norm(self.model)
        for stream, (first, end) in self.index.streams.items():
            nodes = self.index.nodes[first:min(end, self.width)]
            if not nodes:
                continue
            shapes = {tuple(node_output(self.source, u).shape) for u in nodes}
            if len(shapes) > 1:
                raise ValueError("Edge patching stacks the node outputs, which must share one shape; got "
                                 f"{sorted(shapes)}.")
            one = node_output(self.source, nodes[0])
            if post:
                self.carrier = Carrier(self.model, self.index.nodes, self.source, self.base)
                self.carrier.allocate(copies, len(nodes), one)
                self.stacks[stream] = (first, None)
            else:
                self.stacks[stream] = (first, one.new_zeros(copies, len(nodes), one.numel()))

    def _fill(self, act: torch.Tensor, hook: str, nodes: list[tuple[int, Node]], copies: int):
        """``source_u - run_u`` for the ``nodes`` that ``hook`` carries, from its value ``act`` ``(copies * b, ...)``
        (``copies`` 1: the same for every copy)."""
        for i, u in nodes:
            first, stack = self.stacks[u.stack]
            run = node_output({hook: act}, u).reshape(copies, -1).to(self.dtype)
            source = node_output(self.source, u).to(self.dtype).reshape(1, -1)
            if self.carrier is None:
                stack[:, i - first] = source - run
            else:
                self.carrier.fill(i, run, source)

    def _keep(self, nodes):
        def hook(act, point):
            read = self.read.get(point.name)
            self._fill(act if read is None else read(act), point.name, nodes, self.copies)
        return hook

    def deltas(self, receivers: list[Receiver], like: torch.Tensor) -> list[torch.Tensor | float]:
        """What each of ``receivers`` adds to the stream ``like`` ``(c * b, p, m)`` it reads."""
        out: list = [0.0] * len(receivers)
        patched = [j for j, r in enumerate(receivers) if r in self.rows]
        if patched:
            reach = max(self.reach[receivers[j]] for j in patched)
            rows = torch.tensor([self.rows[receivers[j]] for j in patched])
            first, stack = self.stacks[self.index.stream_of[receivers[patched[0]]]]  # one stream: read together
            stack = stack if self.carrier is None else self.carrier.difference()
            mask = self.masks[:, rows, first:reach]  # (c, r, n)
            moved = torch.bmm(mask, stack[:, :reach - first])  # (c, r, b * p * m)
            for k, j in enumerate(patched):
                out[j] = moved[:, k].reshape(like.shape)
        return out

    def _stream(self, receiver: Receiver):
        def pre(module, args):
            return (args[0] + self.deltas([receiver], args[0])[0], *args[1:])
        return pre

    def _output(self, receiver: Receiver):
        def post(module, args, out):
            return out + self.deltas([receiver], out)[0]
        return post

    def _grab(self, key):
        def pre(module, args):
            self.x[key] = args[0]
        return pre

    def _columns_of(self, module, key, norm, entries) -> list[torch.Tensor]:
        """The ``entries``' columns of ``module``'s output, each from its receiver's own input (read at its norm, or
        as it is where the attention reads the stream with no norm)."""
        x = self.x[key]
        ys = [x + delta for delta in self.deltas([r for r, _, _ in entries], x)]
        return [compute(y if norm is None else norm.forward(y)) for (_, _, compute), y in zip(entries, ys)]

    def _project(self, key, norm, entries):
        def post(module, args, out):  # some heads' columns: the projection runs, then those are replaced
            out = out.clone()
            for (_, cols, _), value in zip(entries, self._columns_of(module, key, norm, entries)):
                out[..., cols] = value
            return out
        return post

    def _mlp_input(self, receiver: Receiver, norm):
        """A parallel block's MLP input rebuilt from the block's input (grabbed at the MLP's norm)."""
        def pre(module, args):
            x = self.x[("mlp", receiver.layer)]
            return (norm.forward(x + self.deltas([receiver], x)[0]), *args[1:])
        return pre

    def _whole(self, module, key, norm, entries):
        def forward(*args, **kwargs):  # every column is a receiver's: the projection is not run twice
            return torch.cat(self._columns_of(module, key, norm, entries), dim=-1)
        return forward

    @staticmethod
    def _covers(module, entries) -> bool:
        """Whether ``entries``' column slices, in order, are exactly every output column of ``module``."""
        width = getattr(module, "out_features", getattr(module, "nf", None))
        stops = [0] + [cols.stop for _, cols, _ in entries]
        return width == stops[-1] and all(cols.start == stop for (_, cols, _), stop in zip(entries, stops))

    @contextmanager
    def active(self):
        model = self.model
        with ExitStack() as stack:
            if self.rows:
                senders = {}
                for i, u in enumerate(self.index.nodes[:self.width]):
                    senders.setdefault(node_hook(u), []).append((i, u))
                self._allocate(self.copies)
                if self.base is not None:  # what blocks replayed instead of recomputed would have written
                    for hook, nodes in senders.items():
                        self._fill(self.base[hook], hook, nodes, 1)
                stack.enter_context(model.hooks([([h], self._keep(n)) for h, n in senders.items()]))
            handles = [] if self.carrier is None else [m.register_forward_pre_hook(h)
                                                             for m, h in self.carrier.hooks(model._blocks)]
            by_module: dict = {}
            grabbed = {}
            for r in self.receivers:
                read = reading(model, r)
                if read.kind in ("stream", "output"):
                    handles.append(read.module.register_forward_pre_hook(self._stream(r)) if read.kind == "stream"
                                   else read.module.register_forward_hook(self._output(r)))
                    continue
                grabbed.setdefault(read.key, read.grab)
                if read.kind == "mlp_input":
                    handles.append(read.module.register_forward_pre_hook(self._mlp_input(r, read.norm)))
                else:
                    by_module.setdefault((read.key, read.module), (read, []))[1].append((r, read.cols, read.compute))
            for key, grab in grabbed.items():
                handles.append(grab.register_forward_pre_hook(self._grab(key)))
            replaced = []  # (module, its own forward attribute or None)
            for (key, module), (read, entries) in by_module.items():
                entries = sorted(entries, key=lambda entry: entry[1].start)
                if self._covers(module, entries):
                    replaced.append((module, module.__dict__.get("forward")))
                    module.forward = self._whole(module, key, read.norm, entries)
                else:
                    handles.append(module.register_forward_hook(self._project(key, read.norm, entries)))
            try:
                yield self
            finally:
                for handle in handles:
                    handle.remove()
                for module, forward in replaced:  # an accelerate-dispatched module keeps its own forward
                    if forward is None:
                        module.__dict__.pop("forward", None)
                    else:
                        module.forward = forward
                self.stacks, self.carrier = {}, None


def source_outputs(model, batch, **keep) -> tuple[object, dict]:
    """A run's output and every node's output (the hooks of ``node_names``; post-norm: and its norms' scales)."""
    args, kwargs = _arguments(batch)
    with recording_scales(model, {}) as scales:
        output, cache = model.run_with_cache(*args, names=node_names(model), **kwargs, **keep)
    read = node_readers(model)
    outputs = {name: read[name](cache[name]) if name in read else cache[name] for name in node_names(model)}
    return output, {**outputs, **scales}


def patched_runs(model, batch, source: dict, chosen: torch.Tensor, index: EdgeIndex, **keep):
    """The model's output on ``c`` copies of ``batch`` (rows ``i * b .. (i + 1) * b`` are copy ``i``), copy ``i``
    with the edges ``chosen[i]`` (bool ``(c, E)`` over ``index.edges``) carrying ``source``'s node outputs."""
    with _Patcher(model, source, index.masks(chosen), index).active():
        return _run(model, batch, chosen.shape[0], **keep)


def patched_run(model, batch, source: dict, edges, **keep):
    """The model's output on ``batch`` with ``edges`` carrying ``source``'s node outputs (``source_outputs``)."""
    index = EdgeIndex(model)
    chosen = torch.zeros(1, len(index), dtype=torch.bool)
    chosen[0, index.positions(edges)] = True
    return patched_runs(model, batch, source, chosen, index, **keep)


def circuits_per_forward(model, batch, index: EdgeIndex, memory_budget: float | None = None, kept=None) -> int:
    """How many patched copies of ``batch`` one forward takes within ``memory_budget`` bytes (default as the scans':
    ``copies_per_forward``): a copy's activations plus its stacks of node differences (nodes x tokens x d_model, per
    stream: an encoder-decoder model's decoder nodes over the target's tokens)."""
    if memory_budget is None:
        memory_budget = 2**30 if model.device.type == "cuda" else 16 * 2**20
    tokens = sum((end - first) * batch["decoder_input_ids" if stream == "decoder" else "input_ids"].numel()
                 for stream, (first, end) in index.streams.items())
    stack = tokens * model.cfg.d_model * torch.finfo(model.dtype).bits // 8
    if is_post_norm(model):
        stack *= 2  # the run's carried contributions and the difference
    activations = memory_budget / copies_per_forward(model, batch, memory_budget, kept)
    return max(1, int(memory_budget // (activations + stack)))


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
    index = EdgeIndex(model)
    chosen = torch.zeros(1, len(index), dtype=torch.bool)
    chosen[0, index.positions(edges)] = True
    with model.studying(), torch.no_grad():
        _, source = source_outputs(model, other, **keep)
        output = patched_runs(model, base, source, chosen, index, **keep)
    return output if metric is None else metric(output, base)


def edge_effects(model, clean, corrupted, edges, metric, run: str = "corrupted",
                 memory_budget: float | None = None) -> pd.DataFrame:
    """The exact effect of each edge alone: ``edge_patching(model, clean, corrupted, [edge], metric, run)`` minus the
    unpatched run's metric, for every edge of ``edges`` (default run ``"corrupted"``: making that edge alone clean,
    what EAP and EAP-IG estimate). Several edges per forward (copies of the batch, ``circuits_per_forward``); the
    blocks before an edge's receiver are replayed from the run instead of recomputed (``Prefix``, checked once
    against a full forward), so an edge into layer l costs the blocks from l on.

    Returns one row per edge: ``upstream``, ``downstream``, ``input``, ``effect``; ``df.attrs``: ``run`` (its
    metric), ``forwards`` (patched forwards), ``block_fraction`` (blocks computed over blocks of one full forward
    per edge)."""
    if run not in ("clean", "corrupted"):
        raise ValueError(f"run must be 'clean' or 'corrupted'; got {run!r}.")
    index = EdgeIndex(model)
    positions = index.positions(edges)
    clean, corrupted = paired_batches(model, clean, corrupted)
    base, other = (clean, corrupted) if run == "clean" else (corrupted, clean)
    metric = scalar_metric(metric)
    keep = kept_logits(model, metric, base)
    per = circuits_per_forward(model, base, index, memory_budget, keep.get("logits_to_keep"))
    last = replayable_blocks(model)  # post-norm: the metric reads the last block's own norm, which must run
    layers = [min(index.receivers[int(index.receiver_of[e])].layer, last) for e in positions]
    order = sorted(range(len(positions)), key=lambda j: -layers[j])  # late receivers first: most blocks replayed
    chunks = [order[i:i + per] for i in range(0, len(order), per)]
    effects, b, blocks, checked = [float("nan")] * len(positions), base["input_ids"].shape[0], 0, False
    with model.studying(), torch.no_grad():
        _, source = source_outputs(model, other, **keep)
        prefix = Prefix(model)
        with prefix.recording():
            output, own = source_outputs(model, base, **keep)
        value = float(metric(output, base))
        n_blocks = max(len(prefix.blocks), 1)
        for chunk in progress(chunks, desc=f"{len(positions)} edges", unit="forward"):
            chosen = torch.zeros(len(chunk), len(index), dtype=torch.bool)
            chosen[torch.arange(len(chunk)), torch.tensor([positions[j] for j in chunk])] = True
            first = min(layers[j] for j in chunk) if prefix.enabled else 0
            with _Patcher(model, source, index.masks(chosen), index, base=own).active():
                with prefix.replaying(first, len(chunk)):
                    output = _run(model, base, len(chunk), **keep)
                if first > 0 and prefix.enabled and not checked:  # the first replayed forward, checked once
                    checked = True
                    full = _run(model, base, len(chunk), **keep)
                    prefix.enabled = _same_output(output, full)
                    output, first = (output, first) if prefix.enabled else (full, 0)
            blocks += len(chunk) * (n_blocks - min(first, n_blocks))
            for i, j in enumerate(chunk):
                effects[j] = float(metric(slice_output(output, i * b, (i + 1) * b, len(chunk) * b), base)) - value
    df = edge_frame([index.edges[e] for e in positions])[["upstream", "downstream", "input"]]
    df["effect"] = effects
    df.attrs.update(run=value, forwards=len(chunks), block_fraction=blocks / max(1, len(positions) * n_blocks))
    return df
