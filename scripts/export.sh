#!/usr/bin/env bash
# Write the commits upstream..patched of the workdir back to patches/ and series (byte-stable).
#
#   scripts/export.sh [--line RELEASE] [--workdir DIR]
#
# Workdir: --workdir DIR, else the line's own: $SGLANG_FORK_DIR (else ~/sglang-fork), with -RELEASE
# appended for --line RELEASE (sglpatch resolves it; this script passes the options through).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then show_help export; fi
check_values export.sh "$@"
sglpatch_cmd export --project "$SGLPATCH_HOME" "$@"
