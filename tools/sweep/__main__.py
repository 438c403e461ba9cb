"""``python -m tools.sweep``: see :mod:`tools.sweep`."""

import sys

from tools.sweep import main

sys.exit(main())
