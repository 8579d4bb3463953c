#!/usr/bin/env bash
# Write the commits upstream..patched of the workdir back to patches/ and series (byte-stable).
#
#   scripts/export.sh [--workdir DIR]
#
# Workdir: --workdir DIR, else $SGLANG_FORK_DIR, else ~/sglang-fork.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then show_help export; fi
check_values export.sh "$@"
sglpatch_cmd export --project "$SGLPATCH_HOME" --workdir "${SGLANG_FORK_DIR:-$HOME/sglang-fork}" "$@"
