#!/bin/bash
# Two fresh-clone runs of .ci/run back to back (stop 40's figures), each with the machine's speed
# beside it: the CPU seconds of `import torch` in the checkout's test venv, the mean of 5, before
# and after. Usage: results/suite-time/twice.sh [CHECKOUT] (default: this one); logs and a summary
# line per run go to ${TMPDIR:-/tmp}/run-N.log and runs.summary.
set -u
SRC="$(cd "${1:-$(dirname "$0")/../..}" && pwd)"
OUT="${TMPDIR:-/tmp}"
probe() {  # "-" where the checkout has no test venv yet (scripts/test.sh builds it)
  [ -x "$SRC/.venv/bin/python" ] || { printf -- -; return; }
  /usr/bin/time -f "%U %S" -o "$OUT/probe.t" bash -c "for i in 1 2 3 4 5; do '$SRC/.venv/bin/python' -c 'import torch'; done"
  awk '{printf "%.2f", ($1+$2)/5}' "$OUT/probe.t"
}
for n in 1 2; do
  rm -rf "$OUT/run-$n"
  git clone -q "$SRC" "$OUT/run-$n"
  cd "$OUT/run-$n" || exit 1
  b=$(probe)
  { echo "tree $(git rev-parse --short HEAD) start $(date -u +%H:%M:%S)"; time bash .ci/run; echo "rc=$?"; } > "$OUT/run-$n.log" 2>&1
  a=$(probe)
  echo "run $n $(head -1 "$OUT/run-$n.log") $(grep -E 'passed|failed' "$OUT/run-$n.log" | tail -1)" \
    "$(grep real "$OUT/run-$n.log") $(grep -o 'CPU (user+sys, children waited for): [0-9]* s' "$OUT/run-$n.log")" \
    "import torch CPU-s before $b after $a" >> "$OUT/runs.summary"
  cd "$OUT" || exit 1
done
