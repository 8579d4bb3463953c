# Shared by the scripts/*.sh entry points (sourced, not run): usage text, option checks, and
# how to reach the sglpatch command line.

# The comment block at the top of the calling script, without the '#'.
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

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
# not the next option), before a lone "--"; else one line on stderr and exit 2.
VALUE_OPTS=" --workdir --project --python --source --onto --commit --upstream-url --profile --report \
--baseline --tier --good --bad --timeout --on-timeout --log-dir --installer --probe-timeout --venv --release-artifact \
--releases --json --markdown --jobs --ab --cuda "
check_values() {
  local me="$1"; shift
  while [ $# -gt 0 ]; do
    [ "$1" = "--" ] && return 0
    if [[ "$VALUE_OPTS" == *" $1 "* ]] && { [ $# -lt 2 ] || [ -z "$2" ] || [[ "$2" == -* ]]; }; then
      echo "$me: $1 needs a value (see $me --help)" >&2
      exit 2
    fi
    shift
  done
}

# sglpatch_cmd ARGS...: exec the console script when installed, else this checkout's package
# (exec: signals such as Ctrl-C and SIGTERM reach sglpatch itself).
sglpatch_cmd() {
  if command -v sglpatch >/dev/null 2>&1; then
    exec sglpatch "$@"
  fi
  PYTHONPATH="$SGLPATCH_HOME/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m sglpatch "$@"
}

# show_help SUBCOMMAND: this script's usage, then the options of `sglpatch SUBCOMMAND`.
show_help() {
  usage
  echo
  echo "Options (those of \`sglpatch $1\`):"
  (sglpatch_cmd "$1" --help) | awk 'f; /^options:/ { f = 1 }'
  exit 0
}

SGLPATCH_HOME="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
