#!/usr/bin/env bash
# Thin entry point: the series against every SGLang release after the pin (or --releases A..B).
#   scripts/watch.sh                                   # terminal matrix; exit 3 when the newest release needs a human
#   scripts/watch.sh --json r.json --markdown r.md     # also JSON + a markdown report to paste into an issue
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd="scripts/watch.sh $*"
if command -v sglpatch >/dev/null 2>&1 && [[ -z "${SGLPATCH_FROM_SOURCE:-}" ]]; then
  exec sglpatch watch --project "$here" --command-line "$cmd" "$@"
fi
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m sglpatch.cli watch --project "$here" --command-line "$cmd" "$@"
