"""Issue 52, "a user's files, pages and registry": a shared atlas JSON cannot put script on a page, no verb
overwrites a file the user owns or writes outside its folder, and the score registry takes a record whole or not
at all."""

from __future__ import annotations

import copy

import pytest

import interp
from analyses.atlas.atlas import build_atlas
from analyses.views.atlas import atlas_page

EVIL = '"><script>alert(1)</script><img src=x onerror=alert(2)>'


@pytest.fixture(scope="module")
def atlas():
    model = interp.load_model("toy-induction")
    return build_atlas(model, n_prompts=4, seq_len=16, context=64, draws=2, n_bootstrap=20,
                       scores=["previous_token", "induction"])


_NAMED_BY_USER = ("scores", "not_run", "values")  # dicts whose keys are names (a score's, a column's)


def _poison(value, parent=None):
    """Every string in the file, and every name that keys a dict, with script in front."""
    if isinstance(value, dict):
        return {(EVIL + k if parent in _NAMED_BY_USER else k): _poison(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_poison(v) for v in value]
    return EVIL + value if isinstance(value, str) else value


def _safe(page: str) -> None:
    assert "<script>alert" not in page and "<img" not in page and "onerror=alert(2)>" not in page
    assert "&lt;script&gt;alert(1)" in page


def test_an_atlas_page_escapes_every_string_the_file_holds(atlas):
    bad = _poison(atlas)
    assert bad["causal"]["rows"] and bad["heads"][0]["label"].startswith(EVIL)
    _safe(atlas_page(bad, heads_page="x_heads.html"))


@pytest.mark.parametrize("where", ["settings.seed", "settings.n_prompts", "settings.draws", "cost.cpu_s",
                                   "cost.threads", "model.heads", "model.parameters", "schema", "heads.head",
                                   "heads.value", "scores.threshold", "scores.column", "causal.draws"])
def test_a_number_replaced_by_script_is_shown_as_text(atlas, where):
    bad = copy.deepcopy(atlas)
    section, _, key = where.partition(".")
    if section == "schema":
        bad["schema"] = EVIL
    elif section == "heads":
        h = bad["heads"][0]
        if key == "value":
            next(iter(h["values"].values()))["value"] = EVIL
        else:
            h[key] = EVIL
    elif section == "scores":
        next(r for r in bad["scores"].values() if r.get("threshold") is not None)[key] = EVIL
    else:
        bad[section][key] = EVIL
    _safe(atlas_page(bad, heads_page="x_heads.html"))
