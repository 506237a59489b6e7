"""Analyses of attention heads built on ``interp`` and ``hooks``.

Every name below is loaded on first use (``analyses.detect_heads`` imports ``analyses.heads`` then), so that
``import analyses`` and ``interp --help`` import neither torch nor matplotlib.
"""

# The views (analyses/views/) by module there; analyses.views reads this table too, so a view is listed once
_VIEWS = {
    "head_view": "attention", "attention_grid": "attention", "HeadView": "attention", "AttentionGrid": "attention",
    "attention_heatmap": "plots", "save_figure": "plots", "head_score_grid": "study_plots",
    "ablation_heatmap": "study_plots", "pruning_curve_plot": "study_plots", "patching_heatmap": "study_plots",
    "dla_bars": "study_plots", "streaming_curve_plot": "study_plots",
    "write_report": "report", "long_view": "long", "LongView": "long", "qk_attribution_plot": "qk_view",
    "atlas_page": "atlas", "write_atlas_pages": "atlas", "faithfulness_plot": "circuit_plots",
}

_LAZY = {
    # Ablation and pruning (issue 4)
    **dict.fromkeys(["ablate_heads", "ablation_scan"], "ablation"),
    **dict.fromkeys(["embedding_similarity", "first_copy_loss", "lm_loss", "logit_difference", "second_copy_loss",
                     "next_token_loss"], "metrics"),
    **dict.fromkeys(["curve_summary", "head_importance", "prune_model", "pruning_curve"], "pruning"),
    # Head detection (issue 3)
    "detect_heads": "heads",
    **dict.fromkeys(["head_labels", "label_evidence", "label_heads", "strongest_heads"], "labels"),
    # The registry of head scores (issue 36): ours and a user's, one record each
    **dict.fromkeys(["DEFAULT_THRESHOLDS", "HeadScore", "LABEL_ORDER", "SCORE_DEFINITIONS", "head_score"], "registry"),
    "pattern_scores": "scores",
    # Circuits (issue 13): patching, attribution, composition
    "attribution_patching": "attribution",
    **dict.fromkeys(["direct_logit_attribution", "logit_lens"], "logit_attribution"),
    **dict.fromkeys(["LowRank", "composition_scores", "ov_circuit", "qk_circuit"], "composition"),
    **dict.fromkeys(["activation_patching", "path_patching"], "patching"),
    **dict.fromkeys(["induction_task", "ioi_task"], "tasks"),
    # The head taxonomy of the literature (issue 24), also through detect_heads(model, scores=[...])
    **dict.fromkeys(["function_vector", "function_vector_scores", "fv_accuracy", "icl_tasks"], "function_vectors"),
    **dict.fromkeys(["copy_suppression_scores", "effective_embedding", "successor_scores"], "taxonomy"),
    **dict.fromkeys(["name_mover_scores", "s_inhibition_scores"], "taxonomy_ioi"),
    # Long context (issue 25): retrieval heads from needle-in-a-haystack decoding, in O(n) memory
    **dict.fromkeys(["needle_prompts", "retrieval_heads"], "retrieval"),
    # Streaming heads (issue 26): sinks + a recent window for chosen heads, curves of metric and KV memory
    **dict.fromkeys(["streaming_curve", "streaming_inputs", "streaming_order"], "streaming"),
    **dict.fromkeys(["passkey_inputs", "streaming_gates"], "streaming_gates"),
    # Why a head attends (issue 39): exact query/key attribution of attention scores, checked causally
    **dict.fromkeys(["qk_attribution", "target_rule"], "qk_attribution"),
    # Published head tables as checks (issue 38): GPT-2 small's IOI classes, a user's own table
    **dict.fromkeys(["ExpectationSet", "Expectation", "check_expectations", "needs_scores", "register_expectations"],
                    "expectations"),
    # A versioned head atlas of a model (issue 38)
    **dict.fromkeys(["build_atlas", "diff_atlas", "load_atlas", "save_atlas"], "atlas"),
    # Circuits of heads (issue 48): the graph of nodes and edges, exact edge patching
    **dict.fromkeys(["edge_frame", "graph_edges"], "circuits.graph"),
    **dict.fromkeys(["edge_patching"], "circuits.patching"),
    "edge_attribution": "circuits.attribution",
    **dict.fromkeys(["circuit_areas", "faithfulness", "select_circuit"], "circuits.evaluation"),
    **dict.fromkeys(["greater_than_task"], "circuits.tasks"),
    # Views (issues 5 and 14): every name of analyses/views/ (save_figure, long_view, ...)
    **{name: f"views.{module}" for name, module in _VIEWS.items()},
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once loaded, an ordinary attribute
        return value
    raise AttributeError(f"module 'analyses' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
