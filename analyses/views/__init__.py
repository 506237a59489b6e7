"""What a person looks at: interactive attention views, static plots and the HTML report. May import every study
room of ``analyses`` (``data`` to ``atlas``); only the CLI imports it.

- ``head_view``, ``attention_grid`` (``attention.py``): one self-contained HTML page or notebook output each,
  with inline JavaScript and CSS (``assets/``) and no network request.
- ``attention_heatmap`` (``plots.py``), ``head_score_grid``, ... (``study_plots.py``): matplotlib figures, for
  papers and the report.
- ``write_report`` (``report.py``): the page ``interp report`` writes.

Names load on first use, so that importing this package imports neither matplotlib nor the report (which
draws with whatever backend is set, saving and closing each figure).
"""

from __future__ import annotations

import importlib

from .. import _VIEWS as _LAZY  # one list of the views, kept beside the package's other names

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'analyses.views' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
