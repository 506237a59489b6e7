"""The circuit view (issue 49) in a real browser (``browser.py``: any request other than the page itself, or a console
error, fails a test): a 300-edge SmolLM2 circuit page is under 1 MB and paints in under 1 s; the slider keeps the top
n edges and shows the saved faithfulness at n; hover gives an edge's score and a head's atlas labels; a click gives
the head's pattern, equal to the model's; markup in token strings, labels and the model name stays text. The static
figure draws the same edges; `interp circuit --out DIR` writes the view, the figure and the circuit's JSON."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch
from browser import Page, chromium
from test_saved_circuits import synthetic_circuit

import interp
from analyses import circuit_figure, circuit_view, load_circuit, save_figure
from analyses.cli import main
from analyses.data.provenance import model_record

matplotlib.use("Agg")
MARKUP = '<script>alert(1)</script><img src=x onerror="alert(2)">&amp;'


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


def _visible_edges(p) -> list[int]:
    return p.eval_on_selector_all('[data-role="edge"]', "es => es.filter(e => e.style.display !== 'none')"
                                                        ".map(e => +e.dataset.rank)")


def _hover_edge(p, rank: int) -> None:
    """Move the mouse onto the middle of edge ``rank``'s stroke (a path's box centre may miss its curve)."""
    x, y = p.eval_on_selector(f'[data-role="edge"][data-rank="{rank}"]', """e => {
        const l = e.getTotalLength(), pt = e.getPointAtLength(l / 2), m = e.getScreenCTM();
        return [pt.x * m.a + pt.y * m.c + m.e, pt.x * m.b + pt.y * m.d + m.f]; }""")
    p.mouse.move(x, y)


def test_smollm2_300_edge_page_is_under_1_mb_and_paints_under_1_s(browser, tmp_path):
    """300 edges on SmolLM2's graph (30 layers of 9 heads, 3 key/value heads), each head's pattern on an IOI prompt
    from the real model."""
    model = interp.load_model("smollm2")
    circuit = synthetic_circuit(n_edges=300)
    circuit.provenance["model"] = model_record(model, "smollm2")
    prompt = "When Mary and John went to the store, John gave a drink to"
    view = circuit_view(circuit, model, prompt)
    path = view.save(tmp_path / "smollm2.html")
    size = path.stat().st_size
    assert size < 1_000_000, size
    assert len(view.data["edges"]) == 300 and len(view.data["patterns"]["heads"]) > 100
    page = Page(browser, path.read_text(), width=1600)
    p = page.page
    ready_ms = float(p.get_attribute(".interp-view", "data-ready-ms"))
    assert ready_ms < 1000, ready_ms
    assert p.locator('[data-role="edge"]').count() == 300
    assert p.locator('[data-role="node"][data-kind="head"]').count() == 270
    assert _visible_edges(p) == list(range(1, 301))  # opens on the curve's largest size, 300
    head = next(iter(view.data["patterns"]["heads"]))
    p.click(f'[data-role="node"][data-node="{head}"]')
    n = len(view.data["patterns"]["tokens"])
    assert p.get_attribute('[data-role="pattern"]', "data-node") == head
    assert p.locator('[data-role="pattern"] rect[data-weight]').count() == n * n
    page.check_clean()
    page.screenshot(tmp_path / "smollm2.png")
    page.close()


def test_slider_keeps_the_top_n_edges_and_shows_the_saved_faithfulness(browser):
    circuit = synthetic_circuit(n_edges=300)
    page = Page(browser, circuit_view(circuit, top=50).page())
    p = page.page
    assert _visible_edges(p) == list(range(1, 51))
    assert "0.550 [0.450, 0.650] (measured)" in p.text_content('[data-role="faithfulness"]')

    def slide(n):
        p.eval_on_selector('[data-role="slider"]', "(s, n) => { s.value = n; s.dispatchEvent(new Event('input')); }", n)

    slide(75)  # between the sizes 50 and 100: on the line between 0.55 and 0.74
    assert _visible_edges(p) == list(range(1, 76))
    assert float(p.get_attribute('[data-role="faithfulness"]', "data-value")) == pytest.approx(0.645, abs=1e-9)
    assert circuit.faithfulness_at(75) == pytest.approx(0.645, abs=1e-12)
    slide(10)  # below the smallest size measured
    assert "not measured" in p.text_content('[data-role="faithfulness"]')
    p.focus('[data-role="slider"]')
    p.keyboard.press("End")  # the keyboard moves it too
    assert _visible_edges(p) == list(range(1, 301)) and "300 of 300 edges" in p.text_content('[data-role="count"]')
    p.uncheck('[data-role="input-filter"][data-input="k"]')  # the k inputs hidden, the others kept
    shown = set(_visible_edges(p))
    ks = set(np.flatnonzero(circuit.edges["input"].to_numpy() == "k") + 1)
    assert shown == set(range(1, 301)) - ks and ks
    page.check_clean()
    page.close()


def test_hover_gives_the_edges_score_and_the_heads_atlas_labels(browser):
    circuit = synthetic_circuit(n_edges=40)
    atlas = {"model": {"name": "SmolLM2-135M-Instruct", "weights_sha256": "a" * 64},
             "heads": [{"site": "blocks.3.attn", "head": 2, "label": "induction", "labels": "induction,previous_token"}]}
    view = circuit_view(circuit, atlas=atlas, top=40)
    page = Page(browser, view.page(), width=1600)
    p = page.page
    signs = p.eval_on_selector_all('[data-role="edge"]', "es => es.map(e => [e.dataset.sign, e.getAttribute('stroke'),"
                                                         " +e.getAttribute('stroke-width')])")
    scores = circuit.edges["score"].to_numpy()[:40]
    assert [s for s, _, _ in signs] == ["+" if v >= 0 else "-" for v in scores]
    assert {c for s, c, _ in signs if s == "+"} == {"#2166ac"} and {c for s, c, _ in signs if s == "-"} == {"#b2182b"}
    widths = [w for _, _, w in signs]
    assert widths == sorted(widths, reverse=True) and widths[0] > 3 * widths[-1]  # sized by |score|
    for rank in (1, 7):
        _hover_edge(p, rank)
        tip = p.text_content('[data-role="tooltip"]')
        row = circuit.edges.iloc[rank - 1]
        assert row["upstream"] in tip and f"rank {rank}" in tip
        assert f"{row['score']:+.4g}" in tip.replace("score ", "")
    p.hover('[data-role="node"][data-node="blocks.3.attn:2"]')
    assert "atlas: induction,previous_token" in p.text_content('[data-role="tooltip"]')
    assert p.is_visible('[data-role="tooltip"]')
    page.check_clean()
    page.close()
    other = {**atlas, "model": {"name": "gpt2", "weights_sha256": "f" * 64}}
    with pytest.raises(ValueError, match="the atlas is of 'gpt2'.*pass the atlas of the circuit's model"):
        circuit_view(circuit, atlas=other)


def test_markup_in_tokens_labels_and_the_model_name_stays_text(browser):
    circuit = synthetic_circuit(n_edges=30, name=MARKUP)
    atlas = {"model": {"weights_sha256": "a" * 64}, "heads": [{"site": "blocks.1.attn", "head": 0, "label": MARKUP,
                                                                "labels": MARKUP}]}
    view = circuit_view(circuit, atlas=atlas, title=None)
    view.data["patterns"] = {"tokens": [MARKUP, "</script>", "b"], "skipped": 0,
                             "heads": {"blocks.1.attn:0": "AAAAAAAAAAAA"}}
    html = view.page()
    assert "<script>alert" not in html and "<img" not in html and html.count("</script>") == 2  # data + code
    page = Page(browser, html)
    p = page.page
    dialogs = []
    p.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    assert MARKUP in p.text_content('[data-role="title"]')
    p.hover('[data-role="node"][data-node="blocks.1.attn:0"]')
    assert MARKUP in p.text_content('[data-role="tooltip"]')
    p.click('[data-role="node"][data-node="blocks.1.attn:0"]')
    texts = p.eval_on_selector_all('[data-role="pattern"] text', "ts => ts.map(t => t.textContent)")
    assert MARKUP in texts and "</script>" in texts
    assert p.locator("img").count() == 0 and dialogs == [] and p.title() == html.split("<title>")[1].split("<")[0] \
        .replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&#x27;", "'").replace("&amp;", "&")
    page.check_clean()
    page.close()


def test_static_figure_draws_the_top_edges_by_sign_and_size(tmp_path):
    circuit = synthetic_circuit(n_edges=120)
    ax = circuit_figure(circuit, top=60)
    patches = ax.patches
    assert len(patches) == 60
    scores = circuit.edges["score"].to_numpy()[:60]
    reds = [p.get_edgecolor()[0] > p.get_edgecolor()[2] for p in patches]
    assert reds == list(scores < 0)
    widths = [p.get_linewidth() for p in patches]
    assert widths == sorted(widths, reverse=True)
    assert "faithfulness 0.55" in ax.get_title() or "faithfulness 0.5" in ax.get_title()
    png, svg = save_figure(ax.figure, tmp_path / "c.png"), save_figure(ax.figure, tmp_path / "c.svg")
    assert png.stat().st_size > 20_000 and svg.read_text().count("<path") > 60
    with pytest.raises(ValueError, match="top must be a positive integer"):
        circuit_figure(circuit, top=0)


def test_bad_arguments_get_one_line():
    circuit = synthetic_circuit(n_edges=10)
    with pytest.raises(ValueError, match="model and prompt together"):
        circuit_view(circuit, prompt="a b c")
    with pytest.raises(ValueError, match="max_edges must be a positive integer; got 0"):
        circuit_view(circuit, max_edges=0)
    with pytest.raises(TypeError, match="atlas is a head atlas"):
        circuit_view(circuit, atlas=["not", "an", "atlas"])


def test_interp_circuit_writes_the_view_figure_and_json_on_the_toy_model(browser, tmp_path, capsys):
    """End to end on the toy induction model: the saved circuit loads against the model, the view's head pattern
    equals the model's pattern on the task's first prompt (8-bit), and the page is clean."""
    out = tmp_path / "circuit"
    assert main(["circuit", "--model", "toy-induction", "--task", "induction", "--steps", "2", "--edges", "20",
                 "--n-prompts", "4", "--random", "1", "--out", str(out)]) == 0
    assert "circuit.html" in capsys.readouterr().out
    toy = interp.load_model("toy-induction")
    circuit = load_circuit(out / "circuit.json", model=toy)
    assert circuit.provenance["task"] == "induction" and circuit.provenance["steps"] == 2
    assert list(circuit.curve["size"]) == [2, 5, 10, 20] and (out / "circuit.png").stat().st_size > 10_000
    page = Page(browser, (out / "circuit.html").read_text())
    p = page.page
    assert len(_visible_edges(p)) == 20
    head = "blocks.1.attn:0"
    p.click(f'[data-role="node"][data-node="{head}"]')
    shown = p.eval_on_selector_all('[data-role="pattern"] rect[data-weight]', "rs => rs.map(r => [+r.dataset.q, "
                                                                               "+r.dataset.k, +r.dataset.weight])")
    from analyses.data.tasks import induction_task

    clean, _, _ = induction_task(toy, n=4, length=12, seed=0)
    with torch.no_grad():
        _, cache = toy.run_with_cache(clean[:1])
    pattern = cache.pattern(1, [0])[0, 0, -24:, -24:].numpy()
    n = len(p.eval_on_selector_all('[data-role="pattern"] text', "ts => ts")) // 2
    assert n == min(24, pattern.shape[0]) and len(shown) == n * n
    assert max(abs(w - pattern[q, k]) for q, k, w in shown) <= 0.5 / 255 + 5e-4  # 8 bits, shown to 3 decimals
    page.check_clean()
    page.close()


def test_the_reports_edge_circuit_on_the_toy_model_and_its_note_where_the_graph_does_not_apply(tmp_path, monkeypatch):
    """The report's part (analyses.views.report_circuit): the toy's induction circuit of 40 edges beats its random
    circuits, its two figures are added, the finding says so in one sentence; a BERT gets the graph's one-line
    note, and a graph over the report's size (SmolLM2's) a note that says what to run instead."""
    from analyses.data.tasks import induction_task
    from analyses.views.report_circuit import edge_circuit, edge_circuit_finding, edge_circuit_html
    from analyses.views.report_parts import _Figures
    from tests.tiny import tiny_model

    toy = interp.load_model("toy-induction")
    clean, corrupted, metric = induction_task(toy, n=8, length=12, seed=0)
    figures = _Figures(tmp_path / "figures")
    task = {"clean": clean, "corrupted": corrupted, "metric": metric, "name": "the <b>induction</b> task"}
    c = edge_circuit(toy, task, figures)
    assert set(figures.items) == {"edge_circuit", "edge_faithfulness"} and c["total"] == 110
    assert [r["size"] for r in c["curve"]] == [10, 20, 40] and c["size"] == 40
    assert c["lo"] > c["random_max"] and c["faithfulness"] > 0.5
    finding = edge_circuit_finding(c, task["name"])
    assert "<b>" not in finding and "&lt;b&gt;induction" in finding and "not separated" not in finding
    assert f"{c['faithfulness'] * 100:.0f}%" in finding and "random circuits of that size" in finding
    page = edge_circuit_html(c, figures, task["name"])
    assert page.count("<img") == 2 and "&lt;b&gt;" in page
    latent = interp.load_model(tiny_model("deepseek_v3"))  # latent attention: q is not a linear map per head
    skipped = edge_circuit(latent, task, figures)
    assert "q_a_layernorm" in skipped["skipped"] and edge_circuit_finding(skipped, "x") is None
    assert "Not run: Edge circuits patch each head&#x27;s q, k and v input" in edge_circuit_html(skipped, figures, "x")
    import analyses.views.report_circuit as part

    monkeypatch.setattr(part, "MAX_GRAPH", 100)
    big = edge_circuit(toy, task, figures)["skipped"]
    assert big.startswith("this model's graph has 110 edges") and "interp circuit --task induction" in big
