"""``python -m autodeploy`` is the ``autodeploy`` console script (what ``torchrun -m autodeploy`` runs)."""

import sys

from .cli import main

sys.exit(main())
