"""What both reports (``report.py``, ``seq2seq_report.py``) share: the figures (written in every format asked for,
embedded as 2x PNGs); their studies are in ``report_studies.py``. Below both, so neither imports the other back."""

from __future__ import annotations

import base64
import html
import io
import struct
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt  # the backend stays the user's: figures are saved and closed, never shown
from PIL import Image  # matplotlib's own dependency

from .plots import FORMATS

_DPI = 200  # the page shows PNGs at half their pixel size: 100 px per inch, sharp on high-density screens


def _png(fig) -> bytes:
    """A 2x PNG reduced to 256 colours: a third of the bytes (a 30 x 9 score grid: 1.1 MB to 0.3 MB), and the same
    picture, since a figure has few colours (maximum coverage keeps white white and viridis' yellow yellow)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    image = Image.open(buf).convert("RGB").quantize(256, method=Image.Quantize.MAXCOVERAGE, dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="png")
    return out.getvalue()


class _Figures:
    """Writes each figure to ``figures/NAME.{fmt}`` in every format asked for, and keeps a 2x PNG for the page."""

    def __init__(self, folder: Path, formats: Sequence[str] = ("png",)):
        self.folder = folder
        self.formats = tuple(formats)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.items: dict[str, bytes] = {}

    def add(self, name: str, fig) -> str:
        data = _png(fig)
        for fmt in self.formats:
            path = self.folder / f"{name}.{fmt}"
            path.write_bytes(data) if fmt == "png" else fig.savefig(path, format=fmt, bbox_inches="tight")
        plt.close(fig)
        self.items[name] = data
        return name

    def img(self, name: str, alt: str) -> str:
        data = self.items[name]
        width, height = struct.unpack(">II", data[16:24])  # the PNG header's IHDR
        return (f'<img src="data:image/png;base64,{base64.b64encode(data).decode()}" width="{width * 100 // _DPI}" '
                f'height="{height * 100 // _DPI}" alt="{html.escape(alt)}">')


def _formats(fmt: str | Sequence[str]) -> tuple[str, ...]:
    formats = (fmt,) if isinstance(fmt, str) else tuple(fmt)
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        got = ", ".join(map(str, bad)) or "none"
        raise ValueError(f"Figure formats are {', '.join(FORMATS)} (one or several); got {got}.")
    return formats
