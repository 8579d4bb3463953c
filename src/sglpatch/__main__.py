"""``python -m sglpatch``: the same command line as the ``sglpatch`` console script."""

import sys

from sglpatch.cli import main

sys.exit(main())
