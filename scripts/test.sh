#!/usr/bin/env bash
# Install what the tests need into a private venv (.venv here, or $SGLPATCH_TEST_VENV; with
# PYTHON=... that interpreter instead) and run them. The venv keeps the test requirements
# (torch 2.14.1, transformers 4.57.1, ...) away from the Python that serves your models.
# Needs: git, Debian's quilt and patch (installed with apt-get when run as root).
#
#   scripts/test.sh [PYTEST ARGS...]      e.g. scripts/test.sh tests/test_stack.py -k export
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
else
  VENV="${SGLPATCH_TEST_VENV:-$HERE/.venv}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "test.sh: creating the test venv $VENV" >&2
    python3 -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
fi
if ! command -v quilt >/dev/null || ! command -v patch >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing quilt and patch with apt-get" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq quilt patch >/dev/null
  else
    echo "test.sh: quilt/patch missing; install them (apt-get install quilt patch)" >&2; exit 2
  fi
fi
echo "test.sh: installing test requirements into $PY (no-op when present; the first time takes minutes)" >&2
"$PY" -m pip install -q --disable-pip-version-check -r requirements-test.txt -e ".[dev]"
# the venv's tools (uv, black, sglpatch) on PATH, as an activated venv would have them
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
