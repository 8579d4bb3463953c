#!/usr/bin/env bash
# Find the first bad patch: `sglpatch bisect` with the workdir default.
#
#   scripts/bisect.sh [options] -- CMD [ARGS...]
#   scripts/bisect.sh --triage -- scripts/regress.sh --tier kernel
#   scripts/bisect.sh --triage --timeout 3600 -- scripts/regress.sh --tier server
#
# Workdir: --workdir DIR, else the line's own: $SGLANG_FORK_DIR (else ~/sglang-fork), with -RELEASE
# appended for --line RELEASE (sglpatch resolves it); project: this checkout.
# CMD: 0 good, 1 bad, 125 skip (cannot run here); 2 (a usage error) stops with no verdict.
# Exit: 0 a conclusion (first bad patch / upstream / no regression), 1 open (skips) or error,
# 125 CMD could not run at any step (no verdict), 130 Ctrl-C.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
export PYTHONUNBUFFERED=1
if wants_help "$@"; then show_help bisect; fi
check_values bisect.sh "$@"
args=("$@")
have_opt() {  # only the options before "--" belong to sglpatch; the rest is CMD's
  local f
  for f in "${args[@]}"; do
    [[ "$f" == "--" ]] && return 1
    [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0
  done
  return 1
}
if ! have_opt --project; then args=(--project "$SGLPATCH_HOME" "${args[@]}"); fi  # this checkout, from any cwd
sglpatch_cmd bisect "${args[@]}"
