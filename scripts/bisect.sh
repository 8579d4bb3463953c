#!/usr/bin/env bash
# Thin entry point for the container: sglpatch bisect with the workdir default.
#   scripts/bisect.sh --triage -- scripts/regress.sh --tier kernel
#   scripts/bisect.sh --triage --timeout 3600 -- scripts/regress.sh --tier server
# Workdir: --workdir DIR, else $SGLANG_FORK_DIR, else ~/sglang-fork. CMD: 0 good, 125 skip, other bad.
# Exit: 0 a conclusion (first bad patch / upstream / no regression), 1 open (skips) or error, 130 Ctrl-C.
set -euo pipefail
export PYTHONUNBUFFERED=1
args=("$@")
have_opt() {  # only the options before "--" belong to sglpatch; the rest is CMD's
  local f
  for f in "${args[@]}"; do
    [[ "$f" == "--" ]] && return 1
    [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0
  done
  return 1
}
if ! have_opt --workdir; then args=(--workdir "${SGLANG_FORK_DIR:-$HOME/sglang-fork}" "${args[@]}"); fi
if command -v sglpatch >/dev/null 2>&1; then
  exec sglpatch bisect "${args[@]}"
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m sglpatch.cli bisect "${args[@]}"
