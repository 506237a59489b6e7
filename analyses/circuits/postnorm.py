"""Edge circuits on post-norm blocks (BERT, MiniLM, RoBERTa, DistilBERT): each node's contribution carried through
every later norm with the run's own centring and scale.

A post-norm block ``l`` computes ``h_l = N1(x_l + attn_out)`` then ``x_{l+1} = N2(h_l + mlp_out)``, each norm
``N(y) = w * C(y) / s(y) + beta`` (``C`` the centring of a LayerNorm, none for an RMSNorm; ``s`` the run's own
standard deviation, or root mean square, of ``y`` per token). ``C`` is linear and ``w / s`` multiplies, so
``N(sum of parts) = sum of (w * C(part) / s) + beta``: each part of the stream can be carried through the norm on
its own, with that run's ``s``. A node's **contribution** to a stream is its output (a head's result, an MLP's
output, the first block's input) carried so through every norm between where it is added and that stream.

Constants. The output projection's bias and each norm's beta are added alike in every run, but once carried
through a later norm they are divided by that run's scale, so they differ between runs (a constant left out of
every node would keep the receiving run's scale, and no patched run could give the other run). They belong to the
``"input"`` node: its contribution is the first block's input plus every bias the blocks add outside a node (the
attention output projection's bias before ``N1``, each norm's beta after it; an MLP's output bias is in the MLP's
output), carried alike. The stream a receiver reads is then exactly the sum of its upstream nodes' contributions in
every run, so an edge ``u -> r`` swaps ``u``'s contribution to the stream ``r`` reads for ``u``'s contribution to
that stream in the source run (its output carried with the source run's scales), as sandwich norms do: every edge
patched gives the source run, none the run itself.

Where receivers read (``graph.reading``): a head's q, k, v the block's input as it is (no pre-norm); an MLP the
post-attention stream ``h_l``, at the input of the module that reads it (BERT's ``intermediate``, DistilBERT's
``ffn``), not the residual add; the metric (``"logits"``) the last block's output, which is already normed (no
final norm): at the output of that block's ``N2``, which the model's head reads (a masked-LM head, or the pooler and
classifier on the first token).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import NamedTuple

import torch

from interp.structure.norms import norm_bias, norm_centres, norm_scale, norm_weight
from interp.structure.probe import _close, _is_norm, _probe_ids, probe

__all__ = ["Carrier", "carried_differences", "last_norm", "mlp_input", "norm_steps", "post_norm_layout",
           "recording_scales", "replayable_blocks"]

_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def post_norm_layout(model) -> list[tuple[str, str]]:
    """Per block, ``(path of N2, path of the module the MLP reads h_l through)`` under the block, found by one probe
    forward (kept per model), or a one-line error where the block is not ``N2(N1(x + attn_out) + mlp_out)``."""
    hf = model.hf
    if hf in _LAYOUTS:
        return _LAYOUTS[hf]
    s = model.structure
    _, log = probe(hf, lambda: hf(input_ids=_probe_ids(hf, 6)))
    found = []
    for l, block in enumerate(model._blocks):
        names = {m: n for n, m in block.named_modules()}
        why = "" if s.resid_mid[l] is not None and s.mlp[l] is not None and s.o_proj[l] is not None else \
            "interp found no norm after attention, no MLP or no output projection"
        n1 = block.get_submodule(s.resid_mid[l][0]) if not why else None
        y = log.outputs.get(block)
        n2 = next((m for m in block.modules() if m is not block and _is_norm(m) and y is not None
                   and log.outputs.get(m) is y), None)
        inside = set(block.get_submodule(s.attn[l]).modules())
        h = log.outputs.get(n1)
        reads = [m for m in block.modules() if m not in (block, n1, n2) and m not in inside and h is not None
                 and log.inputs.get(m) is h]
        if not why and (n2 is None or not reads):
            why = ("its output is not a norm's output" if n2 is None
                   else "no module reads the normed stream after attention")
        if not why:
            x, a = log.inputs[block].float(), log.outputs[block.get_submodule(s.o_proj[l])].float()
            mlp = log.outputs[block.get_submodule(s.mlp[l])].float()
            tol = 1e-4 * max(float(x.abs().max()), float(h.abs().max()), 1.0)
            if not (_close(log.inputs[n1], x + a, tol) and _close(log.inputs[n2], h.float() + mlp, tol)):
                why = "its norms do not read the stream plus the attention's (or the MLP's) output"
        if why:
            raise ValueError(f"Edge circuits on post-norm blocks carry each node through N2(N1(x + attention) + MLP); "
                             f"block {l} of {type(hf).__name__} does not have that form ({why}), not supported.")
        mlp_in = min(reads, key=lambda m: (names[m].count("."), log.order[m]))
        found.append((names[n2], names[mlp_in]))
    _LAYOUTS[hf] = found
    return found


def last_norm(model) -> torch.nn.Module:
    """The last block's output norm: its output is the stream the metric reads."""
    return model._blocks[-1].get_submodule(post_norm_layout(model)[-1][0])


def mlp_input(model, layer: int) -> torch.nn.Module:
    """The module through which block ``layer``'s MLP reads the stream after attention."""
    return model._blocks[layer].get_submodule(post_norm_layout(model)[layer][1])


def is_post_norm(model) -> bool:
    """Whether the model is one stream of post-norm blocks (an encoder-decoder has no ``structure``)."""
    return model.structure is not None and model.structure.kind == "post-norm"


def replayable_blocks(model) -> int:
    """How many blocks may be replayed from a recorded run before a receiver in the last layer: all but the last for a
    post-norm model (the metric reads the last block's own norm), else all."""
    return len(model._blocks) - is_post_norm(model)


class Step(NamedTuple):
    """One norm on the stream, in the order the model runs them: ``N1`` of block ``layer`` (``after`` "attn") or
    ``N2`` (``after`` "mlp"); ``bias``: the constant the block adds before it outside any node (the output
    projection's bias before ``N1``), in float64, or None."""

    module: torch.nn.Module
    layer: int
    after: str
    weight: torch.Tensor
    beta: torch.Tensor | None
    centres: bool
    bias: torch.Tensor | None


def norm_steps(model) -> list[Step]:
    """The norms on the stream in run order (``2 * layers``), empty for a model that is not post-norm."""
    if not is_post_norm(model):
        return []
    s, steps = model.structure, []
    for l, (n2, _) in enumerate(post_norm_layout(model)):
        block = model._blocks[l]
        bias = getattr(model.o_proj_of(model.cfg.sites[l]), "bias", None)
        for norm, after, b in ((block.get_submodule(s.resid_mid[l][0]), "attn", bias),
                               (block.get_submodule(n2), "mlp", None)):
            steps.append(Step(norm, l, after, norm_weight(norm, s.d_model), norm_bias(norm, s.d_model),
                              norm_centres(norm, s.d_model), None if b is None else b.detach().double()))
    return steps


def _scale_key(j: int) -> str:
    return f"postnorm.scale.{j}"


@contextmanager
def recording_scales(model, store: dict, enabled: bool = True):
    """While open, each run's norm scales ``(b, p, 1)`` (float32) written into ``store`` (nothing for a model that is
    not post-norm)."""
    steps = norm_steps(model) if enabled else []

    def keep(j):
        def pre(module, args):
            with torch.no_grad():  # a record, not part of the run's graph (nor of a recomputed block's)
                store[_scale_key(j)] = norm_scale(module, args[0])
        return pre

    handles = [step.module.register_forward_pre_hook(keep(j)) for j, step in enumerate(steps)]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _entered(nodes, j: int) -> int:
    """How many of ``nodes`` (in the order the model computes them) are added to the stream before norm ``j``: the
    input first, block l's heads before its ``N1`` (norm ``2 l``), its MLP before its ``N2`` (``2 l + 1``)."""
    return sum(1 for u in nodes if (-1 if u.kind == "input" else 2 * u.layer + (u.kind == "mlp")) <= j)


def _carry(stack: torch.Tensor, step: Step, scale: torch.Tensor, n: int) -> None:
    """Rows ``[:n]`` of ``stack`` ``(c, N, t, m)`` carried in place through ``step`` with ``scale`` ``(c or 1, 1, t,
    1)``; row 0 is the input node, which takes the constants."""
    part = stack[:, :n]
    like = dict(dtype=stack.dtype, device=stack.device)
    if step.bias is not None:
        part[:, 0] += step.bias.to(**like)
    if step.centres:
        part -= part.mean(-1, keepdim=True)
    part *= step.weight.to(**like) / scale.to(**like)
    if step.beta is not None:
        part[:, 0] += step.beta.to(**like)


def _scale(store: dict, j: int, t: int) -> torch.Tensor:
    return store[_scale_key(j)].reshape(1, 1, t, 1)


class Carrier:
    """For a patched run of a post-norm model over ``c`` copies: every sender's contribution in that run and in the
    source run, carried to the stream the run is at (``Step`` by ``Step``, each run with its own scales), whose
    difference is what a patched edge adds. Senders enter raw (``fill``) before the norm they are added before; a
    norm that does not run (a block replayed from ``base``) is carried with ``base``'s scales when the next one
    runs; a norm before the last one carried starts a new forward."""

    def __init__(self, model, nodes, source: dict, base: dict | None):
        if nodes[0].kind != "input":
            raise ValueError("Post-norm edge patching needs the input node first among the senders.")
        self.steps, self.nodes, self.source, self.base = norm_steps(model), nodes, source, base
        self.m = model.cfg.d_model

    def allocate(self, copies: int, width: int, like: torch.Tensor) -> None:
        self.run = like.new_zeros(copies, width, like.numel() // self.m, self.m)
        self.src = like.new_zeros(1, width, like.numel() // self.m, self.m)
        self.raw, self.done, self.diff = torch.zeros_like(self.src), 0, None  # raw: the source's outputs
        self.entered = [_entered(self.nodes[:width], j) for j in range(len(self.steps))]

    def fill(self, i: int, run: torch.Tensor, source: torch.Tensor) -> None:
        """Sender ``i``'s raw output in the run ``(c or 1, t * m)`` and in the source run ``(1, t * m)``."""
        self.run[:, i] = run.reshape(run.shape[0], *self.run.shape[2:])
        self.src[:, i] = self.raw[:, i] = source.reshape(self.src.shape[2:])
        self.diff = None

    def difference(self) -> torch.Tensor:
        """``(c, width, t * m)``: each sender's source contribution less its run contribution, at this stream."""
        if self.diff is None:
            self.diff = (self.src - self.run).flatten(2)
        return self.diff

    def _step(self, j: int, run_scale: torch.Tensor) -> None:
        t, n = self.run.shape[2], self.entered[j]
        _carry(self.run, self.steps[j], run_scale.reshape(-1, 1, t, 1), n)
        _carry(self.src, self.steps[j], _scale(self.source, j, t), n)
        self.done, self.diff = j + 1, None

    def _upto(self, j: int) -> None:
        """Carried through norms ``[:j]``: a norm already passed starts a new (full) forward, from the source's raw
        outputs again (the run's are refilled as it goes); those of blocks replayed from the base run with its
        scales."""
        if j < self.done:
            self.src.copy_(self.raw)
            self.done = 0
        while self.done < j:
            self._step(self.done, _scale(self.base, self.done, self.run.shape[2]))

    def hooks(self, blocks) -> list[tuple[torch.nn.Module, object]]:
        """Forward pre-hooks: at each block's input (its q, k and v read the stream there) and at each norm."""
        def enter(l):
            def hook(module, args):
                self._upto(2 * l)
            return hook

        def pre(j):
            def hook(module, args):
                self._upto(j)
                self._step(j, norm_scale(module, args[0]))
            return hook
        return ([(block, enter(l)) for l, block in enumerate(blocks)]
                + [(step.module, pre(j)) for j, step in enumerate(self.steps)])


def _stream_of(model, key) -> int:
    """How many norms lie before the stream read under ``key`` (``graph.reading``'s keys)."""
    if key == "final":
        return 2 * len(model._blocks)
    if isinstance(key, tuple):  # ("mlp", layer): the stream after N1
        return 2 * key[1] + 1
    return 2 * model.sites[key].block


def carried_differences(model, nodes, outputs, stores, rows: slice, keys):
    """``(keys, (N, b * c * m))`` pairs: the clean less the corrupted node contributions to the stream the ``keys``
    read (at positions ``rows``), from the node outputs ``outputs`` ``(N, b, c, m)`` of the two runs and their
    stores (with ``recording_scales``' scales). Not post-norm: one pair, the outputs' difference for every key."""
    steps = norm_steps(model)
    if not steps:
        yield list(keys), (outputs[0] - outputs[1]).flatten(1)
        return
    at = {key: _stream_of(model, key) for key in keys}
    runs = [o.reshape(1, o.shape[0], -1, o.shape[-1]).clone() for o in outputs]  # (1, N, b * c, m)
    for k in range(len(steps) + 1):
        if k:
            for run, store in zip(runs, stores):
                scale = store[_scale_key(k - 1)][:, rows].reshape(1, 1, -1, 1)
                _carry(run, steps[k - 1], scale, _entered(nodes, k - 1))
        here = [key for key in keys if at[key] == k]
        if here:
            yield here, (runs[0] - runs[1]).reshape(len(nodes), -1)
