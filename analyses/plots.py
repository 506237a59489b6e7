"""Moved to ``analyses.views.plots`` (issue 14: what a person looks at lives in ``analyses/views/``).

This module re-exports it so that ``from analyses.plots import attention_heatmap`` keeps working.
"""

from .views.plots import *  # noqa: F401,F403
from .views.plots import (__all__, ablation_heatmap, attention_heatmap, clean_token, dla_bars,  # noqa: F401
                          head_score_grid, patching_heatmap, pruning_curve_plot, save_figure)
