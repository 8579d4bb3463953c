"""`python -m sglpatch.gpu.doctor`: the same as `sglpatch doctor`, without the series side's dependencies."""

import sys

from sglpatch.gpu.doctor.run import main

sys.exit(main())
