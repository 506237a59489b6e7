"""Hook points, the hook-name table, the hook registry, the activation cache, and hook points in a module of your
own (``HookedRootModule``).

This package depends on nothing else of ours; ``interp`` and ``analyses`` build on it.
"""

from .cache import ActivationCache, AttentionMeta, additive_mask, allowed_keys
from .names import HOOK_TABLE, HookSpec, attn_site, expand_names, get_act_name, hook_name, spec_for, suggest_names
from .points import HookFn, HookHandle, HookPoint, HookRegistry, NameFilter
from .root import HookedRootModule

__all__ = [
    "ActivationCache",
    "AttentionMeta",
    "HOOK_TABLE",
    "HookFn",
    "HookHandle",
    "HookPoint",
    "HookRegistry",
    "HookSpec",
    "HookedRootModule",
    "NameFilter",
    "additive_mask",
    "allowed_keys",
    "attn_site",
    "expand_names",
    "get_act_name",
    "hook_name",
    "spec_for",
    "suggest_names",
]
