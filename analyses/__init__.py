"""Analyses of attention heads built on ``interp`` and ``hooks``.

Every name below is loaded on first use (``analyses.detect_heads`` imports ``analyses.heads.detect`` then), so that
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
    "circuit_view": "circuit_view", "CircuitView": "circuit_view", "circuit_figure": "circuit_figure",
}

_LAZY = {
    # data/: prompts, tasks, batches and metrics
    **dict.fromkeys(["embedding_similarity", "first_copy_loss", "lm_loss", "logit_difference", "second_copy_loss",
                     "next_token_loss"], "data.metrics"),
    **dict.fromkeys(["induction_task", "ioi_task"], "data.tasks"),
    "needle_prompts": "data.needles",
    # heads/: the registry of head scores (ours and a user's, one record each), their labels, detect_heads
    **dict.fromkeys(["DEFAULT_THRESHOLDS", "HeadScore", "LABEL_ORDER", "SCORE_DEFINITIONS", "head_score"],
                    "heads.registry"),
    **dict.fromkeys(["head_labels", "label_evidence", "label_heads", "strongest_heads"], "heads.labels"),
    "pattern_scores": "heads.scores",
    "detect_heads": "heads.detect",
    # causal/: ablation, patching, attribution patching, importance and pruning, over the batching engine
    **dict.fromkeys(["ablate_heads", "ablation_scan"], "causal.ablation"),
    **dict.fromkeys(["activation_patching", "path_patching"], "causal.patching"),
    "attribution_patching": "causal.attribution",
    **dict.fromkeys(["curve_summary", "head_importance", "prune_model", "pruning_curve"], "causal.pruning"),
    # explain/: why a head attends and what it writes (QK attribution, logit attribution, composition)
    **dict.fromkeys(["qk_attribution", "target_rule"], "explain.qk_attribution"),
    **dict.fromkeys(["direct_logit_attribution", "logit_lens"], "explain.logit_attribution"),
    **dict.fromkeys(["LowRank", "composition_scores", "ov_circuit", "qk_circuit"], "explain.composition"),
    # long/: retrieval heads and streaming heads at long context
    "retrieval_heads": "long.retrieval",
    **dict.fromkeys(["streaming_curve", "streaming_inputs", "streaming_order"], "long.streaming"),
    **dict.fromkeys(["passkey_inputs", "streaming_gates"], "long.streaming_gates"),
    # taxonomy/: the head classes of the literature, also through detect_heads(model, scores=[...])
    **dict.fromkeys(["copy_suppression_scores", "effective_embedding", "successor_scores"], "taxonomy.weights"),
    **dict.fromkeys(["name_mover_scores", "s_inhibition_scores"], "taxonomy.ioi"),
    **dict.fromkeys(["function_vector", "function_vector_scores", "fv_accuracy", "icl_tasks"],
                    "taxonomy.function_vectors"),
    # atlas/: a model's versioned head atlas, and published head tables as checks
    **dict.fromkeys(["build_atlas", "diff_atlas", "load_atlas", "save_atlas"], "atlas.atlas"),
    "class_ablation": "atlas.class_ablation",  # each class against random heads, and on its own behaviour
    **dict.fromkeys(["ExpectationSet", "Expectation", "check_expectations", "needs_scores", "register_expectations"],
                    "atlas.expectations"),
    # explain/sinks: what a head really moves (attention sinks, dormant heads, massive activations), checked causally
    **dict.fromkeys(["sink_heads", "massive_activations", "sink_value_ablation", "massive_dims_ablation"],
                    "explain.sinks"),
    # circuits/: a model as a graph of nodes and edges, exact edge patching, edge attribution (EAP, EAP-IG), faithfulness
    **dict.fromkeys(["edge_frame", "graph_edges"], "circuits.graph"),
    **dict.fromkeys(["edge_effects", "edge_patching"], "circuits.patching"),
    "edge_attribution": "circuits.attribution",
    **dict.fromkeys(["circuit_areas", "faithfulness", "refine_circuit", "select_circuit"], "circuits.evaluation"),
    "greater_than_task": "circuits.tasks",
    "needle_task": "circuits.tasks",
    **dict.fromkeys(["Circuit", "circuit_of", "diff_circuits", "load_circuit"], "circuits.saved"),  # with provenance
    **dict.fromkeys(["compression_cuts", "compression_table"], "circuits.compression"),  # what streaming/pruning cuts
    # views/: every name of analyses/views/ (save_figure, long_view, ...)
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
