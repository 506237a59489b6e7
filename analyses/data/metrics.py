"""Metrics for ablation and pruning studies: ``metric(output, inputs) -> float``.

``output`` is what the hooked model returns (a HF ``ModelOutput``), ``inputs`` the batch it ran on:
``{"input_ids": (b, p), "attention_mask": (b, p) or None}``. Any such callable works in the studies; the
ready-made ones below are ``Metric`` objects, which also give per-example values (the batched ablation
scan compares them copy by copy) and a differentiable per-example ``loss`` for ``head_importance``.

>>> out = type("Out", (), {"logits": torch.tensor([[[0.0, 2.0, -1.0]]])})()
>>> logit_difference(1, 2)(out, {"input_ids": torch.tensor([[0]]), "attention_mask": None})
3.0
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .batches import Batch, _main_output, _mask, batch_of, check_position

__all__ = ["Metric", "as_metric", "lm_loss", "first_copy_loss", "second_copy_loss", "logit_difference",
           "embedding_similarity", "mean_pool", "next_token_loss", "target_accuracy", "target_loss"]

def _arguments(metric, output, inputs) -> tuple[Any, Mapping]:
    """``(output, inputs)`` as every metric reads them: inputs as a batch ``{"input_ids": (b, p), ...}`` (token ids
    ``(b, p)`` or ``(p,)`` are wrapped), output as the model's output (a hooked model in its place is run on the
    inputs). A wrong argument is named, with the call that works."""
    call = f"{metric.name}(output, inputs)"
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            swapped = "logits" in inputs or "last_hidden_state" in inputs
            raise TypeError(f"{call}: " + ("the second argument looks like the model's output; the output goes "
                                           f"first: {metric.name}(model(tokens), tokens)." if swapped else
                                           f"a batch needs input_ids; this one has keys {sorted(map(str, inputs))}."))
        ids = inputs["input_ids"]
        if isinstance(ids, torch.Tensor) and ids.ndim == 1:
            inputs = {**inputs, "input_ids": ids[None]}
    elif isinstance(inputs, torch.Tensor) or (isinstance(inputs, (list, tuple)) and inputs
                                              and not isinstance(inputs[0], str)):
        ids = torch.as_tensor(inputs)
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.ndim not in (1, 2):
            raise TypeError(f"{call}: inputs must be token ids (batch, pos) or (pos,), or a batch dict; got a "
                            f"{str(ids.dtype).removeprefix('torch.')} tensor of shape {tuple(ids.shape)}. (Logits go "
                            "first: metric(model(tokens), tokens).)")
        inputs = {"input_ids": ids if ids.ndim == 2 else ids[None], "attention_mask": None}
    else:
        raise TypeError(f"{call}: inputs must be token ids (a tensor) or a batch dict with input_ids, as the model "
                        f"ran on; got {type(inputs).__name__}. Tokenize text with model.to_tokens (ids) or model.to_batch (ids and mask) first.")
    if hasattr(output, "hf") and hasattr(output, "run_with_cache"):  # the model itself: run it on the inputs
        ids = inputs["input_ids"].to(output.device)
        mask = inputs.get("attention_mask")
        with torch.no_grad():
            output = output(ids, None if mask is None else mask.to(output.device))
    elif isinstance(output, torch.Tensor) and not output.is_floating_point():
        raise TypeError(f"{call}: output must be the model's output (logits or hidden states); got an integer "
                        f"tensor of shape {tuple(output.shape)}, which looks like token ids. Call "
                        f"{metric.name}(model(tokens), tokens) or {metric.name}(model, tokens).")
    return output, inputs


class Metric:
    """A metric with a per-example form.

    ``per_example(output, inputs) -> (b,)``; calling the metric gives the mean as a float. ``output`` is the
    model's output (or the model itself, which is then run on ``inputs``); ``inputs`` a batch dict or token ids
    ``(b, p)``: every subclass's ``per_example``, ``loss`` and ``__call__`` take both forms (``__init_subclass__``).
    ``higher_is_better`` says which way is good (the ablation order of pruning needs it).
    ``loss(output, inputs) -> (b,)`` is what ``head_importance`` differentiates: by default the metric
    itself, negated when higher is better.
    """

    name = "metric"
    higher_is_better = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for method in ("per_example", "loss", "__call__"):
            if method in cls.__dict__:
                setattr(cls, method, _normalised(cls.__dict__[method]))

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, output, inputs: Batch) -> torch.Tensor:
        value = self.per_example(output, inputs)
        return -value if self.higher_is_better else value

    def __call__(self, output, inputs: Batch) -> float:
        return float(self.per_example(output, inputs).detach().float().mean())

    def trailing(self, inputs: Batch) -> int | None:
        """How many final positions of the output this metric reads, when it counts them from the end, so that a run
        may compute the logits there only (``logits_to_keep``: the output layer is a fifth of SmolLM2's forward);
        None (the default) when it reads every position. The metric must then give the same value on the output
        of those positions as on the whole output."""
        return None

    def rows(self, index: torch.Tensor) -> Metric:
        """The metric for rows ``index`` of the batch it is used on (a study split across processes runs each
        rank's rows). A metric that holds one value per sequence (targets, reference embeddings) returns a copy
        holding those rows; one without per-row state returns itself."""
        return self

    def __repr__(self) -> str:
        return f"<metric {self.name}>"


def _normalised(method):
    @functools.wraps(method)
    def wrapper(self, output, inputs, *args, **kwargs):
        return method(self, *_arguments(self, output, inputs), *args, **kwargs)

    wrapper.__wrapped_metric__ = True
    return wrapper


class _Callable(Metric):
    def __init__(self, fn: Callable, higher_is_better: bool | None):
        self.fn, self.name = fn, getattr(fn, "__name__", "metric")
        self.higher_is_better = higher_is_better

    def __call__(self, output, inputs: Batch) -> float:
        return float(self.fn(output, inputs))

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        return torch.as_tensor(self.fn(output, inputs), dtype=torch.float32).reshape(1)

    def loss(self, output, inputs: Batch) -> torch.Tensor:
        value = self.fn(output, inputs)
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            raise TypeError(
                f"head_importance needs a differentiable loss; {self.name} returned {type(value).__name__} without "
                "a gradient. Pass loss=fn(output, inputs) returning a tensor, (batch,) or a scalar."
            )
        return -value if self.higher_is_better else value


def as_metric(metric: Any, higher_is_better: bool | None = None) -> Metric:
    """A ``Metric`` from a ready-made one or from any callable ``fn(output, inputs) -> float``."""
    if isinstance(metric, Metric):
        return metric
    if not callable(metric):
        raise TypeError(f"metric must be callable as metric(output, inputs) -> float; got {type(metric).__name__}.")
    return _Callable(metric, higher_is_better)


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``targets: (b, t)`` under ``logits: (b, t, vocab)``, per token ``(b, t)``: each
    softmax over a contiguous vocabulary row (F.cross_entropy on the ``(b, vocab, t)`` transpose strides across the
    vocabulary: about 2x slower on SmolLM2's 49,152 entries, a few percent of ``interp report``)."""
    b, t, v = logits.shape
    return F.cross_entropy(logits.reshape(b * t, v).float(), targets.reshape(b * t), reduction="none").view(b, t)


class _LMLoss(Metric):
    """Causal LM loss: mean next-token cross-entropy over each sequence's real tokens (padding skipped)."""

    name, higher_is_better = "lm_loss", False

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        logits, ids, mask = _main_output(output), inputs["input_ids"], _mask(inputs)
        nll = _token_nll(logits[:, :-1], ids[:, 1:])  # (b, p-1)
        valid = (mask[:, 1:] & mask[:, :-1]).float()
        return (nll * valid).sum(1) / valid.sum(1).clamp(min=1)


class _CopyLoss(Metric):
    """Next-token loss inside one copy of repeated sequences ``[bos?, x, x]`` (``analyses.data.toy``).

    The length of ``x`` follows from the sequence length: odd means a start token, ``(p - 1) / 2``. The first
    copy covers every target of the first ``x``; the second covers ``x_1 .. x_{L-1}`` of the second copy
    (each predictable from an earlier occurrence; ``x_0`` is not). Same definition as ``toy.copy_losses``.
    """

    higher_is_better = False

    def __init__(self, which: str):
        self.which, self.name = which, f"{which}_copy_loss"

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        logits, ids = _main_output(output), inputs["input_ids"]
        if inputs.get("attention_mask") is not None:
            raise ValueError("Copy losses take unpadded repeated sequences [bos?, x, x]; got an attention mask.")
        offset, length = ids.shape[1] % 2, ids.shape[1] // 2
        if length < 2 or not torch.equal(ids[:, offset:offset + length], ids[:, offset + length:]):
            raise ValueError(f"{self.name} needs repeated sequences [bos?, x, x] with len(x) >= 2; the two halves "
                             f"of these {tuple(ids.shape)} inputs differ. Build them with analyses.data.toy.repeated_sequences.")
        # logits at p predict ids at p + 1: the first copy's targets, or x_1 .. x_{L-1} of the second
        start, stop = (max(offset - 1, 0), offset - 1 + length) if self.which == "first" else \
            (offset + length, offset - 1 + 2 * length)
        cut = ids.shape[1] - logits.shape[1]  # a run that kept the last positions only (``trailing``)
        if cut > start:
            raise ValueError(f"{self.name} reads the logits from position {start} on; the output holds the last "
                             f"{logits.shape[1]} of {ids.shape[1]} positions. Run the model with logits_to_keep >= "
                             f"{ids.shape[1] - start}, or on the whole output.")
        return _token_nll(logits[:, start - cut:stop - cut], ids[:, start + 1:stop + 1]).mean(1)

    def trailing(self, inputs: Batch) -> int | None:
        """The second copy reads the last ``len(x)`` positions (from the second copy's first token on); the first
        copy reads from the start."""
        return inputs["input_ids"].shape[1] // 2 if self.which == "second" else None


class _LogitDifference(Metric):
    """logits[correct] - logits[wrong] at one position (default the last), averaged over the batch; one token
    each, or one per sequence."""

    higher_is_better = True

    def __init__(self, correct, wrong, position: int):
        self.correct, self.wrong = torch.as_tensor(correct).long(), torch.as_tensor(wrong).long()
        if isinstance(position, bool) or not hasattr(position, "__index__"):
            raise ValueError(f"position is an integer position (-1: the last); got {position!r}.")
        self.position = int(position)  # its range is checked on the logits (check_position)
        shown = [t.item() if t.ndim == 0 else f"{t.numel()} tokens" for t in (self.correct, self.wrong)]
        self.name = f"logit_difference({shown[0]}, {shown[1]})"

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        logits = _main_output(output)
        logits = logits[:, check_position(self.position, logits.shape[1])].float()  # (b, vocab)
        rows = torch.arange(logits.shape[0], device=logits.device)
        correct, wrong = (t.to(logits.device).expand(logits.shape[0]) if t.ndim == 0 else t.to(logits.device)
                          for t in (self.correct, self.wrong))
        if correct.shape[0] != logits.shape[0] or wrong.shape[0] != logits.shape[0]:
            raise ValueError(f"{self.name} has one token per sequence for {correct.shape[0]} sequences; the model ran on "
                             f"{logits.shape[0]}.")
        return logits[rows, correct] - logits[rows, wrong]

    def trailing(self, inputs: Batch) -> int | None:
        return -self.position if self.position < 0 else None

    def rows(self, index: torch.Tensor) -> Metric:
        part = copy.copy(self)
        part.correct, part.wrong = (t if t.ndim == 0 else t[index.to(t.device)] for t in (self.correct, self.wrong))
        return part


class _NextTokenLoss(Metric):
    """Mean cross-entropy of fixed target tokens, whatever input the model ran on."""

    name, higher_is_better = "next_token_loss", False

    def __init__(self, targets: torch.Tensor, start: int, stop: int | None):
        self.targets, self.start, self.stop = targets, start, stop

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        logits = _main_output(output)
        ran = (logits.shape[0], inputs["input_ids"].shape[1])
        start, stop = self._span()
        offset = self.targets.shape[1] - logits.shape[1]  # 0, or the run computed the logits of the last positions
        if ran != self.targets.shape or not 0 <= offset <= start:
            raise ValueError(f"next_token_loss was built for inputs of shape {tuple(self.targets.shape)}; the model "
                             f"ran on {ran}.")
        targets = self.targets[:, start + 1:stop + 1].to(logits.device)
        return _token_nll(logits[:, start - offset:stop - offset], targets).mean(1)

    def _span(self) -> tuple[int, int]:
        """The positions ``start <= t < stop`` whose logits are read, counted from the first."""
        p = self.targets.shape[1]
        start, stop, _ = slice(self.start, self.stop if self.stop is not None else p - 1).indices(p)
        return start, stop

    def trailing(self, inputs: Batch) -> int | None:
        return self.targets.shape[1] - self._span()[0]

    def rows(self, index: torch.Tensor) -> Metric:
        return _NextTokenLoss(self.targets[index.to(self.targets.device)], self.start, self.stop)


def next_token_loss(targets, start: int, stop: int | None = None) -> Metric:
    """Metric: mean cross-entropy of predicting ``targets[:, t + 1]`` from the logits at positions ``start <= t <
    stop`` (default: to the end). The targets are fixed, so on a corrupted input it still scores the clean
    continuation: the metric for patching (lower is better)."""
    return _NextTokenLoss(torch.as_tensor(targets), int(start), stop)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings ``(b, m)``: the mean of ``hidden: (b, p, m)`` over real tokens, as
    sentence-transformers pools MiniLM."""
    weights = mask.to(hidden.dtype)[:, :, None]
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class _EmbeddingSimilarity(Metric):
    """Cosine similarity of mean-pooled sentence embeddings to the unablated model's on the same inputs.

    At the unablated model the similarity is 1, its maximum, so its gradient is zero and cannot rank heads.
    ``loss`` is therefore a sensitivity probe: ``u_x . e(x)``, with e the normalised embedding and u_x a
    fixed random Gaussian direction per example. Then E|dL/dgate_h| is proportional to the size of
    de(x)/dgate_h, which sets the similarity loss to second order (1 - cos ~ |de|^2 / 2).
    """

    name, higher_is_better = "embedding_similarity", True

    def __init__(self, reference: torch.Tensor, ids: torch.Tensor, seed: int):
        self.reference, self.ids = reference, ids  # (b, m) normalised; (b, p)
        g = torch.Generator().manual_seed(seed)
        self.probe = torch.randn(reference.shape, generator=g).to(reference.device)

    def _embed(self, output, inputs: Batch) -> torch.Tensor:
        ids = inputs["input_ids"]
        if ids.shape != self.ids.shape or not torch.equal(ids, self.ids.to(ids.device)):
            raise ValueError("embedding_similarity compares with the unablated model on the inputs it was built with; "
                             f"got other inputs {tuple(ids.shape)}. Build the metric with these inputs.")
        return F.normalize(mean_pool(_main_output(output).float(), _mask(inputs)), dim=-1)

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        return (self._embed(output, inputs) * self.reference).sum(-1)

    def loss(self, output, inputs: Batch) -> torch.Tensor:
        return (self._embed(output, inputs) * self.probe).sum(-1)

    def rows(self, index: torch.Tensor) -> Metric:
        part = copy.copy(self)
        part.reference = self.reference[index.to(self.reference.device)]
        part.probe, part.ids = self.probe[index.to(self.probe.device)], self.ids[index.to(self.ids.device)]
        return part


lm_loss: Metric = _LMLoss()
first_copy_loss: Metric = _CopyLoss("first")
second_copy_loss: Metric = _CopyLoss("second")


def logit_difference(correct, wrong, position: int = -1) -> Metric:
    """Metric: ``logits[:, position, correct] - logits[:, position, wrong]`` (higher is better); ``correct`` and
    ``wrong`` are token ids, one for every sequence or one per sequence."""
    return _LogitDifference(correct, wrong, position)


def embedding_similarity(model, inputs, seed: int = 0) -> Metric:
    """Metric for encoders: mean cosine similarity of the mean-pooled embeddings of ``inputs`` to the ones the
    model gives now, unablated (so 1.0 before any ablation). ``seed`` fixes the probe directions of its loss."""
    batch = batch_of(model, inputs)
    with model.studying(), torch.no_grad():
        hidden = _main_output(model(batch["input_ids"], batch["attention_mask"])).float()
    reference = F.normalize(mean_pool(hidden, _mask(batch)), dim=-1)
    return _EmbeddingSimilarity(reference, batch["input_ids"], seed)


# -- teacher-forced metrics of encoder-decoder models ------------------------------------------------------------
class _TargetMetric(Metric):
    """Teacher-forced: per example, the mean over real target positions (``decoder_attention_mask`` and labels
    other than -100) of the labels' cross-entropy (``loss``) or of argmax hits (``accuracy``)."""

    def __init__(self, kind: str, labels):
        self.kind, self.labels = kind, None if labels is None else torch.as_tensor(labels)
        self.name, self.higher_is_better = f"target_{kind}", kind == "accuracy"

    def per_example(self, output, inputs) -> torch.Tensor:
        logits = _main_output(output)  # (b, t, vocab)
        labels = self.labels if self.labels is not None else inputs.get("labels")
        if labels is None:
            raise ValueError(f"{self.name} scores the labels (b, t): put 'labels' in the batch (copy_task does) or "
                             f"build the metric with them, {self.name}(labels).")
        labels = labels.to(logits.device)
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"{self.name}'s labels are {tuple(labels.shape)}; the decoder ran on "
                             f"{tuple(logits.shape[:2])} (batch, target pos).")
        valid = labels != -100
        if inputs.get("decoder_attention_mask") is not None:
            valid = valid & inputs["decoder_attention_mask"].to(logits.device).bool()
        if self.kind == "loss":
            values = _token_nll(logits, labels.clamp(min=0))
        else:
            values = (logits.argmax(-1) == labels).float()
        valid = valid.float()
        return (values * valid).sum(1) / valid.sum(1).clamp(min=1)  # (b,)

    def loss(self, output, inputs) -> torch.Tensor:
        if self.kind == "accuracy":
            raise TypeError("target_accuracy counts argmax hits, which have no gradient; rank heads with "
                            "loss=target_loss() instead.")
        return self.per_example(output, inputs)

    def rows(self, index: torch.Tensor) -> Metric:
        return self if self.labels is None else _TargetMetric(self.kind, self.labels[index.to(self.labels.device)])


def target_loss(labels=None) -> Metric:
    """Metric: teacher-forced cross-entropy of the targets, averaged over each example's real target positions
    (lower is better). labels: ``(b, t)`` (-100 skipped); default the batch's ``labels``. Fixed labels keep scoring
    the clean targets on a corrupted batch (patching)."""
    return _TargetMetric("loss", labels)


def target_accuracy(labels=None) -> Metric:
    """Metric: the fraction of target tokens predicted right (argmax, teacher-forced), per example over its real
    target positions (higher is better); labels as in ``target_loss``. Has no gradient (no ``head_importance``)."""
    return _TargetMetric("accuracy", labels)
