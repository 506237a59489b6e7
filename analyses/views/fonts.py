"""Token labels in figures: a font for every character an installed font can draw, a visible escape for the rest.

matplotlib draws text in ``rcParams["font.family"]`` (DejaVu Sans by default) and, for a character that font lacks,
a box and a "Glyph ... missing from font(s)" warning: MiniLM's vocabulary holds Bengali, CJK and other scripts,
which random tokens hit. Here each label's characters are looked up in DejaVu Sans, then in the other installed fonts
(Debian: ``fonts-noto-core``, ``fonts-noto-cjk``, ``fonts-freefont-ttf``, ``fonts-lohit-*`` ... where installed);
the families that draw them follow DejaVu Sans in the artist's own font list (matplotlib falls back along it glyph
by glyph), and a character no installed font has is shown as its escape, ``\\u09ac``. Nothing global changes:
the families are set on the labels, never in ``rcParams``.

>>> labels, families = token_labels(["said", "\\u0378"])  # U+0378 is unassigned: no font has it
>>> labels, families[0]
(['said', '\\\\u0378'], 'DejaVu Sans')
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache, lru_cache

from interp.tokens.display import visible

__all__ = ["clean_token", "token_labels"]

_FIRST = "DejaVu Sans"  # matplotlib's default family, on every installation (it ships the files)
_PREFERRED = ("Noto Sans", "FreeSans", "Liberation Sans", "DejaVu Sans Mono", "FreeSerif")  # after it, before others
# never fallbacks: matplotlib's Last Resort font draws every character as a box (what the escape replaces), and the
# TeX and STIX size fonts put math symbols at the code points of letters
_NOT_TEXT = ("Last Resort", "cm", "STIXNonUnicode", "STIXSize")


def clean_token(token: str) -> str:
    """A token string fit for a tick label: BPE space/newline markers made visible (``interp.tokens.display.visible``), ``$``
    escaped (matplotlib would read it as mathtext)."""
    return visible(token).replace("$", r"\$")


@cache
def _fonts() -> tuple[tuple[str, str], ...]:
    """``(family, file)`` of each installed font matplotlib can use, its regular face where it has one: DejaVu Sans
    first, then the preferred families, then the others by name."""
    from matplotlib import font_manager

    faces: dict[str, object] = {}
    for entry in font_manager.fontManager.ttflist:
        if entry.name.startswith(_NOT_TEXT):
            continue
        best = faces.get(entry.name)
        rank = (entry.style != "normal", abs(_weight(entry.weight) - 400))
        if best is None or rank < (best.style != "normal", abs(_weight(best.weight) - 400)):
            faces[entry.name] = entry
    order = sorted(faces, key=lambda name: (name != _FIRST, name not in _PREFERRED,
                                            _PREFERRED.index(name) if name in _PREFERRED else 0, name))
    return tuple((name, faces[name].fname) for name in order)


def _weight(weight) -> int:
    names = {"ultralight": 200, "light": 300, "normal": 400, "regular": 400, "book": 400, "medium": 500,
             "semibold": 600, "demibold": 600, "bold": 700, "heavy": 800, "extra bold": 800, "black": 900}
    return weight if isinstance(weight, int) else names.get(str(weight).lower(), 400)


@cache
def _charmap(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):  # a font file matplotlib cannot read draws nothing
        return frozenset()


@lru_cache(maxsize=8192)
def _family_of(char: str) -> str | None:
    """The first installed family (in ``_fonts`` order) with a glyph for ``char``; None when none has one."""
    for family, path in _fonts():
        if ord(char) in _charmap(path):
            return family
    return None


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def token_labels(labels: Iterable[str]) -> tuple[list[str], list[str]]:
    """Labels as a figure can show them, and the font families to set on their artists (``fontfamily=``).

    Every character some installed font draws stays; its family joins the list after DejaVu Sans. A character
    none draws, and any whitespace but a space or control character (``interp.tokens.display.visible`` has already shown
    spaces, newlines and tabs), becomes ``\\uXXXX``, so a reader sees which character it was instead of a box.
    """
    shown, families = [], [_FIRST]
    for label in labels:
        out = []
        for char in str(label):
            family = _family_of(char) if char == " " or char.isprintable() and not char.isspace() else None
            if family is None:
                out.append(_escape(char))
                continue
            if family not in families:
                families.append(family)
            out.append(char)
        shown.append("".join(out))
    return shown, families
