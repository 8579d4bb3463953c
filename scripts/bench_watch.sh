#!/usr/bin/env bash
# Benchmark (not a test) of the upstream watch, warm (trees and facts cached), N rounds side by side:
#   A  the full matrix: `sglpatch watch --releases 0.5.10..0.5.23`, and the same with --recheck
#   B  a plain shell loop of `git apply --cached --3way` of the series over the same cached trees
#   C  a single-release dry run: `sglpatch rebase --onto 0.5.23 --dry-run --source wheel`
# with the load average (uptime) before each round: other work on the machine shows in the figures.
#   scripts/bench_watch.sh [N] > results/watch-timing.md      (N: rounds, default 3)
# Environment: RELEASES (default 0.5.10..0.5.23), ONTO (default 0.5.23), PYTHON (default: the tool's venv).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then help_text; exit 0; fi
if [[ -n "${1:-}" && ! "$1" =~ ^[1-9][0-9]*$ ]]; then echo "bench_watch.sh: N must be a positive number (see --help)" >&2; exit 2; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
N="${1:-3}"; RELEASES="${RELEASES:-0.5.10..0.5.23}"; ONTO="${ONTO:-0.5.23}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; export PYTHONPATH="$HERE/src${PYTHONPATH:+:$PYTHONPATH}"; else tool_python; PY="$TOOL_PY"; fi
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
sgl() { "$PY" -m sglpatch "$@"; }
now() { date +%s.%N; }
secs() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$2"; }
load1() { cut -d' ' -f1 /proc/loadavg; }

# warm-up (untimed): trees unpacked, facts found; the JSON names every release's cached tree
echo "bench_watch.sh: warm-up run" >&2
rc=0; sgl watch --project "$HERE" --releases "$RELEASES" --json "$TMP/warm.json" >/dev/null 2>"$TMP/warm.err" || rc=$?
[ "$rc" -le 3 ] || { cat "$TMP/warm.err" >&2; exit 1; }
sgl rebase --project "$HERE" --workdir "$TMP/no-workdir" --onto "$ONTO" --dry-run --source wheel >/dev/null 2>&1 || true
CACHE="$("$PY" -c 'from sglpatch.upstream.cachedir import cache_dir; print(cache_dir())')/trees.git"
mapfile -t TREES < <("$PY" -c 'import json, sys; print("\n".join(r["sha256"] for r in json.load(open(sys.argv[1]))["rows"]))' "$TMP/warm.json")
NREL=${#TREES[@]}
mapfile -t PATCHES < <(awk '!/^#/ && NF { print $1 }' "$HERE/series")

git init -q --bare "$TMP/loop.git"
echo "$CACHE/objects" > "$TMP/loop.git/objects/info/alternates"
loop() {  # every release: the series with git apply --3way on an index of the release's tree
  local sha p
  for sha in "${TREES[@]}"; do
    GIT_INDEX_FILE="$TMP/index" git --git-dir="$TMP/loop.git" read-tree "$(git --git-dir="$CACHE" rev-parse "refs/sglpatch/trees/$sha")"
    for p in "${PATCHES[@]}"; do
      GIT_INDEX_FILE="$TMP/index" git --git-dir="$TMP/loop.git" apply --cached --3way -p1 "$HERE/patches/$p" >/dev/null 2>&1 || true
    done
  done
}

rows=""
for i in $(seq 1 "$N"); do
  echo "bench_watch.sh: round $i/$N" >&2
  l0=$(load1)
  t0=$(now); loop; t1=$(now)
  sgl watch --project "$HERE" --releases "$RELEASES" >/dev/null 2>&1 || true; t2=$(now)
  sgl watch --project "$HERE" --releases "$RELEASES" --recheck >/dev/null 2>&1 || true; t3=$(now)
  sgl rebase --project "$HERE" --workdir "$TMP/no-workdir" --onto "$ONTO" --dry-run --source wheel >/dev/null 2>&1 || true; t4=$(now)
  l1=$(load1)
  b=$(secs "$t0" "$t1"); w=$(secs "$t1" "$t2"); r=$(secs "$t2" "$t3"); d=$(secs "$t3" "$t4")
  ratio() { "$PY" -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$1" "$b"; }
  rows+="| $i | $l0 / $l1 | $b | $w | $(ratio "$w") | $r | $(ratio "$r") | $d |"$'\n'
done

cat <<MD
# Upstream watch timing (warm)

Command: \`scripts/bench_watch.sh $N\`; date $(date -u '+%Y-%m-%d %H:%M UTC'); $(nproc) CPU cores ($(uname -m));
git $(git --version | cut -d' ' -f3); $NREL releases ($RELEASES), $(echo "${#PATCHES[@]}") patches.
Warm: trees and facts cached by a first run (not timed). The machine is shared with other sessions:
the load average (1 min, from /proc/loadavg, before / after each round) is part of every figure.

- **loop**: \`git apply --cached --3way\` of the series, patch after patch, on an index of each release's cached tree
  (no classification, no checks: the floor).
- **watch**: \`sglpatch watch --releases $RELEASES\`, the whole command, as a maintainer reruns it: a release
  already classified with the same inputs (series, patches, resolutions, old stack, sglpatch's sources, pyflakes,
  Python, git; see \`watch._inputs\`) on the same tree is not classified again; supersession probes and
  dependency pins are redone (they read the index).
- **watch --recheck**: the same, every release classified again (default \`--jobs\`: one process per CPU): every
  patch classified (exact / 3-way / upstream verified / conflict / gone / recorded), merge check; upstream facts
  (trees, pyflakes per blob, defined names per tree, artifact metadata) still come from the cache.
- **dry run**: \`sglpatch rebase --onto $ONTO --dry-run --source wheel\` (no workdir), the whole command.

| round | load avg | loop s | watch s | watch / loop | watch --recheck s | recheck / loop | dry run $ONTO s |
|---|---|---|---|---|---|---|---|
$rows
MD
