#!/usr/bin/env bash
# P7's b12x one-shot allreduce on ONE Hopper GPU under MPS (correctness only, never timing), the adapter's SM120
# check bypassed in the harness: b12x_sm90_probe.py at each world size. Kit: results/b12x-sm90/prepare.sh.
#   bash run.sh KITDIR OUTDIR [WS ...]      (default: 2 4 8; KITDIR is what prepare.sh built, e.g. build/b12xkit)
# OUTDIR ends with two files (the device brings back 8): probe.tar.gz (env.txt, ws*.json, ws*.log) and
# summary.txt (each step's exit code, then env.txt).
set -uo pipefail
KIT=$(cd "${1:?kit dir}" && pwd); O=$(mkdir -p "${2:?outdir}" && cd "$2" && pwd); shift 2
WSS=${*:-2 4 8}
S=${B12X_SITE:-/tmp/b12xsite}
if [ ! -d "$S/b12x" ]; then
  mkdir -p "$S" && for t in cu13 base b12x; do tar xJf "$KIT/$t.tar.xz" -C "$S" || exit 125; done
fi
export PYTHONPATH=$S:$S/nvidia_cutlass_dsl/dsl_packages B12X_KIT=$KIT PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  python3 -c 'import importlib.metadata as m; print(*[f"{d} {m.version(d)}" for d in ("flashinfer-python", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13", "cuda-bindings")], sep="; ")'
  sha256sum "$KIT/b12x_allreduce.py" "$KIT/environ.py" "$(dirname "$0")/b12x_sm90_probe.py"; } > "$O/env.txt" 2>&1
started=0
nvidia-cuda-mps-control -d && started=1 && echo "MPS daemon started" >> "$O/env.txt"
rc=0
for ws in $WSS; do
  D=${DEADLINE:-150}
  DEADLINE=$D timeout $((D + 60)) python3 "$(dirname "$0")/b12x_sm90_probe.py" "$ws" > "$O/ws$ws.json" 2> "$O/ws$ws.log"
  r=$?; echo "ws$ws rc $r" >> "$O/env.txt"; [ $r = 0 ] || rc=1
done
if [ $started = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
(cd "$O" && tar czf probe.tar.gz env.txt ws*.json ws*.log && rm -f ws*.json ws*.log)
{ echo "run.sh rc $rc"; cat "$O/env.txt"; } > "$O/summary.txt"; rm -f "$O/env.txt"
exit $rc
