"""Issue 47: the rooms moved modules, not names. Every name the two packages listed in ``__all__`` before the move
(written out here, so that a name dropped from ``__all__`` fails too) imports from the top package, and the top
package imports neither torch nor matplotlib until a name is used."""

import importlib
import subprocess
import sys

import pytest

ANALYSES = [
    "AttentionGrid", "DEFAULT_THRESHOLDS", "Expectation", "ExpectationSet", "HeadScore", "HeadView",
    "LABEL_ORDER", "LongView", "LowRank", "SCORE_DEFINITIONS", "ablate_heads", "ablation_heatmap",
    "ablation_scan", "activation_patching", "atlas_page", "attention_grid", "attention_heatmap",
    "attribution_patching", "build_atlas", "check_expectations", "composition_scores",
    "copy_suppression_scores", "curve_summary", "detect_heads", "diff_atlas", "direct_logit_attribution",
    "dla_bars", "effective_embedding", "embedding_similarity", "first_copy_loss", "function_vector",
    "function_vector_scores", "fv_accuracy", "head_importance", "head_labels", "head_score", "head_score_grid",
    "head_view", "icl_tasks", "induction_task", "ioi_task", "label_evidence", "label_heads", "lm_loss",
    "load_atlas", "logit_difference", "logit_lens", "long_view", "name_mover_scores", "needle_prompts",
    "needs_scores", "next_token_loss", "ov_circuit", "passkey_inputs", "patching_heatmap", "path_patching",
    "pattern_scores", "prune_model", "pruning_curve", "pruning_curve_plot", "qk_attribution",
    "qk_attribution_plot", "qk_circuit", "register_expectations", "retrieval_heads", "s_inhibition_scores",
    "save_atlas", "save_figure", "second_copy_loss", "streaming_curve", "streaming_curve_plot",
    "streaming_gates", "streaming_inputs", "streaming_order", "strongest_heads", "successor_scores",
    "target_rule", "write_atlas_pages", "write_report",
]
INTERP = [
    "BUNDLED", "EAGER_KEY", "FLASH_KEY", "HookedModel", "HookedTransformer", "LowRank", "ModelCache",
    "ModelConfig", "cache_kwarg", "kv_cache_bytes", "load_model", "output_cache", "set_progress", "set_threads",
    "stream_heads", "stream_model", "streaming_kv_bytes", "utils",
]


@pytest.mark.parametrize("package, names", [("analyses", ANALYSES), ("interp", INTERP)])
def test_every_public_name_imports_from_the_top_package(package, names):
    module = importlib.import_module(package)
    missing = [name for name in names if name not in module.__all__]
    assert missing == [], f"names dropped from {package}.__all__: {missing}"
    for name in names:
        assert getattr(module, name) is not None
        exec(f"from {package} import {name}", {})


def test_importing_analyses_loads_no_study_and_no_plotting_library():
    code = ("import sys, analyses; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib', 'seaborn') "
            "or m.startswith('analyses.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
