#!/usr/bin/env bash
# Plant the faults of tests/mutant_faults.py in each line's patches and in the tool's own math
# (src/sglpatch: profile-report, the decision table, the kernel judge and crossover, bisect's exit
# codes) and show that a test catches each (issues 18, 29); the table goes to results/mutants/.
# Needs the test venvs (scripts/test.sh builds them). --only ID,... re-runs some, merged into the table.
#
#   scripts/mutants.sh [--line 0.5.23|0.5.9|tool|all] [--only ID[,ID...]] [--check] [--out DIR]
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then help_text; exit 0; fi  # the usage, then the exit codes (0 all killed, 1 one survived)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${SGLPATCH_TEST_VENV:-$HERE/.venv}/bin/python"
export PATH="$(dirname "$PY"):$PATH"
exec "$PY" "$HERE/tests/mutants.py" "$@"
