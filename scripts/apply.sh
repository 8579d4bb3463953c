#!/usr/bin/env bash
# The one command on the inference container: build the pinned SGLang release with the patch
# series applied (branch `patched` of a git workdir) and install it into the Python you serve
# from, then say what that Python now imports. Safe to re-run: an up-to-date workdir makes no commit.
#
#   scripts/apply.sh [--line RELEASE] [--workdir DIR] [--python PATH] [--source auto|git|sdist] [--no-install] [--force]
#                    [--with-flashinfer [--dry-run]] [--venv NEWDIR [--dry-run] [--release-artifact PATH] [--cuda 12.N]]
#
# What goes where:
#   PYTHON (the serving one) gets only the patched sglang: editable, --no-deps. Its other packages
#     stay as they are; --no-install leaves it alone entirely.
#   The sglpatch tool runs from its own venv, ${SGLPATCH_TOOL_VENV:-<checkout>/.tool-venv}, made on first use.
#   The tree goes to the workdir; downloads to ${SGLPATCH_CACHE:-~/.cache/sglpatch}.
#
# --line RELEASE: the line in lines/RELEASE/ (`sglpatch lines` lists them) instead of the primary
# series; its workdir is ${SGLANG_FORK_DIR:-$HOME/sglang-fork}-RELEASE unless --workdir is given.
# A tree that a venv imports is never moved to another release (refused, naming the command).
#
# Defaults: workdir ${SGLANG_FORK_DIR:-$HOME/sglang-fork}; python: the active venv, else
# ~/ml-env/bin/python3 when it exists, else none (pass --python, --venv or --no-install; the
# system's own Python is refused: PEP 668); source auto (git when the upstream URL answers
# within a few seconds, otherwise the registry sdist).
#
# --venv NEWDIR: do not install into PYTHON; build a NEW venv in NEWDIR from it, holding the
# pinned release's full dependency set (its own Requires-Dist, resolved by uv or pip) and the
# patched tree, after a preflight (NVIDIA driver vs the torch build's CUDA, wheels for the
# Python, free disk, nvcc >= 12.8 when --with-flashinfer) that refuses with one line
# per failed condition. --dry-run prints the verdict and the resolved plan, changing nothing.
# --cuda 12.N (offered by the preflight when the driver is below 580): the CUDA 12 builds instead,
# from the indexes deps/cuda12.toml names, or a refusal naming the way out.
# The tree goes to its own workdir (WORKDIR-VERSION unless --workdir is given; refused when it is
# the tree PYTHON serves from). Without --python, PYTHON is as above, else python3.
# --with-flashinfer: PYTHON (or the new venv) also gets the flashinfer set deps/flashinfer.toml
# names, for P1 and P5 (flashinfer-python, what it overrides, minus what it removes), with uv when
# found, else pip; then `pip check` must name none of it. Re-running changes nothing; the versions
# it had are printed as the way back. --dry-run with it prints the plan and changes nothing.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then help_text; exit 0; fi
check_values apply.sh "$@"
WORKDIR_GIVEN=()
LINE=()
SOURCE=auto
PY=""
WITH_FLASHINFER=0
NO_INSTALL=0
VENV=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) WORKDIR_GIVEN=(--workdir "$2"); shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --line) LINE=(--line "$2"); shift 2 ;;
    --line=*) LINE=("$1"); shift ;;  # sglpatch refuses an empty one
    --source) SOURCE="$2"; shift 2 ;;
    --workdir=*) WORKDIR_GIVEN=("$1"); shift ;;
    --python=*) PY="${1#*=}"; shift ;;
    --source=*) SOURCE="${1#*=}"; shift ;;
    --with-flashinfer) WITH_FLASHINFER=1; EXTRA+=("$1"); shift ;;
    --venv) VENV="$2"; shift 2 ;;
    --venv=*) VENV="${1#*=}"; shift ;;
    --release-artifact|--cuda) EXTRA+=("$1" "$2"); shift 2 ;;
    --release-artifact=*|--cuda=*|--dry-run) EXTRA+=("$1"); shift ;;
    --no-install) NO_INSTALL=1; EXTRA+=("$1"); shift ;;
    --force|--other-release) EXTRA+=("$1"); shift ;;
    *) echo "apply.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY="${PY/#\~/$HOME}"  # --python=~/ml-env/bin/python3: the shell did not expand it
if [ -z "$PY" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python3" ] && [ ! -e "$VIRTUAL_ENV/$TOOL_STAMP" ]; then PY="$VIRTUAL_ENV/bin/python3"
  elif [ -x "$HOME/ml-env/bin/python3" ]; then PY="$HOME/ml-env/bin/python3"
  elif [ -n "$VENV" ]; then PY="$(command -v python3 || true)"; fi
fi
if [ -z "$PY" ] && [ -z "$VENV" ] && [ "$NO_INSTALL" = 0 ]; then
  echo "apply.sh: no Python to install into (no active venv, no ~/ml-env): pass --python PATH (your serving venv's python)," \
    "--venv NEWDIR (a new, complete venv), or --no-install (only build the tree)" >&2
  exit 2
fi
if [ "$WITH_FLASHINFER" = 1 ] && [ "$NO_INSTALL" = 1 ]; then
  echo "apply.sh: --with-flashinfer installs flashinfer into PYTHON; --no-install contradicts it" >&2
  exit 2
fi
PY_ARG=(); [ -n "$PY" ] && PY_ARG=(--python "$PY")

if [ -n "$VENV" ]; then
  echo "apply.sh: new venv $VENV from python ${PY:-python3}, source $SOURCE" >&2
  tool_python
  # without --workdir the tree goes to WORKDIR-VERSION: the serving venv's editable tree stays as it is
  exec "$TOOL_PY" -m sglpatch apply --project "$SGLPATCH_HOME" ${LINE[@]+"${LINE[@]}"} ${WORKDIR_GIVEN[@]+"${WORKDIR_GIVEN[@]}"} --source "$SOURCE" \
    ${PY_ARG[@]+"${PY_ARG[@]}"} --venv "$VENV" ${EXTRA[@]+"${EXTRA[@]}"}
fi
# the line and its workdir are resolved by sglpatch (sglpatch.context), which prints them
if [ "$NO_INSTALL" = 1 ]; then echo "apply.sh: source $SOURCE; --no-install: nothing is installed anywhere" >&2
elif [ "$WITH_FLASHINFER" = 1 ]; then echo "apply.sh: python $PY (gets the patched sglang and deps/flashinfer.toml's flashinfer set), source $SOURCE" >&2
else echo "apply.sh: python $PY (gets only the patched sglang), source $SOURCE" >&2; fi
tool_python
"$TOOL_PY" -m sglpatch apply --project "$SGLPATCH_HOME" ${LINE[@]+"${LINE[@]}"} ${WORKDIR_GIVEN[@]+"${WORKDIR_GIVEN[@]}"} --source "$SOURCE" \
  ${PY_ARG[@]+"${PY_ARG[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
