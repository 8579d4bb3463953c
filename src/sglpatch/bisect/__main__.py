"""``python -m sglpatch.bisect --step STATE``: what ``git bisect run`` calls at every step."""

import sys

from sglpatch.bisect.step import main

if __name__ == "__main__":
    sys.exit(main())
