#!/usr/bin/env bash
# Move the series onto a new SGLang release: `sglpatch rebase` with the workdir default.
#
#   scripts/rebase.sh --onto 0.5.10.post1 --dry-run     # upstream watch: table; exit 3 when a human is needed
#   scripts/rebase.sh --onto 0.5.10.post1               # rebase into lines/0.5.10.post1/ (recorded resolutions replay)
#   scripts/rebase.sh --onto 0.5.10.post1 --promote     # the same over the primary series, patches/, upstream.lock
#   scripts/rebase.sh --continue | --skip | --abort
#
# Defaults: workdir: a real rebase onto R works in ${SGLANG_FORK_DIR:-$HOME/sglang-fork}-R (the
# line's own; the primary's tree, which a serving venv imports, never moves), a dry run reads
# ${SGLANG_FORK_DIR:-$HOME/sglang-fork}, --continue/--skip/--abort find the one with a rebase in
# progress; project: this checkout; --source sdist (set SGLPATCH_SOURCE=git).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then show_help rebase; fi
check_values rebase.sh "$@"
args=("$@")
have() { local f; for f in "${args[@]}"; do [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0; done; return 1; }
if ! have --project; then args+=(--project "$SGLPATCH_HOME"); fi  # this checkout, from any cwd
if have --onto && ! have --source; then args+=(--source "${SGLPATCH_SOURCE:-sdist}"); fi
sglpatch_cmd rebase "${args[@]}"
