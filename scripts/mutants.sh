#!/usr/bin/env bash
# Plant the faults of tests/mutants.py in each line's patches and show that a test catches each
# (issue 18); the table goes to results/mutants/. Needs the test venvs (scripts/test.sh builds them).
#
#   scripts/mutants.sh [--line 0.5.23|0.5.9|all] [--out DIR]
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then usage; exit 0; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${SGLPATCH_TEST_VENV:-$HERE/.venv}/bin/python"
export PATH="$(dirname "$PY"):$PATH"
exec "$PY" "$HERE/tests/mutants.py" "$@"
