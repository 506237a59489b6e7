"""The backward of edge attribution: each receiver's gradient from one backward of the run (``Taps``: the gradient
where the receiver's reading of the stream goes on, carried back through its weights and norm a chunk of positions
at a time), the scores taken during the backward a few blocks at a time (``EarlyContraction``) and its progress
(``Ticking``). ``analyses.circuits.attribution`` runs them."""

from __future__ import annotations

import torch

from .graph import Receiver, reading
from .postnorm import norm_steps

TAPS_BYTES = 1 << 30  # the receivers' streams and gradients held in the backward before their scores are taken


class Taps:
    """Hooks of one run that keep, for each stream a receiver reads (``reading``), that stream and the gradient where
    the receiver's reading of it goes on: the output columns of its q, k or v, the output of the norm (or MLP) it
    reads through, a parallel block's MLP input, or (post-norm, the metric) the stream itself at the last norm. Each
    receiver's gradient with respect to its own input stream is then that gradient carried back through what it
    reads the stream with, a chunk of positions at a time."""

    def __init__(self, model, receivers: list[Receiver], shape):
        self.model, self.shape, self.x, self.grad, self.handles = model, shape, {}, {}, []
        self.dropped_nonzero = False  # a gradient let go of (``drop``) was not all zero
        self.reads = {r: reading(model, r) for r in receivers}
        self.groups: dict[object, list[Receiver]] = {}
        for r, read in self.reads.items():
            self.groups.setdefault(read.key, []).append(r)

    def _grab(self, key):
        def pre(module, args):
            self.x[key] = args[0].detach()
        return pre

    def _output_grad(self, key):
        def post(module, args, out):
            if out.requires_grad:
                out.register_hook(lambda g: self.grad.__setitem__(key, g.detach()))
        return post

    def _input_grad(self, key):
        def pre(module, args):  # an alias of the input, so that its gradient is the one through this module only
            if not args[0].requires_grad:
                return None
            alias = args[0].view_as(args[0])
            alias.register_hook(lambda g: self.grad.__setitem__(key, g.detach()))
            return (alias, *args[1:])
        return pre

    def __enter__(self):
        done = set()
        for r, read in self.reads.items():
            if read.key not in done:
                done.add(read.key)
                self.handles.append(read.grab.register_forward_pre_hook(self._grab(read.key)))
            tap = (read.key, id(read.module))
            if tap in done:
                continue
            done.add(tap)
            if read.kind == "mlp_input":
                self.handles.append(read.module.register_forward_pre_hook(self._input_grad(tap)))
            else:
                self.handles.append(read.module.register_forward_hook(self._output_grad(tap)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _held(self, keys) -> list:
        return [(k, self.x) for k in keys if k in self.x] + [(t, self.grad) for t in self.grad if t[0] in keys]

    def held_bytes(self, keys) -> int:
        return sum(where[k].numel() * where[k].element_size() for k, where in self._held(set(keys)))

    def drop(self, keys) -> None:
        """Let go of the streams and gradients of ``keys`` (their scores are in)."""
        for k, where in self._held(set(keys)):
            if where is self.grad:
                self.dropped_nonzero = self.dropped_nonzero or bool(where[k].any())
            del where[k]

    def any_nonzero(self) -> bool:
        return self.dropped_nonzero or any(bool(g.any()) for g in self.grad.values())

    def _rows(self, t: torch.Tensor, rows: slice) -> torch.Tensor:
        """``t`` as ``(b, p, ...)`` (a module run on ``(b * p, m)``, OPT's MLP, reshaped) at positions ``rows``."""
        if t.ndim == 2:
            t = t.reshape(self.shape[0], -1, t.shape[-1])  # its own stream's positions (an encoder-decoder's two)
        return t[:, rows]

    def stream_gradients(self, key, rows: slice) -> tuple[list[Receiver], torch.Tensor | None]:
        """The receivers reading stream ``key`` and ``(R, b, c, m)``: each one's gradient with respect to its own
        input stream at positions ``rows`` (None where the backward reached none of them). A head's columns that are
        a linear map of the normed stream are carried back by their weight (``g @ W[cols]``), and through the norm
        together, one batched backward of the norm for the receivers that share it; anything else by autograd
        through what the receiver computes."""
        receivers, x = self.groups[key], self.x.get(key)
        if x is None:
            return receivers, None
        x = self._rows(x, rows).detach()
        out, normed, norm = [], [], None
        for r in receivers:
            read = self.reads[r]
            g = self.grad.get((key, id(read.module)))
            if g is None:
                out.append(torch.zeros(x.shape, dtype=torch.float32, device=x.device))
                continue
            g = self._rows(g, rows)
            if read.kind == "output":  # the stream itself (a post-norm model's last norm's output)
                out.append(g.float())
                continue
            if read.kind == "columns" and read.weight is not None:
                found = g[..., read.cols].to(read.weight.dtype) @ read.weight  # at the normed stream
                if read.norm is not None:
                    normed.append(len(out))
                    norm = read.norm
                out.append(found)
                continue
            with torch.enable_grad():
                xs = differentiable(x)
                if read.kind == "columns":
                    value, g = read.compute(xs if read.norm is None else read.norm(xs)), g[..., read.cols]
                elif read.kind == "mlp_input":
                    value = read.norm(xs)
                else:
                    value = read.module(xs)
                (found,) = torch.autograd.grad(value, xs, g.to(value.dtype))
            out.append(found.float())
        if normed:  # one backward of the shared norm for every receiver reading through it
            with torch.enable_grad():
                xs = differentiable(x.expand(len(normed), *x.shape).reshape(-1, *x.shape[1:]))
                value = norm(xs)
                cotangent = torch.cat([out[i].to(value.dtype) for i in normed])
                (found,) = torch.autograd.grad(value, xs, cotangent)
            for i, g in zip(normed, found.float().reshape(len(normed), *x.shape)):
                out[i] = g
        return receivers, torch.stack([g.float() for g in out])


class Ticking:
    """Progress of a long attribution (minutes at 32k tokens): one tick per block run, and one per block the backward
    reaches (when the gradient at its output is complete)."""

    def __init__(self, blocks: list, bar):
        self.blocks, self.bar, self.handles = blocks, bar, []

    def _tick(self, module, args, out):
        self.bar.update(1)
        y = out[0] if isinstance(out, (tuple, list)) else out
        if torch.is_grad_enabled() and isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(lambda g: self.bar.update(1))

    def __enter__(self):
        self.handles = [b.register_forward_hook(self._tick) for b in self.blocks]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


class EarlyContraction:
    """Scores contracted during the backward, as soon as the backward has reached a block's input (so every
    receiver in that block and above has its gradient), whenever the streams and gradients those receivers hold
    pass ``TAPS_BYTES`` (and at the first block), and those then let go of: the backward holds a few blocks' taps
    instead of every block's. One stack of pre-norm or parallel blocks (post-norm carries nodes through every norm,
    an encoder-decoder's decoder reads the encoder's stream: those contract after the backward)."""

    def __init__(self, model, taps: Taps, contract):
        self.blocks, self.taps, self.contract = list(model._blocks), taps, contract
        self.block_of = {key: max(r.layer for r in rs) for key, rs in taps.groups.items()}
        self.pending, self.handles = set(self.block_of), []

    @staticmethod
    def applies(model) -> bool:
        return not isinstance(model._blocks, dict) and not norm_steps(model)

    def __enter__(self):
        self.handles = [block.register_forward_pre_hook(self._watch(l), with_kwargs=True)
                        for l, block in enumerate(self.blocks)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _watch(self, layer: int):
        def pre(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda g: self._reached(layer))
        return pre

    def _reached(self, layer: int) -> None:
        complete = [key for key in self.pending if self.block_of[key] >= layer]
        if complete and (layer == 0 or self.taps.held_bytes(complete) >= TAPS_BYTES):
            self.flush(complete)

    def flush(self, keys=None) -> None:
        keys = [key for key in (self.pending if keys is None else keys) if key in self.pending]
        if keys:
            self.contract({key: self.taps.groups[key] for key in keys})
            self.taps.drop(keys)
            self.pending -= set(keys)


def differentiable(x: torch.Tensor) -> torch.Tensor:
    """``x`` plus a zero that needs a gradient, not a leaf: module hooks (FlopCounterMode's) refuse a leaf."""
    return x + torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
