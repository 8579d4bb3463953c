#!/usr/bin/env bash
# Check the box before a load: `sglpatch doctor` with the profile default. Run it first on a new box.
#
#   scripts/doctor.sh                          # profile from $SGLPATCH_PROFILE or the target
#   scripts/doctor.sh --kill-stale             # first end stale SGLang / torch workers (asks; --yes does not)
#   scripts/doctor.sh --json /data/doctor.json --kernel-report /data/regress/kernel-run
#
# One line per check (ok / warn / fail / skip) with the fix on the same line: GPU processes, the
# serving Python (sglang, patches, torch, flashinfer, sgl-kernel, NCCL_* / SGLANG_* as it sees
# them), driver and nvcc, /dev/shm, locked memory, MAX_JOBS, topology, a P2P copy per GPU pair,
# free GPU memory against the profile's model. `scripts/regress.sh --tier server` runs it first.
# Profile: --profile, else $SGLPATCH_PROFILE, else rtx6000x8-kimi-k25.
# Exit: 0 nothing failed, 1 a check failed, 125 no GPU visible here, 2 a usage error.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
VALUE_OPTS+="--kernel-report --nvidia-smi --p2p-timeout "
if wants_help "$@"; then show_help doctor; fi
check_values doctor.sh "$@"
export PYTHONUNBUFFERED=1
args=("$@")
have() { local f; for f in "${args[@]}"; do [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0; done; return 1; }
if ! have --profile; then args+=(--profile "${SGLPATCH_PROFILE:-rtx6000x8-kimi-k25}"); fi
if ! have --project; then args+=(--project "$SGLPATCH_HOME"); fi  # this checkout, from any cwd
sglpatch_cmd doctor "${args[@]}"  # the tool's own venv (psutil is there), never the system's python3
