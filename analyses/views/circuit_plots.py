"""The faithfulness curve of circuits (``analyses.circuits.faithfulness``): the circuit's, its complement's and
random circuits', against the number of edges, with the circuit's 95% bootstrap interval shaded."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

__all__ = ["faithfulness_plot"]


def faithfulness_plot(df: pd.DataFrame, ax=None, title: str | None = None):
    """Faithfulness (0: the corrupted run, 1: the clean run) against the circuit's edges; returns the Axes."""
    need = {"edges", "faithfulness", "lo", "hi", "complement", "random"}
    if not need <= set(df.columns) or df.empty:
        raise ValueError(f"faithfulness_plot needs faithfulness's table: columns {sorted(need)}, at least one row; "
                         f"got columns {list(df.columns)} and {len(df)} rows.")
    ax = ax if ax is not None else plt.subplots(figsize=(6.4, 4.2), layout="constrained")[1]
    a = df.attrs
    ax.plot(df["edges"], df["faithfulness"], "o-", color="C0",
            label=f"circuit (CPR {a.get('cpr', float('nan')):.2f}, CMD {a.get('cmd', float('nan')):.2f})")
    ax.fill_between(df["edges"], df["lo"], df["hi"], color="C0", alpha=0.2, linewidth=0)
    ax.plot(df["edges"], df["complement"], "s--", color="C1", label="complement (every edge but the circuit's)")
    ax.plot(df["edges"], df["random"], "^:", color="0.4",
            label=f"random circuits, same size (CPR {a.get('cpr_random', float('nan')):.2f})")
    ax.axhline(1.0, color="0.7", linewidth=0.8)
    ax.axhline(0.0, color="0.7", linewidth=0.8)
    ax.set_xlabel("edges in the circuit")
    ax.set_ylabel("faithfulness")
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    return ax
