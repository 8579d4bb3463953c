#!/usr/bin/env bash
# P5 on ONE GPU under MPS (correctness only, never timing): the edge probe at each world size, with a
# server's defaults (seed, no tuning); then the explicit tuning step (the real pcie_ipc_tune command,
# the served buckets 3/6/12/24, its own deadline) at WS 8, once with a deadline too short to finish
# (it must fail with one line and write nothing) and once to the end; then the probe at WS 8 with
# SGLANG_PCIE_IPC_TUNE=cache reading what the step wrote. Kit: results/p5-mps-h200/prepare.sh.
#   bash tests/gpu/p5_edges/run_edges.sh build/p5mps OUTDIR [WS ...]     (default: 8 2 4 6)
# OUTDIR ends with two files (the device brings back 8): edges.tar.gz, every file the run wrote
# (env.txt, all.log, ws*.json, tune*.out/.err/-report.json, cache*.json), and summary.txt (the exit
# code, then env.txt). P5_SITE, P5_TREE move the unpacked kit (default /tmp/p5site, /tmp/p5tree),
# P5_TUNE_DIR the tuning step's cache folder (default /tmp/p5tune-PID).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KIT=$(cd "${1:?kit dir (build/p5mps)}" && pwd); O=$(mkdir -p "${2:?outdir}" && cd "$2" && pwd); shift 2
WSS=${*:-8 2 4 6}
S=${P5_SITE:-/tmp/p5site}; T=${P5_TREE:-/tmp/p5tree}
if [ ! -d $T/p5kit ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S "$KIT"/whl/*.whl || exit 125
  mkdir -p $T && tar xJf "$KIT/sglang-059-patched.tar.xz" -C $T && tar xJf "$KIT/flashinfer-0.7.2-kit.tar.xz" -C $T || exit 125
fi
export PYTHONPATH=$S SGLANG_TREE=$T FLASHINFER_KIT=$T/p5kit PYTHONUNBUFFERED=1
export FLASHINFER_AUTOTUNE_DIR=${P5_TUNE_DIR:-/tmp/p5tune-$$}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nvcc --version | tail -2
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  (cd $T/python && sha256sum sglang/srt/distributed/parallel_state.py \
     sglang/srt/distributed/device_communicators/pcie_ipc_allreduce.py \
     sglang/srt/pcie_ipc_tune.py); sha256sum "$HERE/p5_edges_mps.py"; } > "$O/env.txt" 2>&1
started=0
if [ "${P5_DEVICES:-one}" = one ]; then
  nvidia-cuda-mps-control -d && started=1 && echo "MPS daemon started" >> "$O/env.txt"
fi
rc=0
probe() {  # probe NAME WS [--mode cache]
  local name=$1 ws=$2; shift 2
  if [ "$ws" = 8 ]; then D=${DEADLINE8:-420} B=${BUDGET8:-60}; else D=${DEADLINE:-200} B=${BUDGET:-25}; fi
  DEADLINE=$D BUDGET_S=$B BUILD_TIMEOUT_S=$((D - 60)) PHASE_TIMEOUT_S=120 \
    timeout $((D + 15)) python3 "$HERE/p5_edges_mps.py" "$ws" "$@" > "$O/$name.json" 2> "$O/$name.err"
  r=$?; echo "$name rc $r" >> "$O/env.txt"; [ $r = 0 ] || rc=1
  { echo "===== $name (rc $r)"; cat "$O/$name.err"; } >> "$O/all.log"; rm -f "$O/$name.err"
}
for ws in $WSS; do probe "ws$ws" "$ws"; done
# the tuning step at TUNE_WS (default 8): python -m ... as the server's start-up line prints it
# (clocks are NOT pinned here:
# the machine's settings stay as they are; correctness only)
TW=${TUNE_WS:-8}
tune() {  # tune NAME TIMEOUT
  local name=$1 t=$2
  PYTHONPATH=$HERE/stub:$T/python:$S timeout $((t + 60)) python3 -m \
    sglang.srt.pcie_ipc_tune --tp "$TW" --hidden 7168 --rows 3,6,12,24 \
    --devices "$(python3 -c "print(','.join(['0'] * $TW))")" --clocks-pinned --timeout "$t" --iters 50 \
    --report "$O/$name-report.json" \
    > "$O/$name.out" 2> "$O/$name.err"
  local r=$?; echo "$name rc $r; files: $(ls "$FLASHINFER_AUTOTUNE_DIR" 2>/dev/null | tr '\n' ' ')" >> "$O/env.txt"
  echo "$r"
}
r=$(tune tune$TW-short 5)
[ "$r" = 1 ] && ! ls "$FLASHINFER_AUTOTUNE_DIR"/sglang_pcie_ipc_ws$TW.json* >/dev/null 2>&1 || rc=1
r=$(tune tune$TW ${TUNE_TIMEOUT:-420})
if [ "$r" = 0 ]; then export EXPECT_CACHE=1; else export EXPECT_CACHE=0; rc=1; fi
probe cache$TW $TW --mode cache
if [ $started = 1 ]; then
  echo get_server_list | nvidia-cuda-mps-control >> "$O/env.txt" 2>&1; echo quit | nvidia-cuda-mps-control
fi
pack() {  # pack OUTDIR RC: every file in OUTDIR into OUTDIR/edges.tar.gz (removed after), OUTDIR/summary.txt
  local o=$1 files
  files=$(cd "$o" && find . -maxdepth 1 -type f ! -name edges.tar.gz ! -name summary.txt -printf '%P\n' | sort)
  [ -n "$files" ] && (cd "$o" && printf '%s\n' "$files" | tar czf edges.tar.gz -T - && printf '%s\n' "$files" | xargs rm -f)
  { echo "run_edges.sh rc $2; edges.tar.gz holds: $(echo $files)"; tar xzOf "$o/edges.tar.gz" env.txt 2>/dev/null; } > "$o/summary.txt"
}
pack "$O" $rc
exit $rc
