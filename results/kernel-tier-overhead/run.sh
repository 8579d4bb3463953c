#!/usr/bin/env bash
# The kernel tier's own overhead: total wall time of `scripts/regress.sh --tier kernel --quick` on
# the CPU stand-in (gloo, 2 ranks, no GPU), with the target's full candidate list, two installs
# (A = the test venv; B = the same with tests/shims/kb_install_b: flashinfer 0.7.2's PCIe-IPC
# workspace and sglang-kernel stood in), the target's [env] NCCL tuning (so the NCCL-defaults
# launch runs), the topology from a fake nvidia-smi (the user's class) and the decision table.
#
#   results/kernel-tier-overhead/run.sh [RUNS]      # default 3; PYTHON=... for install A
#
# Writes RUN-i/ (each run's report) under $OUT (default: a temp folder) and prints one line per run.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
RUNS="${1:-3}"
PY_A="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-$(mktemp -d /tmp/kernel-tier-overhead.XXXXXX)}"
mkdir -p "$OUT/venv-b/bin"
cat > "$OUT/venv-b/bin/python3" <<EOF
#!/bin/sh
PYTHONPATH=$ROOT/tests/shims/kb_install_b\${PYTHONPATH:+:\$PYTHONPATH} exec $PY_A "\$@"
EOF
cat > "$OUT/nvidia-smi" <<EOF
#!/bin/sh
case "\$2" in -m) cat '$ROOT/tests/fixtures/topo/two-sockets-no-switch.txt';; -p2p) cat '$ROOT/tests/fixtures/topo/p2p-two-sockets-cns.txt';; esac
EOF
chmod +x "$OUT/venv-b/bin/python3" "$OUT/nvidia-smi"
# the target's [env], [kernel] backends and [kernel.decision]; CPU, 2 ranks
python3 - "$ROOT/targets/rtx6000x8-kimi-k25.toml" "$OUT/standin.toml" "$OUT/nvidia-smi" <<'EOF'
import re, sys
src, dst, smi = sys.argv[1:]
t = open(src).read()
env = re.search(r"^\[env\]\n(.*?)^\[", t, re.S | re.M).group(1)
backends = re.search(r"^backends = \[.*?\]", t, re.S | re.M).group(0)
decision = re.search(r"^\[kernel\.decision\]\n.*?(?=^\[server\])", t, re.S | re.M).group(0)
open(dst, "w").write(f"""[env]
{env}
[kernel]
device = "cpu"
world_size = 2
hidden = 7168
{backends}
required_backends = ["nccl"]
samples = 60
inner = 10
timeout_s = 600
nvidia_smi = "{smi}"
{decision}""")
EOF
export OMP_NUM_THREADS=1
for i in $(seq 1 "$RUNS"); do
  t0=$(date +%s.%N)
  PYTHON="$PY_A" "$ROOT/scripts/regress.sh" --tier kernel --quick --profile "$OUT/standin.toml" \
    --python "$PY_A,$OUT/venv-b/bin/python3" --report "$OUT/RUN-$i" > "$OUT/RUN-$i.log" 2>&1 || true
  t1=$(date +%s.%N)
  "$PY_A" - "$OUT/RUN-$i/report.json" "$t0" "$t1" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1])); k = doc["tiers"]["kernel"]
total = float(sys.argv[3]) - float(sys.argv[2])
launches = []
for L in k["launches"]:
    out = L["cmd"][L["cmd"].index("--out") + 1]
    launches.append((out.rsplit("/", 1)[-1][len("kernel-"):-len(".json")], L["wall_s"], json.load(open(out))["elapsed_s"]))
inside = sum(w for _, w, _ in launches)
print(f"run {sys.argv[1].rsplit('/', 2)[-2]}: {doc['status']}, total {total:.1f} s wall; {len(launches)} launches "
      f"(wall / measuring inside the worker): {', '.join(f'{n} {w} / {e} s' for n, w, e in launches)}; "
      f"sum of launches {inside:.1f} s, of which measuring {sum(e for *_, e in launches):.1f} s; outside the "
      f"launches {total - inside:.1f} s; {sum(r['status'] == 'ok' for r in k['results'])} rows ok")
EOF
done
echo "reports: $OUT"
