"""Issue 52, "a user's files, pages and registry": a shared atlas JSON cannot put script on a page, no verb
overwrites a file the user owns or writes outside its folder, and the score registry takes a record whole or not
at all."""

from __future__ import annotations

import copy
import json

import pytest

import interp
from analyses.atlas.atlas import build_atlas
from analyses.cli import main
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


def _atlas_args(tmp_path, *more):
    return ["atlas", "--model", "toy-induction", "--out", str(tmp_path / "out"), "--n-prompts", "4", "--draws", "2",
            "--scores", "previous_token,induction", "--threads", "1", *more]


@pytest.fixture
def expect_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "layers": 2, "heads": 4, "entries": [
        {"class": "induction", "heads": ["1.0"], "score": "induction", "test": "top", "k": 4}]}))
    return str(path)


def test_atlas_expect_never_overwrites_a_users_csv_and_force_replaces_only_ours(tmp_path, expect_file, capsys):
    out = tmp_path / "out"
    out.mkdir()
    csv = out / "toy-induction_expectations.csv"
    csv.write_text("my,own\n1,2\n")
    for force in ([], ["--force"]):
        assert main(_atlas_args(tmp_path, "--expect", expect_file, *force)) == 2
        assert "toy-induction_expectations.csv" in capsys.readouterr().err
        assert csv.read_text() == "my,own\n1,2\n" and not (out / "toy-induction.json").exists()
    csv.unlink()
    assert main(_atlas_args(tmp_path, "--expect", expect_file)) in (0, 1)
    ours = csv.read_text()
    assert main(_atlas_args(tmp_path, "--expect", expect_file)) == 2  # ours too needs --force
    assert main(_atlas_args(tmp_path, "--expect", expect_file, "--force")) in (0, 1)
    assert csv.read_text().splitlines()[0] == ours.splitlines()[0]


def test_interp_expect_force_does_not_replace_a_users_csv(tmp_path, expect_file, capsys):
    out = tmp_path / "e"
    out.mkdir()
    (out / "expectations.csv").write_text("mine\n")
    assert main(["expect", "--model", "toy-induction", "--expect", expect_file, "--out", str(out), "--force",
                 "--n-prompts", "4", "--threads", "1"]) == 2
    assert "not an expectations CSV interp wrote" in capsys.readouterr().err
    assert (out / "expectations.csv").read_text() == "mine\n"


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "/tmp/x", "a\\b", ""])
def test_atlas_name_cannot_leave_out(tmp_path, name, capsys):
    assert main(_atlas_args(tmp_path, "--name", name)) == 2
    assert "--name is a file name" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.html")) and not list(tmp_path.rglob("*.json"))


def test_attribute_qk_plot_never_overwrites_a_users_file(tmp_path, capsys):
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"my picture")
    args = ["attribute", "--model", "toy-induction", "--qk", "1.1", "--n-prompts", "4", "--draws", "0", "--threads",
            "1", "--plot", str(mine)]
    assert main(args) == 2
    assert "pass --force" in capsys.readouterr().err and mine.read_bytes() == b"my picture"
    assert main(args + ["--force"]) == 0 and mine.read_bytes()[:4] == b"\x89PNG"  # the user asked: replaced
    assert main(["attribute", "--model", "toy-induction", "--force"]) == 2  # --force belongs to --qk --plot


# -- the registry --------------------------------------------------------------------------------------------------
def _write_module(folder, stem, body):
    path = folder / f"{stem}.py"
    path.write_text("import analyses\n\n" + body)
    return str(path)


_RULE = '''
@analyses.head_score({name!r}, threshold=0.3)
def rule(ids):
    return ids * 0 - 1
'''


def test_another_module_cannot_replace_a_users_score(tmp_path, capsys):
    from analyses.heads import registry

    first = _write_module(tmp_path, "mine", _RULE.format(name="b2_mine"))
    second = _write_module(tmp_path, "theirs", _RULE.format(name="b2_mine"))
    try:
        assert main(["heads", "--model", "toy-induction", "--score-module", first, "--score-module", second,
                     "--scores", "b2_mine", "--n-prompts", "2", "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert "registered already, from interp_scores_mine" in err and "Traceback" not in err
        assert registry.score("b2_mine").rule.__module__ == "interp_scores_mine"  # the user's own stays
        with pytest.raises(ValueError, match="registered already, from interp_scores_mine"):  # from Python too
            __import__("analyses").head_score("b2_mine")(lambda ids: ids * 0 - 1)
    finally:
        registry.unregister("b2_mine")


def test_a_notebook_cell_run_again_replaces_its_own_score():
    import analyses
    from analyses.heads import registry

    try:
        for threshold in (0.3, 0.5):
            @analyses.head_score("b2_cell", threshold=threshold)
            def rule(ids):
                return ids * 0 - 1
        assert registry.score("b2_cell").threshold == 0.5
    finally:
        registry.unregister("b2_cell")


@pytest.mark.parametrize("field, value, says", [
    ("precedence", "high", "precedence is an integer"), ("precedence", 1.5, "precedence is an integer"),
    ("label", 3, "label is None or an identifier"), ("needs", ("gpu",), "needs is a tuple of some of"),
    ("needs", "tokenizer", "needs is a tuple"), ("definition", 5, "definition is a string"),
    ("default", "yes", "default is True or False"), ("fraction", 1, "fraction is True, False or None"),
    ("extra", ("a", 1), "extra is a tuple of column names"), ("check", "vibes", "check is None or one of"),
    ("sites", "causal", "sites are some of"), ("column", "a b", "column is None or an identifier"),
    ("runner", "nocolon", "runner is None or 'module:function'"), ("threshold", True, "threshold is a fraction"),
    ("citation", None, "citation is a string")])
def test_a_record_is_checked_whole_when_registered(field, value, says):
    from analyses.heads import registry

    record = registry.HeadScore(**{"name": "b2_whole", "definition": "a test", "rule": lambda ids: ids * 0 - 1,
                                   field: value})
    with pytest.raises(ValueError, match=says):
        registry.register(record)
    assert "b2_whole" not in registry.names()


def test_precedence_high_is_refused_by_head_score_not_by_detect_heads():
    import analyses
    from analyses.heads import registry

    with pytest.raises(ValueError, match="precedence is an integer"):
        analyses.head_score("b2_high", precedence="high")(lambda ids: ids * 0 - 1)
    assert "b2_high" not in registry.names()


def test_a_score_module_that_fails_after_registering_registers_nothing(tmp_path, capsys):
    from analyses.heads import registry

    broken = _write_module(tmp_path, "broken", _RULE.format(name="b2_left") + _RULE.format(name="b2_left_too")
                           + "\nraise RuntimeError('my module breaks here')\n")
    before = registry.names()
    assert main(["heads", "--model", "toy-induction", "--score-module", broken, "--n-prompts", "2",
                 "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "my module breaks here" in err and "Traceback" not in err
    assert registry.names() == before and "interp_scores_broken" not in __import__("sys").modules
