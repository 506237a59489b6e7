"""Hook points and the registry that adds and removes user functions on them.

A hook is ``fn(tensor, hook) -> None | tensor``: it reads the tensor, or returns a replacement of the
same shape that the model then computes with. ``hook.name`` and ``hook.layer`` say where it fired.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Union

import torch

from .names import unknown_name_error

__all__ = ["HookPoint", "HookHandle", "HookRegistry", "NameFilter", "HookFn", "remove_at"]

# torch's per-module hook tables (forward, pre-forward, their with-kwargs and always-called forms, backward): a copy
# of a module carries them along, and a replayed block must not fire them again (analyses.causal.engine, analyses.causal.pruning)
TORCH_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                     "_backward_pre_hooks")

HookFn = Callable[[torch.Tensor, "HookPoint"], Union[torch.Tensor, None]]
NameFilter = Union[str, Iterable[str], Callable[[str], bool]]


class _Layer(int):
    """A hook's layer number, also callable as TransformerLens's ``hook.layer()``."""

    def __call__(self) -> int:
        return int(self)


class HookPoint:
    """A named place in the forward pass. Calling it runs its hooks in the order they were added. ``hook.layer``:
    its layer (``hook.layer()`` too, as in TransformerLens), None for a point outside the blocks. A point made without
    a name (``HookPoint()`` in a module of your own) is named by ``HookedRootModule.setup()``."""

    __slots__ = ("name", "layer", "fns", "read_only", "owner")

    def __init__(self, name: str | None = None, layer: int | None = None, read_only: str | None = None):
        self.name = name
        self.layer = None if layer is None else _Layer(layer)
        self.fns: list[HookFn] = []
        self.read_only = read_only  # why an edit here cannot work, or None
        self.owner = None  # a weak reference to the model that adds hooks here (it attaches the torch hooks)

    def __bool__(self) -> bool:
        return bool(self.fns)

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r}, hooks={len(self.fns)})"

    def _model(self, what: str):
        model = self.owner() if self.owner is not None else None
        if model is None:
            raise TypeError(f"{what} through the model that owns this point: model.add_hook({self.name!r}, hook) "
                            f"(or model.run_with_hooks(..., fwd_hooks=...)); this HookPoint belongs to none.")
        return model

    def add_hook(self, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, **_options) -> list:  # noqa: A002
        """TransformerLens's ``hook_point.add_hook(fn)``: ``model.add_hook(self.name, fn, ...)`` on the model that
        owns this point (it stays until removed: ``remove_hooks``, ``model.reset_hooks``)."""
        return self._model("Add hooks").add_hook(self.name, hook, dir=dir, is_permanent=is_permanent)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, **_options) -> None:  # noqa: A002
        """TransformerLens's ``hook_point.remove_hooks()``: this point's hooks, the permanent ones only with
        ``including_permanent``."""
        self._model("Remove hooks")._remove_hooks_at(self, including_permanent)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for fn in tuple(self.fns):
            out = fn(x, self)
            if out is None or out is x:
                continue
            if self.read_only is not None:
                raise ValueError(f"{self.name} is observe-only: {self.read_only}")
            if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"A hook on {self.name} must return None or a tensor of shape {tuple(x.shape)}; got {got}."
                )
            if out.dtype != x.dtype:
                name = getattr(fn, "__name__", type(fn).__name__)
                raise TypeError(
                    f"A hook on {self.name} must return a tensor of the dtype it received, {x.dtype}; hook {name} "
                    f"returned {out.dtype}. Cast it back, e.g. return out.to(tensor.dtype)."
                )
            x = out
        return x


class HookHandle:
    """Removes one function from one hook point; removing twice is harmless."""

    __slots__ = ("point", "fn")

    def __init__(self, point: HookPoint, fn: HookFn):
        self.point, self.fn = point, fn

    def remove(self) -> None:
        fns = self.point.fns
        for i, f in enumerate(fns):
            if f is self.fn:
                del fns[i]
                return


class HookRegistry:
    """All hook points of one model, addressed by name or by a name filter.

    ``on_change`` runs after every add or remove (the model uses it to attach or detach the torch module
    hooks it needs, so that no torch hook stays registered while nothing listens). ``check`` may refuse
    points before a function is added to them (e.g. eager-only points under the flash path).
    """

    def __init__(
        self,
        points: Iterable[HookPoint],
        on_change: Callable[[], None] | None = None,
        check: Callable[[list[HookPoint]], None] | None = None,
    ):
        self.points: dict[str, HookPoint] = {p.name: p for p in points}
        self._on_change = on_change or (lambda: None)
        self._check = check or (lambda points: None)

    def names(self) -> list[str]:
        return list(self.points)

    def __getitem__(self, name: str) -> HookPoint:
        try:
            return self.points[name]
        except KeyError:
            raise unknown_name_error(name, self.names()) from None

    def resolve(self, name_filter: NameFilter) -> list[HookPoint]:
        """The points a filter selects: a name, a list of names, or a predicate on names."""
        if isinstance(name_filter, str):
            return [self[name_filter]]
        if callable(name_filter):
            selected = [p for name, p in self.points.items() if name_filter(name)]
            if not selected:
                raise ValueError("The hook-name predicate matched no hook name; see model.hook_names().")
            return selected
        if isinstance(name_filter, Iterable):
            names = list(name_filter)
            if not all(isinstance(n, str) for n in names):
                raise TypeError(f"A list of hook names must hold strings; got {names!r}.")
            return [self[n] for n in dict.fromkeys(names)]
        raise TypeError(
            f"A hook-name filter is a string, a list of strings or a predicate; got {type(name_filter).__name__}."
        )

    def add(self, name_filter: NameFilter, fn: HookFn) -> list[HookHandle]:
        if not callable(fn):
            raise TypeError(f"A hook must be a callable fn(tensor, hook); got {type(fn).__name__}.")
        _check_signature(fn)
        points = self.resolve(name_filter)
        self._check(points)
        for p in points:
            p.fns.append(fn)
        self._on_change()
        return [HookHandle(p, fn) for p in points]

    def remove(self, handles: Iterable[HookHandle]) -> None:
        for h in handles:
            h.remove()
        self._on_change()

    def clear(self) -> None:
        """Remove every hook from every point."""
        for p in self.points.values():
            p.fns.clear()
        self._on_change()

    def active(self) -> list[str]:
        return [name for name, p in self.points.items() if p.fns]

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[NameFilter, HookFn]]) -> Iterator[None]:
        """Add ``(name_filter, fn)`` pairs for the duration of a ``with`` block, and always remove them."""
        handles: list[HookHandle] = []
        try:
            for pair in fwd_hooks:
                if not (isinstance(pair, tuple) and len(pair) == 2):
                    raise TypeError(f"fwd_hooks holds (name_filter, fn) pairs; got {pair!r}.")
                handles += self.add(*pair)
            yield
        finally:
            self.remove(handles)


def remove_at(point: HookPoint, permanent: list[HookHandle], including_permanent: bool = False) -> None:
    """Remove ``point``'s hooks but those added permanently (``permanent``: their handles), or all of them."""
    keep = [] if including_permanent else [h.fn for h in permanent if h.point is point]
    point.fns[:] = [f for f in point.fns if any(f is k for k in keep)]


def _check_signature(fn: HookFn) -> None:
    """Refuse, when it is added, a hook that cannot be called as ``fn(tensor, hook)``: a mistake such as
    ``lambda z: z`` would otherwise surface deep inside the forward pass."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: let them through
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(f"Hooks are called as fn(tensor, hook) and may return a replacement tensor; {name}{signature} "
                        "does not take those two arguments. Write e.g. lambda z, hook: z * 2.") from None
