"""What every view shares: the page a view is (``HeadView``, ``AttentionGrid``: a fragment with its data, style and
script inline, saved as one offline page), token labels, and the packing of weights (``_quantise``: uint16 at 4
decimals, ``_b64``) under one size limit. Below the views of ``attention.py``, ``seq2seq.py`` and ``plots.py``."""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from interp.runtime.files import atomic_write
from interp.tokens.display import display_tokens, visible

ASSETS = Path(__file__).resolve().parent / "assets"
SCALE = 10_000  # weights are embedded as round(weight * SCALE): 4 decimals
MAX_BYTES = 24_000_000  # refuse views whose weights alone would embed more than this
MIN_FONT = 7.5  # points, in figures: 10.4 px at 100 px per inch


def visible_token(token) -> str:
    """A token string with its whitespace visible (``interp.tokens.display.visible``): ``Ġ``/``▁``/spaces as ``␣``, newlines
    as ``\\n``."""
    return visible(token)


def model_tokens(model, ids) -> list[str]:
    """The display form of ``ids`` (``interp.tokens.display.display_tokens``), or their numbers without a tokenizer."""
    if model.tokenizer is None:
        return [str(int(i)) for i in ids]
    return display_tokens(model.tokenizer, ids)


# -- the pages -------------------------------------------------------------------------------------------
class _View:
    """One interactive view: ``data`` (what the page embeds), ``html`` (a fragment), ``save(path)`` (a page)."""

    kind = ""
    assets = ("view.css", "view.js")  # its style and script, inline (assets/)

    def __init__(self, data: dict):
        self.data = data

    @property
    def html(self) -> str:
        """A self-contained fragment: its data, style and script inline."""
        payload = _no_surrogates(json.dumps(self.data, ensure_ascii=False, separators=(",", ":")))
        payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        return (f'<div class="interp-view" data-view="{self.kind}">'
                f'<style>{_asset(self.assets[0])}</style>'
                f'<script type="application/json" class="iv-data">{payload}</script>'
                '<p class="iv-fallback">This view is drawn by JavaScript. In a notebook, run the cell again (or trust '
                'the notebook); or save it with <code>view.save("view.html")</code> and open the file.</p>'
                f'<script>{_asset(self.assets[1])}</script></div>')

    def _repr_html_(self) -> str:
        return self.html

    def page(self) -> str:
        """The view as a whole HTML page."""
        title = html.escape(_no_surrogates(str(self.data.get("title", "attention"))))
        return ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
                '<meta name="viewport" content="width=device-width, initial-scale=1">'
                f'<link rel="icon" href="data:,"><title>{title}</title></head>\n<body>{self.html}</body></html>\n')

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the view as one HTML page that opens offline; returns the path. The page is written whole or not
        at all (``interp.runtime.files.atomic_write``); an existing file is replaced only with ``overwrite=True``."""
        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"A view is saved as an .html page; got {str(path)!r}.")
        return atomic_write(path, self.page(), overwrite=overwrite)

    def __repr__(self) -> str:
        d = self.data
        n_heads = sum(len(h) for h in d["heads"])
        if "sites" in d:
            return (f"{type(self).__name__}({len(d['source']['tokens'])} source + {len(d['target']['tokens'])} target "
                    f"tokens, {n_heads} heads in {len(d['layers'])} site(s); .save(path) writes one offline page)")
        return (f"{type(self).__name__}({len(d['tokens'])} tokens, {n_heads} heads in "
                f"{len(d['layers'])} layer(s); .save(path) writes one offline page)")


class HeadView(_View):
    """Lines (or heatmaps) between query and key tokens, one layer at a time; see ``head_view``."""

    kind = "head"


class AttentionGrid(_View):
    """Every head as a thumbnail of its pattern, coloured by a score; see ``attention_grid``."""

    kind = "grid"


def _no_surrogates(text: str) -> str:
    """``text`` that UTF-8 can encode: surrogate pairs joined into their character, a lone surrogate (a token
    string cut inside a character can hold one) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        joined = text.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")
        return re.sub("[\ud800-\udfff]", "\ufffd", joined)


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


# -- packing weights ------------------------------------------------------------------------------------
def _window(window, n: int) -> tuple[int, int]:
    if window is None:
        return 0, n
    try:
        lo, hi, _ = slice(*window).indices(n)
    except TypeError:
        raise ValueError(f"window is (start, stop) in positions; got {window!r}.") from None
    if hi - lo < 1:
        raise ValueError(f"window {tuple(window)} selects no position of a sequence of {n}; use start < stop <= {n}.")
    return lo, hi


def _quantise(weights: torch.Tensor, where: str = "the pattern", heads: Sequence[int] | None = None) -> np.ndarray:
    """Weights ``(h, ...)`` in 0..1 as uint16 ``round(w * 10000)``. NaN or inf is refused, naming ``where`` and the
    heads (``heads``: the head index of each row): cast to an integer it would be drawn as a real weight."""
    finite = torch.isfinite(weights).reshape(weights.shape[0], -1).all(-1)  # (h,)
    if not bool(finite.all()):
        bad = [heads[i] if heads is not None else i for i in (~finite).nonzero().flatten().tolist()]
        raise ValueError(f"The attention of {where}, head(s) {bad}, holds NaN or inf: the model computed non-finite "
                         "values there (check its weights and inputs, e.g. torch.isfinite on model.hf's parameters, "
                         "or the dtype's range). A view would draw them as weights; show other heads with heads=.")
    return torch.round(weights.double() * SCALE).clamp(0, SCALE).to(torch.int32).numpy().astype("<u2")


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<u2").tobytes()).decode("ascii")
