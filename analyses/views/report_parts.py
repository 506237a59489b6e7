"""What the report (``report.py``) is drawn with: the figures (written in every format asked for,
embedded as 2x PNGs); its studies are in ``report_studies.py``. Below the report and its page, which import it."""

from __future__ import annotations

import base64
import html
import io
import struct
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt  # the backend stays the user's: figures are saved and closed, never shown
import numpy as np
from PIL import Image  # matplotlib's own dependency

from .plots import FORMATS

_DPI = 200  # the page shows PNGs at half their pixel size: 100 px per inch, sharp on high-density screens


def _png(fig) -> bytes:
    """A 2x PNG reduced to 256 colours: a third of the bytes (a 30 x 9 score grid: 1.1 MB to 0.3 MB), and the same
    picture, since a figure has few colours (maximum coverage keeps white white and viridis' yellow yellow)."""
    image = _drawn(fig).quantize(256, method=Image.Quantize.MAXCOVERAGE, dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="png")
    return out.getvalue()


def _drawn(fig) -> Image.Image:
    """The figure drawn at ``_DPI`` and cut as ``savefig(bbox_inches="tight")`` cuts it (its artists' extent plus
    ``savefig.pad_inches`` of background), from the canvas's own pixels: less time than saving a PNG and reading it
    back, most of a report's figure time. A figure whose artists reach beyond its edges is saved the usual way
    (which grows the canvas to hold them), and so is one whose backend draws no pixels (a vector backend's)."""
    if not hasattr(fig.canvas, "buffer_rgba"):
        return _saved(fig)
    dpi = fig.dpi
    fig.set_dpi(_DPI)
    try:
        fig.canvas.draw()
        box = fig.get_tightbbox(fig.canvas.get_renderer())
        pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    finally:
        fig.set_dpi(dpi)
    width, height = fig.get_size_inches()
    if box.x0 < 0 or box.y0 < 0 or box.x1 > width or box.y1 > height:
        return _saved(fig)
    rows, cols = pixels.shape[:2]
    box = box.padded(plt.rcParams["savefig.pad_inches"])
    x0, y0 = round(box.x0 * _DPI), round(rows - box.y1 * _DPI)  # pixel rows run top down
    x1, y1 = x0 + int(box.width * _DPI), y0 + int(box.height * _DPI)  # savefig's size: the box's, truncated
    background = tuple(round(255 * c) for c in fig.get_facecolor()[:3])
    image = Image.new("RGB", (x1 - x0, y1 - y0), background)  # the padding beyond the canvas is background
    inside = pixels[max(y0, 0):min(y1, rows), max(x0, 0):min(x1, cols)]
    image.paste(Image.fromarray(np.ascontiguousarray(inside)), (max(-x0, 0), max(-y0, 0)))
    return image


def _saved(fig) -> Image.Image:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight", pil_kwargs={"compress_level": 0})  # read back at once
    return Image.open(buf).convert("RGB")


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
