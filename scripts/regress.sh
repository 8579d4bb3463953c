#!/usr/bin/env bash
# Regression-test on the GPUs: `sglpatch regress` with the profile default.
#
#   scripts/regress.sh --tier kernel                      # profile from $SGLPATCH_PROFILE or the target
#   scripts/regress.sh --tier all --report-dir /data/regress/run1
#   scripts/regress.sh --tier kernel --stress [N]          # + N custom-allreduce results checked against NCCL
#
# Profile: --profile, else $SGLPATCH_PROFILE, else rtx6000x8-kimi-k25; --report-dir DIR, else
# $SGLPATCH_REGRESS_DIR/<UTC time> when that is set, else ./regress-<UTC time>.
# The Python under test: --python PATH, else (cpu tier) the one apply.sh installed the workdir
# into, else the profile's. Exit: 0 pass, 1 regression, 125 cannot run here (git bisect run skips).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then show_help regress; fi
check_values regress.sh "$@"
export PYTHONUNBUFFERED=1
args=("$@")
have() { local f; for f in "${args[@]}"; do [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0; done; return 1; }
if ! have --profile; then args+=(--profile "${SGLPATCH_PROFILE:-rtx6000x8-kimi-k25}"); fi
if ! have --project; then args+=(--project "$SGLPATCH_HOME"); fi  # this checkout, from any cwd
if ! have --report-dir && ! have --report && [[ -n "${SGLPATCH_REGRESS_DIR:-}" ]]; then
  args+=(--report-dir "$SGLPATCH_REGRESS_DIR/$(date -u +%Y%m%d-%H%M%S)")
fi
sglpatch_cmd regress "${args[@]}"
