#!/usr/bin/env bash
# Install what the tests need into the active Python (idempotent) and run them.
# Needs: git, Debian's quilt and patch (installed with apt-get when run as root).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
PY="${PYTHON:-python3}"
if ! command -v quilt >/dev/null || ! command -v patch >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing quilt and patch with apt-get" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq quilt patch >/dev/null
  else
    echo "test.sh: quilt/patch missing; install them (apt-get install quilt patch)" >&2; exit 2
  fi
fi
echo "test.sh: installing test requirements into $PY (no-op when present)" >&2
"$PY" -m pip install -q --disable-pip-version-check -r requirements-test.txt -e ".[dev]"
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
