"""Analyses of attention heads built on ``interp`` and ``hooks``."""

__all__: list[str] = []

# Ablation and pruning (issue 4)
from .ablation import ablate_heads, ablation_scan  # noqa: E402
from .metrics import (embedding_similarity, first_copy_loss, lm_loss, logit_difference,  # noqa: E402
                      second_copy_loss)
from .pruning import curve_summary, head_importance, prune_model, pruning_curve  # noqa: E402

__all__ += ["ablate_heads", "ablation_scan", "curve_summary", "embedding_similarity", "first_copy_loss",
            "head_importance", "lm_loss", "logit_difference", "prune_model", "pruning_curve", "second_copy_loss"]

# Head detection (issue 3)
from .heads import detect_heads  # noqa: E402
from .scores import (DEFAULT_THRESHOLDS, LABEL_ORDER, SCORE_DEFINITIONS, head_labels, label_heads,  # noqa: E402
                     pattern_scores, strongest_heads)

__all__ += ["DEFAULT_THRESHOLDS", "LABEL_ORDER", "SCORE_DEFINITIONS", "detect_heads", "head_labels", "label_heads",
            "pattern_scores", "strongest_heads"]

# Circuits (issue 13): patching, attribution, composition
from .attribution import attribution_patching, direct_logit_attribution, logit_lens  # noqa: E402
from .composition import LowRank, composition_scores, ov_circuit, qk_circuit  # noqa: E402
from .metrics import next_token_loss  # noqa: E402
from .patching import activation_patching, path_patching  # noqa: E402
from .tasks import induction_task, ioi_task  # noqa: E402

__all__ += ["LowRank", "activation_patching", "attribution_patching", "composition_scores", "ioi_task",
            "direct_logit_attribution", "induction_task", "logit_lens", "next_token_loss", "ov_circuit",
            "path_patching", "qk_circuit"]

# The head taxonomy of the literature (issue 24): successor, copy-suppression, name-mover, S-inhibition and
# function-vector heads (also through detect_heads(model, scores=[...]))
from .function_vectors import function_vector, function_vector_scores, fv_accuracy, icl_tasks  # noqa: E402
from .taxonomy import copy_suppression_scores, effective_embedding, successor_scores  # noqa: E402
from .taxonomy_ioi import name_mover_scores, s_inhibition_scores  # noqa: E402

__all__ += ["copy_suppression_scores", "effective_embedding", "function_vector", "function_vector_scores",
            "fv_accuracy", "icl_tasks", "name_mover_scores", "s_inhibition_scores", "successor_scores"]

# Views (issues 5 and 14: analyses/views/): plots, interactive views and the HTML report, loaded on first use so
# that `import analyses` does not import matplotlib
_LAZY = {"attention_heatmap": "views.plots", "head_score_grid": "views.plots", "ablation_heatmap": "views.plots",
         "pruning_curve_plot": "views.plots", "patching_heatmap": "views.plots", "dla_bars": "views.plots",
         "write_report": "views.report", "head_view": "views.attention", "attention_grid": "views.attention"}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'analyses' has no attribute {name!r}")
