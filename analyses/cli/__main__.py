"""``python -m analyses.cli`` (and ``torchrun -m analyses.cli``): the ``interp`` command."""

import sys

from . import main

sys.exit(main())
