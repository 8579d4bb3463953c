#!/usr/bin/env bash
# Regression-test on the GPUs: `sglpatch regress` with the profile default.
#
#   scripts/regress.sh --tier kernel                      # profile from $SGLPATCH_PROFILE or the target
#   scripts/regress.sh --tier all --report /data/regress/run1
#   scripts/regress.sh --tier kernel --stress [N]          # + N custom-allreduce results checked against NCCL
#
# Profile: --profile, else $SGLPATCH_PROFILE, else rtx6000x8-kimi-k25; --report DIR, else
# $SGLPATCH_REGRESS_DIR/<UTC time> when that is set, else ./regress-<UTC time>.
# Exit: 0 pass, 1 regression, 125 cannot run here (git bisect run skips).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then show_help regress; fi
check_values regress.sh "$@"
export PYTHONUNBUFFERED=1
args=("$@")
have() { local f; for f in "${args[@]}"; do [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0; done; return 1; }
if ! have --profile; then args+=(--profile "${SGLPATCH_PROFILE:-rtx6000x8-kimi-k25}"); fi
if ! have --report && [[ -n "${SGLPATCH_REGRESS_DIR:-}" ]]; then
  args+=(--report "$SGLPATCH_REGRESS_DIR/$(date -u +%Y%m%d-%H%M%S)")
fi
if command -v sglpatch >/dev/null 2>&1; then
  exec sglpatch regress "${args[@]}"
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m sglpatch.regress "${args[@]}"
