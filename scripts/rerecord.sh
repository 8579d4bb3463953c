#!/usr/bin/env bash
# Re-record resolutions/VERSION/ after patches of the pinned series changed (a recorded
# resolution is keyed by the bytes of the patch it was made for, so an edited patch makes
# the replay stop), and the line lines/VERSION/ with them. Replays the committed ports as hand
# resolutions in a scratch copy:
#   scripts/rerecord.sh 0.5.23 [--project DIR]      # then review `git diff resolutions/`
# At each stop: a port file resolutions/VERSION/NAME is applied on the new upstream and
# the rebase continues; a patch recorded as "drop" is skipped. The ports' own files
# (their own headers) and `why` lines are kept; patch_sha256 and the conflict key are renewed
# (also when the patch bytes did not change: a record made before conflict keys gets one).
# A port is re-applied as it is: if the pinned patch gained behaviour, port it by hand.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if wants_help "$@"; then help_text; exit 0; fi
check_values rerecord.sh "$@"
[[ $# -ge 1 && "$1" != -* ]] || { echo "rerecord.sh: give the release to re-record, e.g. 0.5.23 (see rerecord.sh --help)" >&2; exit 2; }
ver="$1"; shift
here="$SGLPATCH_HOME"
project="$here"
[[ "${1:-}" == "--project" ]] && project="$(cd "$2" && pwd)"
tool_python
sp() { "$TOOL_PY" -m sglpatch "$@"; }
res="$project/resolutions/$ver"
[[ -f "$res/resolutions.toml" ]] || { echo "rerecord: no $res/resolutions.toml" >&2; exit 1; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/project"
for f in series upstream.lock patches resolutions CHANGELOG.md; do cp -r "$project/$f" "$tmp/project/"; done
cp -r "$res" "$tmp/saved"
# without this release's records the rebase stops at every conflict, so each port is recorded
# as a hand resolution, keyed by the conflict it resolves (the pin in target.toml stays)
rm -f "$tmp/project/resolutions/$ver/resolutions.toml" "$tmp/project/resolutions/$ver/"*.patch
drops="$("$TOOL_PY" -c 'import sys,tomllib; d=tomllib.load(open(sys.argv[1],"rb"))["patch"]; print(" ".join(n for n,r in d.items() if r["action"]=="drop"))' "$res/resolutions.toml")"
sp apply --project "$tmp/project" --workdir "$tmp/wd" --source sdist --no-install >/dev/null
set +e; out="$(sp rebase --project "$tmp/project" --workdir "$tmp/wd" --onto "$ver" 2>&1)"; rc=$?; set -e
while [[ $rc == 3 ]]; do
  name="$(sed -n 's/^rebase stopped at patch [0-9]*\/[0-9]*: \([^ ]*\) .*/\1/p' <<<"$out")"
  [[ -n "$name" ]] || { echo "$out" >&2; exit 1; }
  if [[ -f "$tmp/saved/$name" ]]; then
    echo "rerecord: $name: applying the recorded port"
    git -C "$tmp/wd" reset -q --hard HEAD
    git -C "$tmp/wd" apply --index "$tmp/saved/$name"
    set +e; out="$(sp rebase --workdir "$tmp/wd" --continue 2>&1)"; rc=$?; set -e
  elif [[ " $drops " == *" $name "* ]]; then
    echo "rerecord: $name: recorded drop"
    set +e; out="$(sp rebase --workdir "$tmp/wd" --skip 2>&1)"; rc=$?; set -e
  else
    echo "$out" >&2; echo "rerecord: $name has no recorded port: resolve by hand (docs/rebase.md)" >&2; exit 3
  fi
done
[[ $rc == 0 ]] || { echo "$out" >&2; exit "$rc"; }
new="$tmp/project/resolutions/$ver"
"$TOOL_PY" - "$tmp/saved" "$new" <<'EOF'
import json, re, sys, tomllib
from pathlib import Path
saved, new = Path(sys.argv[1]), Path(sys.argv[2])
why = {n: r.get("why", "") for n, r in tomllib.load(open(saved / "resolutions.toml", "rb"))["patch"].items()}
text = (new / "resolutions.toml").read_text()
out, cur = [], None
for line in text.split("\n"):
    m = re.match(r'\[patch\."(.+)"\]', line)
    cur = m.group(1) if m else cur
    if line.startswith("why = ") and why.get(cur):
        line = "why = " + json.dumps(why[cur])
    out.append(line)
(new / "resolutions.toml").write_text("\n".join(out))
for p in saved.glob("*.patch"):  # the ports with their own headers
    (new / p.name).write_bytes(p.read_bytes())
EOF
# each folder replaced in one step (sglpatch.fsutil.replace_dir): a kill leaves the old one or the new one
replace_dir() { "$TOOL_PY" -c 'import sys; from sglpatch.fsutil import replace_dir; replace_dir(sys.argv[1], sys.argv[2])' "$1" "$2"; }
replace_dir "$new" "$res"
line="$project/lines/$ver"  # the rebase's result, the line (sglpatch.lines), refreshed with it
mkdir -p "$project/lines"; replace_dir "$tmp/project/lines/$ver" "$line"
echo "rerecord: $res re-recorded and $line rewritten; review with git diff, then commit"
