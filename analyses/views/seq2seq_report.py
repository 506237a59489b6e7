"""The former names of an encoder-decoder model's report, which is now the one report of every model
(``report.write_report``: its sections read the model's attention sites) with the copy task's inputs
(``analyses.seq2seq.copy_study_inputs``)."""

from __future__ import annotations

from ..seq2seq import copy_study_inputs as seq2seq_study_inputs  # noqa: F401
from .report import write_seq2seq_report  # noqa: F401

__all__ = ["write_seq2seq_report", "seq2seq_study_inputs"]
