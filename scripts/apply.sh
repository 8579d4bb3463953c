#!/usr/bin/env bash
# The one command on the inference container: materialize the pinned SGLang, build branch
# `patched` from the series, install it (editable, --no-deps) into your Python, and say what
# is now imported. Safe to re-run: an up-to-date workdir makes no commit.
#
#   scripts/apply.sh [--workdir DIR] [--python PATH] [--source auto|git|sdist] [--no-install] [--force]
#                    [--with-flashinfer]
#
# Defaults: workdir ${SGLANG_FORK_DIR:-$HOME/sglang-fork}; python: the active venv, else
# ~/ml-env/bin/python3 when it exists, else python3; source auto (git when the upstream URL
# answers within a few seconds, otherwise the registry sdist).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
check_values apply.sh "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKDIR="${SGLANG_FORK_DIR:-$HOME/sglang-fork}"
SOURCE=auto
PY=""
WITH_FLASHINFER=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) WORKDIR="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --source) SOURCE="$2"; shift 2 ;;
    --workdir=*) WORKDIR="${1#*=}"; shift ;;
    --python=*) PY="${1#*=}"; shift ;;
    --source=*) SOURCE="${1#*=}"; shift ;;
    --with-flashinfer) WITH_FLASHINFER=1; shift ;;
    --no-install|--force) EXTRA+=("$1"); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "apply.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$PY" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python3" ]; then PY="$VIRTUAL_ENV/bin/python3"
  elif [ -x "$HOME/ml-env/bin/python3" ]; then PY="$HOME/ml-env/bin/python3"
  else PY="$(command -v python3)"; fi
fi
echo "apply.sh: python $PY, workdir $WORKDIR, source $SOURCE" >&2

UV="$(command -v uv || true)"; [ -z "$UV" ] && [ -x "$HOME/.local/bin/uv" ] && UV="$HOME/.local/bin/uv"
pip_install() {  # installs into $PY with uv when available (the user's habit), else pip
  if [ -n "$UV" ]; then "$UV" pip install --python "$PY" "$@"; else "$PY" -m pip install "$@"; fi
}
if ! "$PY" -c "import sglpatch" 2>/dev/null; then
  echo "apply.sh: installing the sglpatch tool into $PY" >&2
  pip_install -q -e "$HERE"
fi
"$PY" -m sglpatch.cli apply --project "$HERE" --workdir "$WORKDIR" --source "$SOURCE" --python "$PY" ${EXTRA[@]+"${EXTRA[@]}"}

if [ "$WITH_FLASHINFER" = 1 ]; then
  # P1 (opt-in SM120 allreduce fusion) needs flashinfer >= 0.6.17; docs/p1-flashinfer-sm120.md
  # says why and what was (statically) checked. Not a drop-in: 0.6.17 refuses to import beside
  # flashinfer-cubin 0.6.3, and its SM12x JIT needs nvcc >= 12.9 at server run time.
  echo "apply.sh: installing flashinfer-python==0.6.17 for P1 (rollback: flashinfer-python==0.6.3 flashinfer-cubin==0.6.3)" >&2
  pip_install "flashinfer-python==0.6.17"
  for pkg in flashinfer-cubin flashinfer-jit-cache; do
    if "$PY" -m pip show "$pkg" >/dev/null 2>&1 || { [ -n "$UV" ] && "$UV" pip show --python "$PY" "$pkg" >/dev/null 2>&1; }; then
      echo "apply.sh: removing $pkg (its version must match flashinfer-python; on-demand cubins are used instead)" >&2
      if [ -n "$UV" ]; then "$UV" pip uninstall --python "$PY" "$pkg"; else "$PY" -m pip uninstall -y "$pkg"; fi
    fi
  done
  "$PY" -c "import flashinfer; print('apply.sh: flashinfer', flashinfer.__version__)" \
    || echo "apply.sh: warning: flashinfer does not import; roll back with the command above" >&2
  echo "apply.sh: launch the server with CUDA_HOME pointing at CUDA >= 12.9 and --enable-flashinfer-allreduce-fusion" >&2
fi
