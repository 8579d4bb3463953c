#!/usr/bin/env bash
# Move the series onto a new SGLang release: `sglpatch rebase` with the workdir default.
#
#   scripts/rebase.sh --onto 0.5.10.post1 --dry-run     # upstream watch: table; exit 3 when a human is needed
#   scripts/rebase.sh --onto 0.5.10.post1               # rebase (recorded resolutions replay)
#   scripts/rebase.sh --continue | --skip | --abort
#
# Defaults: workdir ${SGLANG_FORK_DIR:-$HOME/sglang-fork}, project: this checkout, --source sdist
# (set SGLPATCH_SOURCE=git).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then show_help rebase; fi
check_values rebase.sh "$@"
args=("$@")
have() { local f; for f in "${args[@]}"; do [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0; done; return 1; }
if ! have --workdir; then args+=(--workdir "${SGLANG_FORK_DIR:-$HOME/sglang-fork}"); fi
if ! have --project; then args+=(--project "$SGLPATCH_HOME"); fi  # this checkout, from any cwd
if have --onto && ! have --source; then args+=(--source "${SGLPATCH_SOURCE:-sdist}"); fi
sglpatch_cmd rebase "${args[@]}"
