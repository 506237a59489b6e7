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

Post-norm blocks (``analyses.circuits.postnorm``): ``a_u`` is ``u``'s contribution to the stream ``v`` reads (its
output carried through the norms between, with the clean run's scales for ``a_u(clean)`` and the corrupted run's for
``a_u(corrupted)``), the chunk's node outputs carried stream by stream as the contraction walks the norms.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import pandas as pd
import torch

from hooks.names import hook_name
from interp.runtime.progress import progress

from ..causal.attribution import _contiguous_output_layer
from ..causal.engine import _arguments, _run, all_blocks, kept_logits, recomputing
from ..causal.patching import paired_batches, scalar_metric
from .graph import Node, Receiver, edge_frame, graph_edges, node_readers, senders
from .patching import node_hook
from .postnorm import carried_differences, norm_steps, recording_scales
from .taps import EarlyContraction, Taps, Ticking

__all__ = ["METHODS", "edge_attribution"]

METHODS = ("eap", "eap-ig")
_CHUNK_ELEMENTS = 1 << 25  # elements of one chunk's stacked node differences (128 MiB in fp32)
_RECOMPUTE_TOKENS = 4096  # batch x positions from which the gradient runs recompute each block in the backward
_SUMMED_ELEMENTS = 1 << 26  # receivers x tokens x d_model up to which the steps' gradients are summed, then
                            # contracted once (256 MiB in fp32); above it each step is contracted as it ends


def _interpolate(clean_input: torch.Tensor, alpha: float, moved: dict):
    def hook(act, point):  # the corrupted run's input embeddings moved alpha of the way to the clean ones
        # plus a zero that needs a gradient: the backward starts from the metric, not from a leaf module input
        # (torch's FlopCounterMode, and module backward hooks, refuse autograd.grad into a leaf a module reads)
        zero = torch.zeros((), dtype=act.dtype, device=act.device, requires_grad=True)
        out = (act + alpha * (clean_input.to(act.dtype) - act)).detach() + zero
        moved[point.name] = (zero, out)  # per input (an encoder-decoder model has two)
        return out
    return hook


# -- every node's output, kept compactly --------------------------------------------------------------------------
def _compact_names(model) -> tuple[list[str], list[str]]:
    """What a run keeps to rebuild every node's output: the inputs (the first block's input, of each stack in an
    encoder-decoder model), then each site's z and each MLP's output."""
    nodes = senders(model)
    names = [hook_name("z", s.name) for s in model.cfg.sites] + [node_hook(u) for u in nodes if u.kind == "mlp"]
    return [node_hook(u) for u in nodes if u.kind == "input"], names


def _keeping(store: dict):
    def hook(act, point):
        store[point.name] = act.detach()
    return hook


def _output_weight(model, site) -> torch.Tensor:
    """The output projection as ``(m, h * e)``: head ``h``'s result is ``z_h @ W[:, h's columns].T``."""
    o = model.o_proj_of(site)
    if o is None:
        raise ValueError(f"Edge attribution reads each head's output through {site.name}'s output projection; this "
                         "site has none.")
    return o.weight.float() if isinstance(o, torch.nn.Linear) else o.weight.float().T  # GPT-2's Conv1D: (h * e, m)


def _node_values(model, nodes: list[Node], stores: tuple, weights: tuple, rows: slice, read: dict) -> torch.Tensor:
    """``(N, b, c, m)``: every node's output at positions ``rows``, rebuilt from runs' compact stores (a head's: its
    ``z`` through its columns of the output projection, without the bias, as ``hook_result`` has it), read as
    ``node_readers`` says (sandwich norms), and summed over the runs with ``weights`` (``(1,)``: one run's outputs;
    ``(1, -1)``: the clean less the corrupted). Where a head's output is linear in its ``z`` (no reader), the
    weighted ``z`` goes through the projection once."""
    out: list = [None] * len(nodes)
    sites: dict[str, list[int]] = {}

    def combined(values, fn):
        return sum(w * fn(v) for w, v in zip(weights, values))

    for i, node in enumerate(nodes):
        if node.kind == "head":
            sites.setdefault(node.site, []).append(i)
            continue
        name = node_hook(node)
        out[i] = combined([store[name][:, rows].float() for store in stores], read.get(name, lambda v: v))
    for site_name, index in sites.items():
        site, name = model.sites[site_name], hook_name("result", site_name)
        zs = [store[hook_name("z", site_name)][:, rows].float() for store in stores]  # (b, c, h, e)
        w = _output_weight(model, site).reshape(-1, site.n_heads, zs[0].shape[-1])  # (m, h, e)
        if name in read:
            result = combined(zs, lambda z: read[name](torch.einsum("bche,mhe->bchm", z, w)))
        else:
            result = torch.einsum("bche,mhe->bchm", combined(zs, lambda z: z), w)
        for i in index:
            out[i] = result[:, :, nodes[i].head]
    return torch.stack(out)


def edge_attribution(model, clean, corrupted, metric, method: str = "eap-ig", steps: int = 5,
                     recompute: bool | None = None) -> pd.DataFrame:
    """Score every edge of the model's graph (``analyses.circuits.graph``) by EAP or EAP-IG.

    clean, corrupted: inputs of the same shape (as for ``activation_patching``). metric: ``metric(output, inputs)``
    with a gradient (``analyses.data.metrics``: ``logit_difference``, ...), taken as the mean over examples. method:
    ``"eap"`` or ``"eap-ig"``; steps: EAP-IG's interpolation points. recompute: keep only each block's input for
    the backward and run the block again when the backward reaches it (``analyses.causal.engine.recomputing``): the
    same scores, one more forward's time, the memory of the block inputs and one block's activations instead of
    every block's; ``None`` (the default) recomputes from ``_RECOMPUTE_TOKENS`` tokens (batch x positions) on.

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
    if recompute is not None and not isinstance(recompute, bool):
        raise ValueError(f"recompute must be True, False or None (from {_RECOMPUTE_TOKENS} tokens on); got "
                         f"{recompute!r}.")
    steps = 1 if method == "eap" else steps
    edges = graph_edges(model)
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    keep = kept_logits(model, metric, corrupted)
    receivers = list(dict.fromkeys(r for _, r in edges))
    nodes = senders(model, edges)
    node_at = {u: i for i, u in enumerate(nodes)}
    spans: dict[str, list] = {}  # per residual stream (an encoder-decoder's two): its nodes' span and its keys
    for i, u in enumerate(nodes):
        spans.setdefault(u.stack, [i, i, {}])[1] = i + 1
    stream_of = {r: u.stack for u, r in edges}
    receiver_at = {r: j for j, r in enumerate(receivers)}
    # the senders each receiver can read: nodes are in the order the model computes them
    reach: dict[Receiver, int] = {}
    for u, r in edges:
        reach[r] = max(reach.get(r, 0), node_at[u] + 1)
    scores = torch.zeros(len(nodes), len(receivers), dtype=torch.float64)
    (inputs, rest), read = _compact_names(model), node_readers(model)
    names, shape = inputs + rest, tuple(corrupted["input_ids"].shape[:2])
    if recompute is None:
        recompute = max(shape[0] * shape[1], shape[0] * _decoder_length(corrupted)) >= _RECOMPUTE_TOKENS
    blocks = all_blocks(model)
    bar = progress(total=len(blocks) * (1 + 2 * steps), desc=f"{method}: blocks run, then differentiated",
                   unit="block")
    with model.studying(), Ticking(blocks, bar):
        with torch.no_grad():
            args, kwargs = _arguments(clean)
            with recording_scales(model, {}) as clean_scales:  # post-norm: each norm's scale, to carry the nodes
                out, cache = model.run_with_cache(*args, names=names, **kwargs, **keep)
            clean_value, clean_store = metric(out, clean), {**{name: cache[name] for name in names}, **clean_scales}
            del out, cache
        for p in model.hf.parameters():
            p.requires_grad_(False)
        corrupted_store, moved, summed = {}, {}, {}
        b, p, m = max((clean_store[name].shape for name in inputs), key=lambda shape: shape[1])
        small = len(receivers) * b * p * m <= _SUMMED_ELEMENTS
        for k in range(steps):
            taps = Taps(model, receivers, shape)
            for key, receivers_of in taps.groups.items():
                spans[stream_of[receivers_of[0]]][2][key] = True
            contract = partial(_contract, model, gradients=taps.stream_gradients, nodes=nodes,
                               stores=(clean_store, corrupted_store), read=read, receiver_at=receiver_at,
                               reach=reach, scores=scores, spans=spans, steps=steps)
            # each step contracted as it ends (not small): during the backward where it can be
            early = EarlyContraction(model, taps, contract) if not small and EarlyContraction.applies(model) \
                else None
            hooks = [(name, _interpolate(clean_store[name], k / steps, moved)) for name in inputs]
            if k == 0:  # alpha 0 is the corrupted run itself: its node outputs are read on the way
                hooks.append((rest, _keeping(corrupted_store)))
            with torch.enable_grad():
                with model.hooks(hooks), taps, early or nullcontext(), _contiguous_output_layer(model), \
                        recomputing(model, recompute), recording_scales(model, corrupted_store, enabled=k == 0):
                    out = _run(model, corrupted, **keep)
                    if k == 0:
                        corrupted_store.update({name: moved[name][1].detach() for name in inputs})
                value = metric.per_example(out, corrupted).float().mean()
                if not value.requires_grad:
                    raise TypeError(f"edge_attribution differentiates the metric; {metric.name} returned a value "
                                    "without a gradient. Use a metric from analyses.data.metrics or one returning a "
                                    "tensor computed from the model's output.")
                torch.autograd.grad(value, [zero for zero, _ in moved.values()], allow_unused=True)
            if k == 0:
                with torch.no_grad():
                    corrupted_value = metric(out, corrupted)
            del out, value
            moved.clear()
            if not taps.any_nonzero():
                raise ValueError(f"edge_attribution scores edges by the metric's gradient at each input of the graph; "
                                 f"{metric.name}'s gradient is 0 at every one (it does not depend on the model's "
                                 "heads, MLPs or input). Use a metric computed from the logits the graph feeds.")
            if small:  # the steps' stream gradients summed: one contraction at the end, as many products as EAP's
                for key in taps.groups:
                    receivers_of, g = taps.stream_gradients(key, slice(None))
                    if g is not None:
                        summed[key] = (receivers_of, g / steps + (summed[key][1] if key in summed else 0.0))
            elif early is not None:
                early.flush()  # whatever the backward did not reach
            else:
                contract(taps.groups)
            del taps, early, contract
        if small:
            _contract(model, {key: found[0] for key, found in summed.items()},
                      gradients=lambda key, rows: (summed[key][0], summed[key][1][:, :, rows]), nodes=nodes,
                      stores=(clean_store, corrupted_store), read=read, receiver_at=receiver_at, reach=reach,
                      scores=scores, spans=spans, steps=1)
    bar.close()
    df = edge_frame(edges)
    df["score"] = [float(scores[node_at[u], receiver_at[r]]) for u, r in edges]
    df["abs_score"] = df["score"].abs()
    df.attrs.update(method=method, steps=steps, metric=metric.name, clean=clean_value, corrupted=corrupted_value)
    return df


def _decoder_length(batch) -> int:
    decoder = batch.get("decoder_input_ids")
    return 0 if decoder is None else int(decoder.shape[1])


def _contract(model, keys: dict, *, gradients, nodes, stores, read, receiver_at, reach, scores, spans,
              steps: int) -> None:
    """``scores[u, v] += (a_u(clean) - a_u(corrupted)) . d metric / d x_v / steps``, summed over the batch and
    positions, a chunk of positions at a time (a chunk's stacked node outputs stay under ``_CHUNK_ELEMENTS``), each
    receiver against the senders it can read only. ``keys``: the streams to contract, each with the receivers
    reading it; ``gradients(key, rows)``: those receivers and their gradients ``(R, b, c, m)`` at positions
    ``rows`` (or None). ``spans``: per residual stream (an encoder-decoder model's encoder and decoder have their
    own lengths) ``[first node, end, {keys reading it}]``."""
    with torch.no_grad():
        for first, end, reading_it in spans.values():
            wanted = [key for key in keys if key in reading_it]
            if not wanted:
                continue
            if not norm_steps(model):  # only the senders these receivers read (post-norm: carried through all)
                end = min(end, max(reach[r] for key in wanted for r in keys[key]))
            b, p, m = stores[0][node_hook(nodes[first])].shape
            chunk = max(1, _CHUNK_ELEMENTS // max(1, (end - first) * b * m))
            for start in range(0, p, chunk):
                rows = slice(start, min(p, start + chunk))
                here = nodes[first:end]
                if norm_steps(model):  # post-norm (one stream): each run's outputs carried with its own scales
                    outputs = [_node_values(model, here, (store,), (1.0,), rows, read) for store in stores]
                    pairs = carried_differences(model, here, outputs, stores, rows, keys)
                else:
                    pairs = [(list(keys), _node_values(model, here, stores, (1.0, -1.0), rows, read).flatten(1))]
                for read_here, diff in pairs:  # (N, b * c * m) at the stream the keys read
                    for key in (key for key in read_here if key in reading_it):
                        receivers, g = gradients(key, rows)
                        if g is None:
                            continue
                        n = max(reach[r] for r in receivers)
                        found = (g.flatten(1) @ diff[:n - first].T).double().T / steps  # (n, R)
                        scores[first:n, [receiver_at[r] for r in receivers]] += found
