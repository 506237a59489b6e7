"""Moved to ``analyses.views.report`` (issue 14: what a person looks at lives in ``analyses/views/``).

This module re-exports it so that ``from analyses.report import write_report`` keeps working.
"""

from .views.report import *  # noqa: F401,F403
from .views.report import REPORT_FILES, __all__, example_prompt, prompt_batch, study_inputs, write_report  # noqa: F401
