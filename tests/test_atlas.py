"""The head atlas (issue 38): built on a tiny model, kept as versioned JSON, compared with ``diff_atlas`` and
``interp atlas diff``, shown as one offline page; and the committed atlas of MiniLM checked again: its digests match
the installed model and a fresh previous-token score on its recorded prompts falls inside its committed intervals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import interp
from analyses.heads import registry
from analyses.atlas.atlas import SCHEMA, build_atlas, diff_atlas, load_atlas, save_atlas
from analyses.data.provenance import weights_digest
from analyses.cli import main
from analyses.views.atlas import atlas_page, write_atlas_pages
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "notebooks" / "atlas"


@pytest.fixture(scope="module")
def tiny():
    """The toy model (2 layers x 4 heads, trained): it has previous-token and induction heads, so its classes get a
    causal check."""
    return interp.load_model("toy-induction")


@pytest.fixture(scope="module")
def atlas(tiny):
    return build_atlas(tiny, n_prompts=8, seq_len=16, context=64, draws=3, n_bootstrap=50)


def test_the_atlas_holds_every_head_every_score_that_ran_and_why_the_others_did_not(tiny, atlas):
    n_heads = sum(s.n_heads for s in tiny.cfg.sites)
    assert len(atlas["heads"]) == n_heads and atlas["schema"] == SCHEMA
    assert {"previous_token", "induction", "sink"} <= set(atlas["scores"])
    assert set(atlas["scores"]) | set(atlas["not_run"]) == set(registry.names())  # every score is accounted for
    assert "tokenizer" in atlas["not_run"]["successor"]  # a model without a tokenizer: said why
    assert "not run by default" in atlas["not_run"]["name_mover"]
    induction = atlas["scores"]["induction"]
    assert len(induction["prompt_sha256"]) == 64 and induction["threshold"] == 0.4
    for h in atlas["heads"]:
        e = h["values"]["previous_token"]
        assert e["lo"] - 1e-12 <= e["value"] <= e["hi"] + 1e-12
    rows = atlas["causal"]["rows"]  # a causal LM: each class against random heads, every draw kept
    assert rows and all(len(r["random_share"]) == 3 for r in rows)
    assert len(atlas["model"]["weights_sha256"]) == 64 and atlas["versions"]["torch"]


@pytest.mark.parametrize("model_type", ["bart", "t5"])  # T5: no position limit in its config; a bare T5Model
def test_an_encoder_decoder_model_gets_an_atlas_per_site(model_type, tmp_path):
    model = interp.load_model(tiny_model(model_type))
    atlas = build_atlas(model, n_prompts=6, seq_len=10, context=64, draws=2, n_bootstrap=20)
    sites = {h["site"] for h in atlas["heads"]}
    assert sites == {s.name for s in model.cfg.sites}  # encoder, decoder self- and cross-attention sites
    assert {"alignment", "source_sink", "previous_token"} <= set(atlas["scores"])
    cross = [h for h in atlas["heads"] if "cross" in h["site"]]
    assert cross and all(h["values"]["previous_token"]["value"] is None for h in cross)  # NaN / NA: null in JSON
    assert "not_run" in atlas["causal"]  # no causal LM: said why
    save_atlas(atlas, tmp_path / "m.json")
    write_atlas_pages(model, atlas, tmp_path, "m")
    assert diff_atlas(load_atlas(tmp_path / "m.json"), atlas)["changed"] == []


def test_the_weights_digest_changes_with_one_weight():
    tiny = interp.load_model(tiny_model("llama"))
    before = weights_digest(tiny)
    p = next(tiny.hf.parameters())
    with torch.no_grad():
        p.view(-1)[0] += 1.0
        try:
            assert weights_digest(tiny) != before
        finally:
            p.view(-1)[0] -= 1.0
    assert weights_digest(tiny) == before


def test_json_round_trip_and_an_unknown_schema_is_refused(atlas, tmp_path):
    path = save_atlas(atlas, tmp_path / "a.json")
    back = load_atlas(path)
    assert back == json.loads(json.dumps(back)) and back["heads"] == atlas["heads"]
    assert diff_atlas(atlas, back) == {"changed": [], "missing": [], "added": [], "notes": []}
    (tmp_path / "b.json").write_text(json.dumps({**back, "schema": SCHEMA + 1}))
    with pytest.raises(ValueError, match=f"schema {SCHEMA + 1}.*reads schema {SCHEMA}"):
        load_atlas(tmp_path / "b.json")


def test_diff_finds_a_changed_label_and_a_value_outside_its_interval(atlas, tmp_path):
    other = copy.deepcopy(atlas)
    other["heads"][0]["label"], other["heads"][0]["labels"] = "made_up", "made_up"
    entry = other["heads"][1]["values"]["previous_token"]
    entry["value"] = entry["hi"] + 0.01
    found = diff_atlas(atlas, other)
    assert [c["head"] for c in found["changed"]] == ["0.0", "0.1"]
    assert "label" in found["changed"][0]["what"][0] and "outside" in found["changed"][1]["what"][0]
    save_atlas(atlas, tmp_path / "a.json")
    save_atlas(other, tmp_path / "b.json")
    assert main(["atlas", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert main(["atlas", "diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0


def test_force_replaces_our_atlas_and_never_a_file_we_did_not_write(tmp_path, capsys):
    args = ["atlas", "--model", "toy-induction", "--out", str(tmp_path), "--n-prompts", "4", "--draws", "2",
            "--scores", "previous_token,induction", "--threads", "1"]
    (tmp_path / "toy-induction.json").write_text('{"mine": true}')
    assert main(args + ["--force"]) == 2
    assert "not a file interp atlas wrote" in capsys.readouterr().err
    assert (tmp_path / "toy-induction.json").read_text() == '{"mine": true}'
    (tmp_path / "toy-induction.json").unlink()
    assert main(args) == 0
    assert main(args) == 2 and "pass --force" in capsys.readouterr().err
    assert main(args + ["--force"]) == 0
    assert set(load_atlas(tmp_path / "toy-induction.json")["scores"]) == {"previous_token", "induction"}


def test_the_page_shows_every_head_filters_sorts_and_links_each_head_offline(tiny, atlas, tmp_path):
    from tests.browser import URL, Page, chromium

    page_path, heads_path = write_atlas_pages(tiny, atlas, tmp_path, "tiny", text=torch.arange(3, 12))
    text = page_path.read_text()
    assert "http://" not in text and "https://" not in text and "<script src" not in text
    with chromium() as browser:
        page = Page(browser, text)
        rows = page.page.eval_on_selector_all('[data-role="head"]', "rs => rs.map(r => r.dataset.layer + '.' + "
                                              "r.dataset.head)")
        assert sorted(rows) == sorted(f"{h['layer']}.{h['head']}" for h in atlas["heads"])
        page.page.select_option('[data-role="layer-filter"]', "1")
        shown = page.page.eval_on_selector_all('[data-role="head"]:not([hidden])', "rs => rs.map(r => r.dataset.layer)")
        assert shown and set(shown) == {"1"}
        page.page.select_option('[data-role="layer-filter"]', "")
        column = list(atlas["heads"][0]["values"]).index("previous_token") + 4
        page.page.click(f'[data-role="heads"] th:nth-child({column + 1})')
        values = page.page.eval_on_selector_all('[data-role="head"]', f"rs => rs.map(r => +r.cells[{column}].dataset.value)")
        assert values == sorted(values, reverse=True)
        link = page.page.get_attribute('[data-role="head"] a', "href")
        assert link.startswith(heads_path.name + "#layer=")
        page.check_clean()
        page.close()
        view = browser.new_page()
        view.route("**/*", lambda route: route.fulfill(status=200, content_type="text/html",
                                                       body=heads_path.read_bytes()))
        view.goto(URL + "#layer=1&head=2")
        view.wait_for_function("document.querySelector('.interp-view').dataset.ready")
        assert view.eval_on_selector('[data-role="layer"]', "s => s.value") == "1"
        pressed = view.eval_on_selector_all('[data-role="head"][aria-pressed="true"]', "bs => bs.map(b => b.dataset.head)")
        assert pressed == ["2"]


def test_the_page_warns_of_an_unstable_score(atlas):
    unstable = copy.deepcopy(atlas)
    unstable["scores"]["induction"]["stability"] = {"spearman": 0.2, "top_k_overlap": 0.3, "k": 4, "unstable": True}
    assert 'class="warn">Unstable rankings' in atlas_page(unstable) and "Unstable rankings" not in atlas_page(atlas)


def test_the_committed_minilm_atlas_is_found_again():
    """MiniLM (installed in CI by the `models` extra) against notebooks/atlas/minilm.json: the same weights and
    tokenizer, the same prompts (their digest), and a fresh previous-token score of every head inside the committed
    95% interval, its label unchanged."""
    from analyses import detect_heads
    from analyses.data.provenance import tokenizer_digest

    committed = load_atlas(COMMITTED / "minilm.json")
    model = interp.load_model("minilm", attn=committed["versions"]["attn"], device="cpu")
    assert committed["model"]["weights_sha256"] == weights_digest(model)
    assert committed["model"]["tokenizer_sha256"] == tokenizer_digest(model)
    s = committed["settings"]
    # induction too: detect_heads draws the repeated-token prompts first, then the corpus prompts from the same seeded
    # generator, so previous_token's prompts are the atlas's only when a repeated-token score is drawn before them
    fresh = detect_heads(model, scores=["induction", "previous_token"], n_prompts=s["n_prompts"], seq_len=s["seq_len"],
                         seed=s["seed"], n_bootstrap=100)
    assert fresh.attrs["prompt_sha256"]["induction"] == committed["scores"]["induction"]["prompt_sha256"]
    assert fresh.attrs["prompt_sha256"]["previous_token"] == committed["scores"]["previous_token"]["prompt_sha256"]
    heads = {(h["layer"], h["head"]): h for h in committed["heads"]}
    assert len(heads) == len(fresh) == 72
    for layer, head, value in zip(fresh["layer"], fresh["head"], fresh["previous_token"]):
        e = heads[(int(layer), int(head))]["values"]["previous_token"]
        assert e["lo"] - 1e-6 <= value <= e["hi"] + 1e-6, (layer, head, value, e)
        labels = heads[(int(layer), int(head))]["labels"].split("+")
        assert ("previous_token" in labels) == (value >= committed["scores"]["previous_token"]["threshold"])
    strongest = max(committed["heads"], key=lambda h: h["values"]["previous_token"]["value"])
    assert (strongest["layer"], strongest["head"]) == (0, 2)  # REFERENCE.md: head 0.2, 99.96% on the previous token
