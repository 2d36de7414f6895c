"""``python -m smptk ...`` is the same as the ``smptk`` console script."""

import sys

from smptk.cli import main

sys.exit(main())
