#!/usr/bin/env bash
# Wall time of `sglpatch rebase --onto 0.5.10.post1 --source sdist` (dry run and full), median of N,
# each on a fresh copy of the project and a freshly applied workdir (sdists cached).
#   scripts/bench_rebase.sh [N] > results/rebase-timing.md      (N: runs, default 3)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then help_text; exit 0; fi
if [[ -n "${1:-}" && ! "$1" =~ ^[1-9][0-9]*$ ]]; then echo "bench_rebase.sh: N must be a positive number (see --help)" >&2; exit 2; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
N="${1:-3}"
tool_python
sp() { "$TOOL_PY" -m sglpatch "$@"; }
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
dry=(); full=()
for i in $(seq 1 "$N"); do
  P="$TMP/p$i"; W="$TMP/w$i"; mkdir -p "$P"
  cp -a "$HERE/series" "$HERE/upstream.lock" "$HERE/patches" "$HERE/resolutions" "$HERE/CHANGELOG.md" "$P/"
  sp apply --project "$P" --workdir "$W" --source sdist --no-install >/dev/null 2>&1
  t0=$(date +%s.%N); sp rebase --project "$P" --workdir "$W" --onto 0.5.10.post1 --source sdist --dry-run >/dev/null 2>&1 || true; t1=$(date +%s.%N)
  sp rebase --project "$P" --workdir "$W" --onto 0.5.10.post1 --source sdist >/dev/null 2>&1; t2=$(date +%s.%N)
  dry+=("$(python3 -c "print(f'{$t1 - $t0:.2f}')")"); full+=("$(python3 -c "print(f'{$t2 - $t1:.2f}')")")
done
med() { python3 -c "import statistics, sys; print(f'{statistics.median(map(float, sys.argv[1:])):.2f}')" "$@"; }
cat <<MD
# rebase timing: 0.5.9 -> 0.5.10.post1 (sdist), $(echo "${#full[@]}") runs

Command: \`scripts/bench_rebase.sh $N\`; date $(date -u '+%Y-%m-%d %H:%M UTC'); $(nproc) CPU cores; sdists cached.

| what | median s | runs (s) |
|---|---|---|
| \`sglpatch rebase --onto 0.5.10.post1 --source sdist --dry-run\` | $(med "${dry[@]}") | ${dry[*]} |
| \`sglpatch rebase --onto 0.5.10.post1 --source sdist\` (unattended, recorded resolution) | $(med "${full[@]}") | ${full[*]} |
MD
