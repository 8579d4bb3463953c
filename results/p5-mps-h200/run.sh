#!/usr/bin/env bash
# P5's MPS run on ONE GPU: correctness only, never timing. Runs from the carried build/p5mps/ (see
# prepare.sh) on the GPU machine; writes ws{8,2,4}.json/.log and env.txt into OUTDIR.
#   bash build/p5mps/run.sh OUTDIR        (REPLAYS: CUDA-graph replays per shape, default 10000)
set -uo pipefail
cd "$(dirname "$0")"; O=$(mkdir -p "${1:?outdir}" && cd "$1" && pwd); REPLAYS=${REPLAYS:-10000}
S=/tmp/p5site; T=/tmp/p5tree
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S whl/*.whl || exit 125
mkdir -p $T && tar xJf sglang-059-patched.tar.xz -C $T && tar xJf flashinfer-0.7.2-kit.tar.xz -C $T || exit 125
export PYTHONPATH=$S SGLANG_TREE=$T FLASHINFER_KIT=$T/p5kit PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nvcc --version | tail -2
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'; } > "$O/env.txt" 2>&1
nvidia-cuda-mps-control -d && echo "MPS daemon started" >> "$O/env.txt"
(cd $T/python && sha256sum sglang/srt/distributed/parallel_state.py \
  sglang/srt/distributed/device_communicators/pcie_ipc_allreduce.py) >> "$O/env.txt"
rc=0
# ws 8 first: the JIT build happens in the first run (flashinfer's file lock). DEADLINE bounds one world
# size; SHAPE_BUDGET_S one captured shape's replays (the ranks stop together; the counts are reported).
for ws in 8 2 4; do
  if [ $ws = 8 ]; then D=280 B=45; else D=110 B=14; fi
  DEADLINE=$D SHAPE_BUDGET_S=$B timeout $((D + 10)) python3 pcie_ipc_backport_mps.py $ws "$REPLAYS" \
    > "$O/ws$ws.json" 2> "$O/ws$ws.log"
  r=$?; echo "ws $ws rc $r" >> "$O/env.txt"; [ $r = 0 ] || rc=1
done
echo get_server_list | nvidia-cuda-mps-control >> "$O/env.txt" 2>&1; echo quit | nvidia-cuda-mps-control
exit $rc
