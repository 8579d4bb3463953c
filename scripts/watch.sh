#!/usr/bin/env bash
# The series against every SGLang release after the pin: `sglpatch watch` on this project.
#
#   scripts/watch.sh                                     # terminal matrix; exit 3: the newest release needs a human
#   scripts/watch.sh --releases 0.5.21..0.5.23           # only these releases
#   scripts/watch.sh --releases 0.5.10,0.5.21,0.5.23     # exactly these releases
#   scripts/watch.sh --json r.json --markdown r.md       # also JSON + a markdown report to paste into an issue
#   scripts/watch.sh --recheck                           # classify every release again (a rerun reuses what it found)
#
# Trees are cached in ${SGLPATCH_CACHE:-~/.cache/sglpatch}/trees.git: a second run takes seconds.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then show_help watch; fi
check_values watch.sh "$@"
sglpatch_cmd watch --project "$SGLPATCH_HOME" --command-line "scripts/watch.sh${*:+ $*}" "$@"
