#!/usr/bin/env bash
# The one command on the inference container: materialize the pinned SGLang, build branch
# `patched` from the series, install it (editable, --no-deps) into your Python, and say what
# is now imported. Safe to re-run: an up-to-date workdir makes no commit.
#
#   scripts/apply.sh [--workdir DIR] [--python PATH] [--source auto|git|sdist] [--no-install] [--force]
#                    [--with-flashinfer] [--venv NEWDIR [--dry-run] [--release-artifact PATH] [--cuda 12.N]]
#
# Defaults: workdir ${SGLANG_FORK_DIR:-$HOME/sglang-fork}; python: the active venv, else
# ~/ml-env/bin/python3 when it exists, else python3; source auto (git when the upstream URL
# answers within a few seconds, otherwise the registry sdist).
#
# --venv NEWDIR: do not install into that python; build a NEW venv in NEWDIR from it, holding the
# pinned release's full dependency set (its own Requires-Dist, resolved by uv or pip) and the
# patched tree, after a preflight (NVIDIA driver vs the torch build's CUDA, wheels for the
# Python, free disk, nvcc >= 12.9 when --with-flashinfer on SM12x) that refuses with one line
# per failed condition. --dry-run prints the verdict and the resolved plan, changing nothing.
# --cuda 12.N (offered by the preflight when the driver is below 580): the CUDA 12 builds instead,
# from the indexes deps/cuda12.toml names, or a refusal naming the way out.
# The tree goes to its own workdir (WORKDIR-VERSION unless --workdir is given; refused when it is
# the tree PYTHON serves from). The tool itself runs from this checkout's .venv (created if
# needed) unless PYTHON already has it; nothing is installed into PYTHON.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
check_values apply.sh "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKDIR="${SGLANG_FORK_DIR:-$HOME/sglang-fork}"
WORKDIR_GIVEN=()
SOURCE=auto
PY=""
WITH_FLASHINFER=0
VENV=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) WORKDIR="$2"; WORKDIR_GIVEN=(--workdir "$2"); shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --source) SOURCE="$2"; shift 2 ;;
    --workdir=*) WORKDIR="${1#*=}"; WORKDIR_GIVEN=(--workdir "$WORKDIR"); shift ;;
    --python=*) PY="${1#*=}"; shift ;;
    --source=*) SOURCE="${1#*=}"; shift ;;
    --with-flashinfer) WITH_FLASHINFER=1; shift ;;
    --venv) VENV="$2"; shift 2 ;;
    --venv=*) VENV="${1#*=}"; shift ;;
    --release-artifact|--cuda) EXTRA+=("$1" "$2"); shift 2 ;;
    --release-artifact=*|--cuda=*|--dry-run) EXTRA+=("$1"); shift ;;
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
if [ -n "$VENV" ]; then echo "apply.sh: new venv $VENV from python $PY, source $SOURCE" >&2
else echo "apply.sh: python $PY, workdir $WORKDIR, source $SOURCE" >&2; fi

UV="$(command -v uv || true)"; [ -z "$UV" ] && [ -x "$HOME/.local/bin/uv" ] && UV="$HOME/.local/bin/uv"
pip_install() {  # installs into $PY with uv when available (the user's habit), else pip
  if [ -n "$UV" ]; then "$UV" pip install --python "$PY" "$@"; else "$PY" -m pip install "$@"; fi
}
if [ -n "$VENV" ]; then
  # a new venv: PYTHON is only the interpreter it is made from; nothing is installed into it
  TOOL="$PY"
  if ! "$TOOL" -c "import sglpatch" 2>/dev/null; then
    TOOL="$HERE/.venv/bin/python"
    if ! [ -x "$TOOL" ] || ! "$TOOL" -c "import sglpatch" 2>/dev/null; then
      echo "apply.sh: installing the sglpatch tool into $HERE/.venv (not into $PY)" >&2
      if [ -n "$UV" ]; then "$UV" venv -q --allow-existing --python "$PY" "$HERE/.venv"; else "$PY" -m venv "$HERE/.venv"; fi
      if [ -n "$UV" ]; then "$UV" pip install -q --python "$TOOL" -e "$HERE"; else "$TOOL" -m pip install -q -e "$HERE"; fi
    fi
  fi
  [ "$WITH_FLASHINFER" = 1 ] && EXTRA+=(--with-flashinfer)
  # without --workdir the tree goes to WORKDIR-VERSION: the serving venv's editable tree stays as it is
  exec "$TOOL" -m sglpatch.cli apply --project "$HERE" ${WORKDIR_GIVEN[@]+"${WORKDIR_GIVEN[@]}"} --source "$SOURCE" --python "$PY" --venv "$VENV" ${EXTRA[@]+"${EXTRA[@]}"}
fi
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
