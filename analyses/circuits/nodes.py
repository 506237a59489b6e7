"""The graph's data: an upstream node (``Node``), a downstream input (``Receiver``) and where a receiver reads the
residual stream (``Reading``). What they mean and where they come from: ``analyses.circuits.graph``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["Node", "Reading", "Receiver"]


@dataclass(frozen=True, order=True)
class Node:
    """An upstream node: ``kind`` ``"input"``, ``"head"`` (``site``, ``head``) or ``"mlp"`` (``layer``)."""

    kind: str
    layer: int = -1  # the block it sits in (-1: the input)
    site: str = ""
    head: int = -1
    stack: str = ""  # an encoder-decoder model's "encoder" or "decoder" (whose stream the node writes); else ""

    @property
    def name(self) -> str:
        at = f"{self.stack}." if self.stack else ""
        return {"input": f"{at}input", "head": f"{self.site}:{self.head}", "mlp": f"{at}mlp.{self.layer}"}[self.kind]


@dataclass(frozen=True, order=True)
class Receiver:
    """A downstream input: ``input`` in q/k/v (``site``, ``head``; k and v: the key/value head), ``"mlp"`` (``layer``)
    or ``"logits"``."""

    input: str
    layer: int = -1
    site: str = ""
    head: int = -1
    stack: str = ""  # an encoder-decoder model's stack the receiver sits in; else ""

    @property
    def name(self) -> str:
        if self.input in ("q", "k", "v"):
            return f"{self.site}:{self.head}.{self.input}"
        return (f"{self.stack}." if self.stack else "") + f"mlp.{self.layer}" if self.input == "mlp" else "logits"


class Reading(NamedTuple):
    """Where a receiver reads the residual stream, for the runs that patch it and the backward that differentiates
    it. ``kind``: ``"stream"`` (the input of ``module``, which is what the receiver reads through: the final norm,
    the norm before a pre-norm block's MLP, the MLP itself where it has none, a post-norm block's MLP's first
    module), ``"output"`` (the output of ``module``: a post-norm model's last norm, which the metric reads),
    ``"mlp_input"`` (a parallel block's MLP, whose input is ``norm`` of the block's input, grabbed at ``grab``) or
    ``"columns"`` (a head's q, k or v: the columns ``cols`` of ``module``'s output, ``compute(norm(x))`` from the
    stream ``x`` grabbed at the input of ``grab``; ``norm`` None where the attention reads the stream as it is;
    ``weight``: the columns' linear map ``(e, m)`` from the normed stream where ``compute`` is one, so that a gradient
    at the columns is carried back as ``g @ weight``, else None). ``key`` names the grabbed stream (shared by the
    receivers that read the same one)."""

    kind: str
    key: object
    grab: torch.nn.Module
    norm: torch.nn.Module | None
    module: torch.nn.Module
    cols: slice | None = None
    compute: object = None
    weight: torch.Tensor | None = None
