#!/usr/bin/env bash
# One device-tool call on one NVIDIA H200 (not the target): the doctor (issue 20), the GPU tests and
# the kernel tier on one GPU, the MPS probe (issue 19). Run from the repository root on the device:
#   bash results/doctor-h200/run.sh        (with .whl carrying psutil; $OUT collects the results)
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/doctor-h200" "$OUT/h200-1gpu"
D=$OUT/doctor-h200 G=$OUT/h200-1gpu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
{ date -u; nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))';
  nvcc --version | tail -2; env | grep -E '^(NCCL|TORCH|NVSHMEM|CUDA)_' | sort; } > "$G/machine.txt" 2>&1

# 1. the doctor as the user would run it first (target profile), then with a stale worker planted:
#    a multiprocessing spawn child holding the GPU whose parent has exited
run_doctor() { echo "\$ sglpatch doctor $*"; timeout 300 python3 -m sglpatch.gpu.doctor --python "$(command -v python3)" "$@"; echo "exit $?"; echo; }
{
  run_doctor --profile rtx6000x8-kimi-k25 --json "$D/doctor-target.json"
  cat > /tmp/orphan.py <<'PY'
import multiprocessing as mp, os, time
def hold():
    import torch
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")  # 4 GiB
    time.sleep(600)
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=hold); p.start()
    time.sleep(25); os._exit(0)  # the "server" dies, its worker stays
PY
  python3 /tmp/orphan.py; sleep 2
  echo "# planted: $(pgrep -af multiprocessing-fork)"; echo
  run_doctor --profile rtx6000x8-kimi-k25 --no-p2p
  run_doctor --profile rtx6000x8-kimi-k25 --no-p2p --kill-stale --yes
  sleep 2; echo "# left: $(pgrep -af multiprocessing-fork || echo none)"; echo
  run_doctor --profile h200x2 --json "$D/doctor-h200x2.json"
} > "$D/doctor.txt" 2>&1

# 2. what runs on one GPU: tests/gpu (the 2-GPU ones skip), the kernel tier's refusal
{ timeout 400 python3 -m pytest -q -s -p no:cacheprovider --noconftest -rA tests/gpu; echo "exit $?"; } > "$G/pytest.log" 2>&1
{ timeout 120 python3 -m sglpatch.gpu.regress --tier kernel --profile h200x2 --report /tmp/kt; echo "exit $?";
  cat /tmp/kt/report.md 2>/dev/null; } > "$G/kernel-tier.log" 2>&1

# 3. several ranks on one GPU under MPS: can cross-process spin barriers run (world-size-8 kernels
#    for correctness, never timing)? Without MPS first (expected to time out), then with the daemon.
P=results/h200-1gpu/mps8.py
{ echo "# without MPS"; timeout 100 python3 $P 8 20000000 2>&1 | tail -3; echo "exit $?"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  echo "# with MPS ($(command -v nvidia-cuda-mps-control || echo 'no nvidia-cuda-mps-control'))"
  nvidia-cuda-mps-control -d && sleep 2 && timeout 150 python3 $P 8 20000000 2>&1 | tail -3; echo "exit $?"
  echo quit | nvidia-cuda-mps-control; cat /tmp/mps-log/control.log 2>/dev/null | tail -5
} > "$G/mps8.log" 2>&1
