#!/usr/bin/env bash
# Write the commits upstream..patched of the workdir back to patches/ and series (byte-stable).
#   scripts/export.sh [--workdir DIR]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "${PYTHON:-python3}" -m sglpatch.cli export --project "$HERE" --workdir "${SGLANG_FORK_DIR:-$HOME/sglang-fork}" "$@"
