#!/usr/bin/env bash
# Thin entry point: move the series onto a new SGLang release.
#   scripts/rebase.sh --onto 0.5.10.post1 --dry-run     # upstream watch: table, exit 0/2/3
#   scripts/rebase.sh --onto 0.5.10.post1               # rebase (recorded resolutions replay)
#   scripts/rebase.sh --continue | --skip | --abort
# Defaults: workdir ${SGLANG_FORK_DIR:-$HOME/sglang-fork}, --source sdist (set SGLPATCH_SOURCE=git).
set -euo pipefail
args=("$@")
have() { local f; for f in "${args[@]}"; do [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0; done; return 1; }
if ! have --workdir; then args+=(--workdir "${SGLANG_FORK_DIR:-$HOME/sglang-fork}"); fi
if have --onto && ! have --source; then args+=(--source "${SGLPATCH_SOURCE:-sdist}"); fi
if command -v sglpatch >/dev/null 2>&1; then
  exec sglpatch rebase "${args[@]}"
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m sglpatch.cli rebase "${args[@]}"
