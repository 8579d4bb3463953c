#!/usr/bin/env bash
# Install what the tests need into a private venv (.venv here, or $SGLPATCH_TEST_VENV; with
# PYTHON=... that interpreter instead) and run them. The venv keeps the test requirements
# (torch 2.14.1, transformers 4.57.1, ...) away from the Python that serves your models; a second
# venv (.venv-0523, or $SGLPATCH_TEST_VENV_0523) holds SGLang 0.5.23's pins for tests/real_0523.
# Needs: git, Debian's quilt and patch (installed with apt-get when run as root).
#
#   scripts/test.sh [--quick] [PYTEST ARGS...]      e.g. scripts/test.sh tests/test_stack.py -k export
#
# The whole suite (what CI runs) in parallel: pytest-xdist with $SGLPATCH_TEST_JOBS workers
# (default: cores + 1; 1 runs serially). --quick: only the unit and patch tests (the edit
# loop; the slow end-to-end files, marked `slow` in tests/harness.py, are left out).
# The files run heaviest first by tests/durations.json (this machine's figures win); after a
# change that moves the time, rewrite it with a whole run: scripts/test.sh --write-durations
# The tests keep their own cache ($SGLPATCH_TEST_CACHE, default beside the test venv), never
# the user's ~/.cache/sglpatch.
#
# exit codes (pytest's, not the sglpatch table):
#   0    every selected test passed
#   1    a test failed
#   2    interrupted (Ctrl-C), or quilt/patch missing and not root to install them
#   4    a pytest usage error (an unknown option, no such test file)
#   5    no test was selected
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
# uv as the test requirements pin it (bootstrapped below before they are installed)
UV_PIN="$(grep -m1 -E '^uv==' requirements-test.txt)" || { echo "test.sh: requirements-test.txt pins no uv" >&2; exit 2; }
# A new test venv gets its pip (the tests run it) from the interpreter's own bundled wheel,
# installed by uv, which python3's pip puts in first (0.2 s and 1.5 s); ensurepip where that
# cannot be done (3.6 s: pip installs itself and compiles each of its files).
venv_pip() {  # venv_pip PYTHON
  local py="$1" bin whl
  bin="$(dirname "$py")"
  [ -x "$bin/pip" ] && return 0
  whl="$("$py" -c 'import ensurepip, glob, os; print(*glob.glob(os.path.join(os.path.dirname(ensurepip.__file__), "_bundled", "pip-*.whl")))' 2>/dev/null || true)"
  if [ -z "${SGLPATCH_TEST_PIP:-}" ] && [ -f "$whl" ] \
    && { [ -x "$bin/uv" ] || python3 -m pip --python "$py" install -q --disable-pip-version-check "$UV_PIN" >/dev/null 2>&1; } \
    && "$bin/uv" pip install -q --python "$py" --no-deps "$whl" >/dev/null 2>&1; then
    return 0
  fi
  "$py" -m ensurepip --default-pip >/dev/null
}
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
else
  VENV="${SGLPATCH_TEST_VENV:-$HERE/.venv}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "test.sh: creating the test venv $VENV" >&2
    python3 -m venv --without-pip "$VENV"
  fi
  PY="$VENV/bin/python"
  venv_pip "$PY"
fi
if ! command -v quilt >/dev/null || ! command -v patch >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing quilt and patch with apt-get" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq quilt patch >/dev/null
  else
    echo "test.sh: quilt/patch missing; install them (apt-get install quilt patch)" >&2; exit 2
  fi
fi
# The test requirements (6 GB with torch's CUDA wheels) install with uv, bootstrapped with pip:
# measured from cold caches on the shared 2-core machine (others working), 95 s and 83 CPU-s
# against pip's 160 s and 100 CPU-s; the same packages. uv does not read
# pip's configuration, so its indexes, find-links and constraints are handed over, with pip's
# choice of the best version from any index. pip when uv cannot be had or fails;
# SGLPATCH_TEST_PIP=1 always.
uv_pip_config() {  # the pip configuration as uv options, one a line: sglpatch's own translation
  # (src/sglpatch/pythonenv/pip_config.py, standard library only, so the bare venv runs it)
  PYTHONPATH="$HERE/src" "$PY" -c 'from sglpatch.pythonenv.pip_config import uv_args; print(*uv_args(), sep="\n")'
}
UV="$(dirname "$PY")/uv"  # the test venv's own (requirements-test.txt pins it)
install_with_uv() {  # install_with_uv PYTHON ARGS...: non-zero when uv is not there or fails
  [ -z "${SGLPATCH_TEST_PIP:-}" ] || return 1
  local into="$1" cfg out
  shift
  [ -x "$UV" ] || "$PY" -m pip install -q --disable-pip-version-check "$UV_PIN" >/dev/null 2>&1 || return 1
  [ -x "$UV" ] || return 1
  out="$(uv_pip_config)" || return 1
  mapfile -t cfg <<<"$out"
  # no --compile-bytecode: the suite's processes write the bytecode of what they import (below)
  "$UV" pip install -q --python "$into" "${cfg[@]}" "$@"
}
echo "test.sh: installing test requirements into $PY (no-op when present; the first time takes minutes)" >&2
if ! install_with_uv "$PY" -r requirements-test.txt -e ".[dev]"; then
  [ -n "${SGLPATCH_TEST_PIP:-}" ] || echo "test.sh: uv could not install them; pip instead" >&2
  "$PY" -m pip install -q --disable-pip-version-check -r requirements-test.txt -e ".[dev]"
fi
# The second venv, for the tests on SGLang 0.5.23's own modules (tests/real_0523, run by
# tests/test_port_0523.py): requirements-test-0523.txt, the whole set pinned, installed --no-deps
# over the main venv's packages (torch 2.14.1 through a .pth file). Built once; rebuilt when
# requirements-test-0523.txt changes. If it cannot be built, those tests skip and say why.
VENV0523="${SGLPATCH_TEST_VENV_0523:-$HERE/.venv-0523}"
REQS0523="$(sha256sum requirements-test-0523.txt | cut -c1-16) no-deps"
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
build_0523() {
  # no pip of its own (ensurepip: 3.4 CPU-s beside the tests); the test venv's pip installs into it
  rm -rf "$VENV0523" && "$PY" -m venv --without-pip "$VENV0523" || return 1
  purelib "$PY" > "$(purelib "$VENV0523/bin/python")/_sglpatch_parent.pth" || return 1
  # --no-deps, every package pinned: nothing to resolve (a resolver that does not count the .pth's
  # packages as installed, uv's, would add a second torch of 5.4 GB for compressed-tensors)
  install_with_uv "$VENV0523/bin/python" --no-deps -r requirements-test-0523.txt \
    || "$PY" -m pip --python "$VENV0523/bin/python" install -q --disable-pip-version-check --no-deps -r requirements-test-0523.txt
}
build_or_skip_0523() {
  if build_0523; then
    echo "$REQS0523" > "$VENV0523/.sglpatch-reqs"
  else
    echo "test.sh: could not build $VENV0523; the 0.5.23 real-module tests will skip" >&2
    rm -rf "$VENV0523"
  fi
}
# Built in the background while the tests start: it holds $VENV0523.lock (flock) until done, and
# the tests that need it wait for that lock (tests/conftest.py: venv_0523); its log goes to
# $VENV0523.log. In the foreground where flock is missing.
if [ "$(cat "$VENV0523/.sglpatch-reqs" 2>/dev/null)" != "$REQS0523" ]; then
  if command -v flock >/dev/null; then
    echo "test.sh: building the 0.5.23 test venv $VENV0523 in the background (once; a few minutes; log: $VENV0523.log)" >&2
    exec 9>"$VENV0523.lock"
    flock 9
    build_or_skip_0523 >"$VENV0523.log" 2>&1 &
    exec 9>&-  # the background build keeps the lock; pytest must not hold it
  else
    echo "test.sh: building the 0.5.23 test venv $VENV0523 (once; a few minutes)" >&2
    build_or_skip_0523
  fi
fi
export SGLPATCH_TEST_VENV_0523="$VENV0523"
# Bytecode: the suite's processes write it for what they import, once, as Python does on the
# user's box; PYTHONDONTWRITEBYTECODE (this machine's environment and CI's set it) would have each of
# the suite's ~1,500 Python processes compile its modules again. The venvs are not compiled
# whole at install: the suite imports 4,747 of the main venv's 13,283 files and 2,067 of the 0.5.23
# venv's 8,657 (compiling them all took 13 s of the set-up on 2 cores, and about 20 CPU-s beside it).
unset PYTHONDONTWRITEBYTECODE
"$PY" -m compileall -q src >/dev/null || true  # the tool's, before the workers start
# the venv's tools (uv, black, sglpatch) on PATH, as an activated venv would have them
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
# --durations: the slowest tests at the end of the log, where the CI time goes; and by CPU
# seconds (tests/harness.py, SGLPATCH_TEST_CPU_LOG), which another load on the machine does not change
if [ -z "${SGLPATCH_TEST_CPU_LOG:-}" ] && [ -n "${VENV:-}" ]; then
  export SGLPATCH_TEST_CPU_LOG="$VENV/sglpatch-test-cpu.jsonl"
  : > "$SGLPATCH_TEST_CPU_LOG"
fi
ARGS=()
if [ "${1:-}" = --quick ]; then shift; ARGS+=(-m "not slow"); fi
# one worker more than cores: many tests wait on a subprocess, a timeout or a signal, not the CPU
# (cores + 2 measured slower: a fresh-clone run 641 s and 1,151 CPU-s against 587-614 s and 1,051-1,079)
JOBS="${SGLPATCH_TEST_JOBS:-$(( $(nproc) + 1 ))}"
if [ "$JOBS" != 1 ] && [ "$JOBS" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
  # a file's tests on one worker (its module fixtures built once), the heaviest files first, by
  # the durations earlier runs measured (tests/harness.py orders them)
  ARGS+=(-n "$JOBS" --dist loadfile --no-loadscope-reorder)
fi
# The tests' temporary files: a folder of this run's own, on a tmpfs (/dev/shm) when there is one
# with room, else under $TMPDIR. A run writes and removes some 11 GB of small files; on an ext4
# without a journal (this machine's root filesystem, and CI's) each file created among recently
# deleted ones makes the kernel scan their inodes (ext4's recently_deleted()): the two
# failure-mode files locks and rebase_state took 78 CPU-s there (54 of them the kernel's) and 36 on
# the tmpfs. A passed test's folder is removed as it ends (tmp_path_retention_policy), the whole
# folder after a green run; a failed run keeps its failed tests' folders and says where.
# SGLPATCH_TEST_TMP=DIR puts the folder under DIR instead.
SHM_NEED_KB=$(( 6 * 1024 * 1024 ))  # a whole run held at most 1.4 GB there at once (measured)
roomy_tmpfs() {  # roomy_tmpfs DIR: a writable tmpfs with SHM_NEED_KB free, in free memory too
  [ "$(stat -f -c %T "$1" 2>/dev/null)" = tmpfs ] && [ -w "$1" ] \
    && [ "$(df -Pk "$1" | awk 'NR == 2 {print $4}')" -ge "$SHM_NEED_KB" ] \
    && [ "$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)" -ge $(( 2 * SHM_NEED_KB )) ]
}
TESTS_TMP_BASE="${SGLPATCH_TEST_TMP:-}" DISK_TMP=""
if [ -z "$TESTS_TMP_BASE" ]; then
  TESTS_TMP_BASE="${TMPDIR:-/tmp}"
  if roomy_tmpfs /dev/shm; then
    TESTS_TMP_BASE=/dev/shm
    # and a folder on disk for the tests whose new venv meets apply's disk check (~25 GiB free
    # where a venv is made when the resolver gives no sizes: tests/conftest.py disk_tmp_path)
    DISK_TMP="$(mktemp -d "${TMPDIR:-/tmp}/sglpatch-tests-disk.XXXXXX")"
    export SGLPATCH_TEST_DISK_TMP="$DISK_TMP"
  fi
fi
TESTS_TMP="$(mktemp -d "$TESTS_TMP_BASE/sglpatch-tests.XXXXXX")"
export TMPDIR="$TESTS_TMP"
rc=0
"$PY" -m pytest -q -p no:cacheprovider --durations=15 --basetemp "$TESTS_TMP/pytest" \
  -o tmp_path_retention_policy=failed "${ARGS[@]}" "$@" || rc=$?
if [ "$rc" = 0 ] || [ "$rc" = 5 ]; then
  rm -rf "$TESTS_TMP" ${DISK_TMP:+"$DISK_TMP"}
else
  echo "test.sh: this run's temporary files (the failed tests' folders) are in $TESTS_TMP${DISK_TMP:+ and $DISK_TMP};" \
    "remove them when done" >&2
fi
exit "$rc"
