"""Hook points in a module of your own: TransformerLens's ``HookedRootModule``.

Put ``HookPoint()`` attributes in any ``torch.nn.Module`` tree, call each in ``forward`` on the value it names
(``square = self.hook_square(x * x)``), and call ``self.setup()`` at the end of the root module's ``__init__``: each
point is then named by its path (``"layer2.hook_square"``) and the root has ``run_with_hooks``, ``run_with_cache``,
``add_hook``, ``reset_hooks``, ``hooks(...)``, ``hook_dict`` and ``mod_dict``, as a HookedModel has for a model's
points. Hooks are ``fn(tensor, hook)`` returning None or a replacement of the same shape and dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from .cache import ActivationCache
from .points import HookPoint, HookRegistry, NameFilter, remove_at

__all__ = ["HookedRootModule"]


class HookedRootModule(torch.nn.Module):
    """A module whose ``HookPoint`` attributes (its own and its submodules') can be hooked by name after
    ``setup()``."""

    def setup(self) -> None:
        """Name every ``HookPoint`` in the module tree by its path and make them hookable; call it at the end of
        ``__init__`` (again after adding points)."""
        points = []
        for prefix, module in self.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, HookPoint):
                    value.name, value.owner = (f"{prefix}.{attr}" if prefix else attr), weakref.ref(self)
                    points.append(value)
        self.__dict__["_hook_registry"] = HookRegistry(points)
        self.__dict__["_permanent_hooks"] = []

    def _registry(self) -> HookRegistry:
        registry = self.__dict__.get("_hook_registry")
        if registry is None:
            raise RuntimeError(f"{type(self).__name__} has no hook points named yet: call self.setup() at the end "
                               "of its __init__ (TransformerLens's HookedRootModule needs the same).")
        return registry

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        return dict(self._registry().points)

    @property
    def mod_dict(self) -> dict[str, object]:
        """Every submodule and hook point by name."""
        return {**{n: m for n, m in self.named_modules() if n}, **self.hook_dict}

    def add_hook(self, name: NameFilter, hook: Callable, dir: str = "fwd", is_permanent: bool = False) -> list:  # noqa: A002
        if dir != "fwd":
            raise ValueError(f"Only forward hooks (dir='fwd'); got dir={dir!r}.")
        handles = self._registry().add(name, hook)
        if is_permanent:
            self.__dict__["_permanent_hooks"].extend(handles)
        return handles

    def reset_hooks(self, including_permanent: bool = False, **_tl_options) -> None:
        registry, permanent = self._registry(), self.__dict__["_permanent_hooks"]
        keep = [] if including_permanent else [h for h in permanent if any(f is h.fn for f in h.point.fns)]
        registry.clear()
        for handle in keep:
            handle.point.fns.append(handle.fn)
        self.__dict__["_permanent_hooks"] = keep

    def _remove_hooks_at(self, point: HookPoint, including_permanent: bool = False) -> None:
        remove_at(point, self.__dict__["_permanent_hooks"], including_permanent)

    @contextmanager
    def hooks(self, fwd_hooks: Iterable = ()):
        with self._registry().hooks(fwd_hooks):
            yield self

    def run_with_hooks(self, *args, fwd_hooks: Iterable = (), **kwargs):
        """``self(*args, **kwargs)`` with ``fwd_hooks`` (``(name_or_filter, fn)`` pairs) active for this call."""
        for option in ("bwd_hooks", "reset_hooks_end", "clear_contexts"):
            kwargs.pop(option, None)
        with self.hooks(fwd_hooks):
            return self(*args, **kwargs)

    def run_with_cache(self, *args, names_filter: NameFilter | None = None, fwd_hooks: Iterable = (),
                       detach: bool = True, **kwargs) -> tuple[object, ActivationCache]:
        """``(self(*args, **kwargs), cache)``: what each hook point (or those ``names_filter`` selects) carried."""
        store: dict[str, torch.Tensor] = {}

        def save(tensor, hook):
            store[hook.name] = tensor.detach() if detach else tensor

        selected = self._registry().names() if names_filter is None else names_filter
        with self.hooks([*fwd_hooks, (selected, save)]):
            out = self(*args, **kwargs)
        return out, ActivationCache(store)
