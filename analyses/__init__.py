"""Analyses of attention heads built on ``interp`` and ``hooks``."""

__all__: list[str] = []
