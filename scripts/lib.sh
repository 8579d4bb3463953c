# Shared by the scripts/*.sh entry points (sourced, not run): usage text, option checks, and
# how to reach the sglpatch tool: its own venv, ${SGLPATCH_TOOL_VENV:-<checkout>/.tool-venv},
# created on first use (and refreshed when pyproject.toml changes). The tool and its
# dependencies go there and nowhere else; no script needs an active venv.

SGLPATCH_HOME="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ME="$(basename "$0")"
TOOL_VENV="${SGLPATCH_TOOL_VENV:-$SGLPATCH_HOME/.tool-venv}"
case "$TOOL_VENV" in /*) ;; *) TOOL_VENV="$PWD/$TOOL_VENV" ;; esac
TOOL_STAMP=".sglpatch-tool"  # written last into the venv; sglpatch.pythonenv.interpreter.TOOL_VENV_STAMP is the same name

# The comment block at the top of the calling script, without the '#'.
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

# The exit-code table (sglpatch.exitcodes, standard library only: any python3 prints it).
exit_codes() {
  PYTHONPATH="$SGLPATCH_HOME/src" python3 -m sglpatch.exitcodes 2>/dev/null \
    || echo "exit codes: see README.md (Exit codes)"
}

# help_text: the usage, then the exit codes.
help_text() { usage; echo; exit_codes; }

# wants_help ARGS...: -h/--help before a lone "--" (what follows "--" is another command's).
wants_help() {
  local a
  for a in "$@"; do
    [ "$a" = "--" ] && return 1
    [[ "$a" == -h || "$a" == --help ]] && return 0
  done
  return 1
}

# check_values NAME ARGS...: every option that takes a value has one (not missing, not empty,
# not the next option), and a --python is a Python, before a lone "--"; else one line on
# stderr and exit 2.
VALUE_OPTS=" --workdir --project --python --source --onto --commit --upstream-url --profile --report --report-dir \
--baseline --tier --good --bad --timeout --on-timeout --log-dir --installer --probe-timeout --venv --release-artifact \
--releases --json --markdown --jobs --ab --cuda --line "
check_values() {
  local me="$1"; shift
  while [ $# -gt 0 ]; do
    [ "$1" = "--" ] && return 0
    if [[ "$VALUE_OPTS" == *" $1 "* ]] && { [ $# -lt 2 ] || [ -z "$2" ] || [[ "$2" == -?* ]]; }; then  # a lone -: stdout
      echo "$me: $1 needs a value (see $me --help)" >&2
      exit 2
    fi
    case "$1" in
      --python|--ab) check_python "$me" "$2" "$1" ;;
      --python=*|--ab=*) check_python "$me" "${1#*=}" "${1%%=*}" ;;
    esac
    shift
  done
}

# check_python NAME PATH[,PATH] [OPTION]: each PATH runs as a Python interpreter (regress --ab
# takes an A,B pair); else one line naming it and OPTION (default --python), and exit 2.
check_python() {
  local me="$1" one pair opt="${3:---python}"
  if [[ "$2" == *,* ]]; then
    IFS=, read -ra pair <<< "$2"
    for one in "${pair[@]}"; do check_python "$me" "$one" "$opt"; done
    return 0
  fi
  local py="${2/#\~/$HOME}" why=""
  if [[ "$py" != */* ]]; then py="$(command -v "$py" || true)"; fi
  if [ -z "$py" ] || [ ! -e "$py" ]; then why="no such file"
  elif [ -d "$py" ] || [ ! -x "$py" ]; then why="not an executable file"
  elif ! "$py" -c 'import sys' >/dev/null 2>&1; then why="does not run as a Python interpreter"; fi
  if [ -n "$why" ]; then echo "$me: $opt $2: $why (see $me --help)" >&2; exit 2; fi
}

_tool_key() { echo "$SGLPATCH_HOME $(sha256sum < "$SGLPATCH_HOME/pyproject.toml" | cut -d' ' -f1)"; }

_tool_ready() {
  [ -x "$TOOL_VENV/bin/python" ] && [ "$(cat "$TOOL_VENV/$TOOL_STAMP" 2>/dev/null)" = "$1" ] \
    && "$TOOL_VENV/bin/python" -c '' 2>/dev/null
}

# tool_python: TOOL_PY is the tool venv's python; the venv is created or refreshed first when
# needed (once: progress on stderr). Cannot be set up: one line, exit 125 (no usable python3)
# or 1 (the install failed, its own output above).
tool_python() {
  local key base uv
  key="$(_tool_key)"
  TOOL_PY="$TOOL_VENV/bin/python"
  _tool_ready "$key" && return 0
  base="$(command -v python3 || true)"
  if [ -z "$base" ] || ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "$ME: the sglpatch tool needs python3 >= 3.10 on PATH (found: ${base:-none}${base:+ $("$base" -V 2>&1)})" >&2
    exit 125
  fi
  if ! mkdir -p "$TOOL_VENV" 2>/dev/null || ! { : >>"$TOOL_VENV/.lock"; } 2>/dev/null; then  # a read-only checkout
    echo "$ME: cannot create the tool's venv $TOOL_VENV (read-only?): set SGLPATCH_TOOL_VENV to a writable folder, e.g. SGLPATCH_TOOL_VENV=\$HOME/.cache/sglpatch/tool-venv" >&2
    exit 125
  fi
  exec 9>"$TOOL_VENV/.lock"
  command -v flock >/dev/null && flock 9  # another script may be setting it up right now
  if _tool_ready "$key"; then exec 9>&-; return 0; fi
  if [ -e "$TOOL_VENV/bin/python" ]; then
    echo "$ME: setting up the sglpatch tool in $TOOL_VENV again (an earlier set-up was interrupted or failed, or pyproject.toml changed)" >&2
  else
    echo "$ME: setting up the sglpatch tool in $TOOL_VENV (first use; its dependencies go there only)" >&2
  fi
  # Ctrl-C: one line, not pip's traceback (that goes to the log with the rest of its output)
  trap 'echo "$ME: interrupted while setting up the tool venv $TOOL_VENV; the next run sets it up again" >&2; exit 130' INT
  local log="$TOOL_VENV/setup.log"
  uv="$(command -v uv || { [ -x "$HOME/.local/bin/uv" ] && echo "$HOME/.local/bin/uv"; } || true)"
  if ! "$base" -m venv "$TOOL_VENV" >/dev/null 2>&1; then
    if [ -z "$uv" ] || ! "$uv" venv -q --allow-existing --python "$base" "$TOOL_VENV"; then
      echo "$ME: cannot create the venv $TOOL_VENV: '$base -m venv' failed (Debian/Ubuntu: apt-get install python3-venv) and no uv was found" >&2
      exit 1
    fi
  fi
  echo "$ME: installing the tool and its dependencies from the package index (a minute, more from a slow index; what it is doing: tail -f $log)" >&2
  if "$TOOL_PY" -m pip --version >/dev/null 2>&1; then
    "$TOOL_PY" -m pip install --progress-bar off --disable-pip-version-check -e "$SGLPATCH_HOME" "pytest>=8" >"$log" 2>&1 || {
      tail -n 5 "$log" >&2
      echo "$ME: installing the tool's dependencies into $TOOL_VENV failed (above; all of it: $log): the package index must be reachable; re-run then" >&2
      exit 1
    }
  elif [ -n "$uv" ]; then
    "$uv" pip install --python "$TOOL_PY" -e "$SGLPATCH_HOME" "pytest>=8" >"$log" 2>&1 || {
      tail -n 5 "$log" >&2
      echo "$ME: installing the tool's dependencies into $TOOL_VENV failed (above; all of it: $log): the package index must be reachable; re-run then" >&2
      exit 1
    }
  else
    echo "$ME: the venv $TOOL_VENV has no pip and no uv was found: install python3-venv (Debian/Ubuntu) or uv" >&2
    exit 1
  fi
  echo "$key" > "$TOOL_VENV/$TOOL_STAMP"
  trap - INT
  exec 9>&-
}

# sglpatch_cmd ARGS...: exec the tool from its venv (exec: Ctrl-C and SIGTERM reach sglpatch itself).
sglpatch_cmd() {
  tool_python
  exec "$TOOL_PY" -m sglpatch "$@"
}

# show_help SUBCOMMAND: this script's usage, the options of `sglpatch SUBCOMMAND`, the exit codes.
show_help() {
  usage
  echo
  echo "Options (those of \`sglpatch $1\`):"
  (sglpatch_cmd "$1" --help) | awk '/^exit codes/ { exit } f; /^options:/ { f = 1 }'
  exit_codes
  exit 0
}
