"""Beyond one device: models split across devices by accelerate, studies split across processes by torch.distributed.

**Models across devices.** ``interp.load_model(source, device_map=..., max_memory=..., offload_folder=...)`` hands
the model to transformers' own device-map loading (accelerate's ``dispatch_model``): blocks live on different
devices, and offloaded weights sit on the ``meta`` device until accelerate's hooks load them for the module that
runs. Hooks fire inside each module, so they see tensors on their layer's device. Three helpers cover the rest:
``input_device`` (where inputs go: the embedding's execution device), ``onloaded`` (offloaded weights in memory
for code that reads weights outside a forward: composition scores, direct logit attribution) and ``dispatch``
(an instance in memory, placed as transformers would place a folder).

**Studies across processes.** When ``torch.distributed`` is initialised with more than one rank (``torchrun``,
``accelerate launch``), the studies in ``analyses`` split their prompts across ranks: ``shard`` gives this rank's
indices, ``gather_rows`` puts per-prompt values back in the original order on every rank and ``all_sum`` adds
sums and counts; both reduce in float64 (int64 for counts) with one contributor per value, so the combined
numbers are the ones a single process computes. Every rank ends with the whole result.

A rank that raises must not leave the others waiting in a collective: every collective here is preceded by an
exchange of a failure flag, and ``failing_together`` makes a rank that raises send its error there; the other
ranks then raise ``RankFailed`` with that rank's message. A rank that dies without raising (killed) is left to
the launcher (torchrun stops the other workers) and to the process group's timeout.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["RankFailed", "all_sum", "check_same", "dispatch", "dispatched", "failing_together", "gather_rows",
           "initialised", "input_device", "launched", "offloaded", "onloaded", "rank", "rank_zero", "shard",
           "single_process", "warn_once", "world_size"]


# -- models across devices (accelerate) --------------------------------------------------------------------------
def input_device(hf: torch.nn.Module) -> torch.device:
    """Where a model's inputs go: the device its input embedding runs on (accelerate's execution device when the
    embedding is dispatched or offloaded), else the device of its first parameter."""
    try:
        embedding = hf.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    if isinstance(embedding, torch.nn.Module):  # Perceiver's is a bare Parameter
        execution = getattr(getattr(embedding, "_hf_hook", None), "execution_device", None)
        if execution is not None:
            return torch.device(execution if not isinstance(execution, int) else f"cuda:{execution}")
        weight = next(embedding.parameters(), None)
        if weight is not None and weight.device.type != "meta":
            return weight.device
    return next((p.device for p in hf.parameters() if p.device.type != "meta"), torch.device("cpu"))


def dispatched(hf: torch.nn.Module) -> bool:
    """Whether accelerate placed the model by a device map with its hooks (several devices, or offload)."""
    return any(hasattr(m, "_hf_hook") for m in hf.modules())


def offloaded(hf: torch.nn.Module) -> bool:
    """Whether some weights are offloaded (on the ``meta`` device, loaded by accelerate's hooks when used)."""
    return any(p.device.type == "meta" for p in hf.parameters())


@contextmanager
def onloaded(*modules: torch.nn.Module):
    """Inside the block, every offloaded weight of ``modules`` (and their submodules) is in memory on its execution
    device; on exit it goes back to where accelerate keeps it. A module without offloaded weights is left alone.

    Forward passes need none of this (accelerate loads each module's weights when it runs); code that reads
    weights outside a forward does.
    """
    with ExitStack() as stack:
        for module in modules:
            for m in module.modules():
                hook = getattr(m, "_hf_hook", None)
                if hook is not None and getattr(hook, "offload", False):
                    from accelerate.utils import align_module_device

                    stack.enter_context(align_module_device(m))
        yield


def dispatch(hf: torch.nn.Module, device_map, max_memory=None, offload_folder=None) -> torch.nn.Module:
    """Place an instance in memory by ``device_map`` as ``from_pretrained(device_map=...)`` places a folder:
    ``"auto"``/``"balanced"``/``"sequential"`` (accelerate's ``infer_auto_device_map`` within ``max_memory``,
    keeping the model's ``_no_split_modules`` whole) or a dict ``{module name: device | "cpu" | "disk"}``.
    Weights mapped to ``"disk"`` are written to ``offload_folder``. The instance is changed in place and returned.
    """
    try:
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.utils import get_balanced_memory
    except ModuleNotFoundError:
        raise ModuleNotFoundError("device_map needs accelerate: pip install accelerate") from None
    if isinstance(device_map, str):
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(f"device_map is 'auto', 'balanced', 'balanced_low_0', 'sequential' or a dict of module "
                             f"names to devices; got {device_map!r}.")
        no_split = list(getattr(hf, "_no_split_modules", None) or [])
        if device_map != "sequential":
            max_memory = get_balanced_memory(hf, max_memory=max_memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(hf, max_memory=max_memory, no_split_module_classes=no_split)
    elif not isinstance(device_map, dict):
        raise TypeError(f"device_map is a string or a dict of module names to devices; got "
                        f"{type(device_map).__name__}.")
    if "disk" in device_map.values() and offload_folder is None:
        raise ValueError("device_map puts some modules on 'disk'; pass offload_folder= (where their weights go).")
    return dispatch_model(hf, device_map=device_map, offload_dir=offload_folder)


# -- studies across processes (torch.distributed) ---------------------------------------------------------------
_local = [0]  # depth of single_process() blocks


def initialised() -> bool:
    """Whether studies run sharded here: torch.distributed is initialised with more than one rank (and no
    ``single_process()`` block is open)."""
    return not _local[0] and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank, 0 outside a distributed run."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks, 1 outside a distributed run."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank_zero() -> bool:
    """True in rank 0 and in a process that is not part of a distributed run: the one that prints and writes
    files."""
    return rank() == 0


@contextmanager
def single_process():
    """Studies inside the block run whole in this process even when torch.distributed is initialised (e.g. a study
    called on rank 0 only, which sharded would wait for ranks that never join)."""
    _local[0] += 1
    try:
        yield
    finally:
        _local[0] -= 1


@contextmanager
def launched(device=None, timeout: timedelta | None = None):
    """Join the process group that a launcher describes in the environment (``WORLD_SIZE`` > 1, as ``torchrun``
    and ``accelerate launch`` set it) for the duration of the block, and leave it after. gloo on CPU; nccl when the
    work runs on CUDA (each rank on the GPU numbered by its ``LOCAL_RANK``). Nothing happens outside such a launch
    or when a process group is already initialised. ``timeout``: how long a collective may wait (torch's default
    when None); a rank that raises does not make the others wait for it (``failing_together``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        yield
        return
    wants_cuda = device in (None, "auto") or torch.device(device).type == "cuda"
    use_cuda = torch.cuda.is_available() and wants_cuda
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard(n: int, strided: bool = False) -> torch.Tensor | None:
    """This rank's share of ``n`` items (prompts, or batches of them) as indices into them, or None when a study
    runs whole here: not sharded (``initialised()`` is false) or fewer items than ranks.

    Contiguous (default): rank r gets the r-th of ``world_size`` nearly equal runs, in order. ``strided``: items r,
    r + w, r + 2w, ..., which balances the work when items are sorted by cost (``detect_heads`` sorts its batches by
    length). Either way the indices say where each item came from, so ``gather_rows`` restores the original order.

    >>> shard(10) is None  # no process group
    True
    """
    if not initialised() or n < dist.get_world_size():
        return None
    w, r = dist.get_world_size(), dist.get_rank()
    return torch.arange(r, n, w) if strided else torch.tensor_split(torch.arange(n), w)[r]


class RankFailed(RuntimeError):
    """Another rank raised during a sharded study; the message carries its rank and error."""


_SHARED = "_interp_rank_failure_shared"  # set on an exception that every rank has heard of


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _exchange(message: str | None) -> None:
    """Every rank says whether it failed (``message``, else None). When one did, every rank learns each failed
    rank's message: a rank that did not fail raises ``RankFailed`` with it."""
    flag = torch.tensor([0 if message is None else 1], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    if message is None:
        failed = "; ".join(f"rank {r} failed: {m}" for r, m in enumerate(messages) if m is not None)
        err = RankFailed(f"{failed} (this is rank {dist.get_rank()}; the study was stopped on every rank)")
        setattr(err, _SHARED, True)
        raise err


@contextmanager
def failing_together():
    """Run a sharded study's block so that an exception on one rank reaches every rank: the rank that raises sends
    its error at the other ranks' next collective (or at the end of their block), where they raise ``RankFailed``
    with its message, instead of waiting for it forever. Without a process group it does nothing."""
    if not initialised():
        yield
        return
    try:
        yield
    except Exception as err:
        if not getattr(err, _SHARED, False):
            try:
                _exchange(f"{type(err).__name__}: {err}")
            except Exception:  # the others are gone: the launcher or the timeout ends them; keep our own error
                pass
            try:
                setattr(err, _SHARED, True)
            except AttributeError:
                pass
        raise
    else:
        _exchange(None)


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    _exchange(None)
    dist.all_reduce(tensor)
    return tensor


def gather_rows(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Every rank's rows in the original order, on every rank: ``values: (len(index), ...)`` holds this rank's
    items ``index`` (from ``shard``); returns ``(n, ...)`` in ``values``' dtype and device.

    Each row has one contributor and zeros elsewhere, summed in float64 (int64 for integers): exact, so a float32
    value comes back with the same bits.
    """
    wide = torch.float64 if values.is_floating_point() else torch.int64
    full = torch.zeros((n, *values.shape[1:]), dtype=wide, device=_comm_device())
    full[index.to(full.device)] = values.detach().to(full.device, wide)
    return _all_reduce(full).to(values.device, values.dtype)


def all_sum(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor summed over ranks, in float64 (int64 for integers), returned in its own dtype and device; one
    collective per kind of dtype."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for wide in (torch.float64, torch.int64):
        chosen = [i for i, t in enumerate(tensors) if (t.is_floating_point()) == (wide == torch.float64)]
        if not chosen:
            continue
        flat = torch.cat([tensors[i].detach().reshape(-1).to(_comm_device(), wide) for i in chosen])
        summed = _all_reduce(flat).split([tensors[i].numel() for i in chosen])
        for i, part in zip(chosen, summed):
            out[i] = part.reshape(tensors[i].shape).to(tensors[i].device, tensors[i].dtype)
    return tuple(out)


def check_same(values: Sequence[int], what: str) -> None:
    """Refuse, on every rank, a study whose ranks were given different inputs (``values``: a fingerprint of them,
    such as sizes and checksums): sharded, each rank would compute its part of a different study."""
    w, r = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(w, len(values), dtype=torch.int64, device=_comm_device())
    table[r] = torch.tensor([int(v) for v in values], dtype=torch.int64)
    table = _all_reduce(table).cpu()
    differ = [k for k in range(w) if not torch.equal(table[k], table[0])]
    if differ:
        raise ValueError(f"Every rank must run a sharded study on the same {what}; rank {differ[0]}'s differ from "
                         f"rank 0's (fingerprints {table[differ[0]].tolist()} and {table[0].tolist()}). Build them the "
                         "same way on every rank (same seed), or run the study inside "
                         "interp.runtime.distributed.single_process().")


def warn_once(message: str) -> None:
    """A warning from rank 0 only (every rank would print the same line)."""
    if rank_zero():
        warnings.warn(message, stacklevel=3)
