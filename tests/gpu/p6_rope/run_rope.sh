#!/usr/bin/env bash
# P6's rope kernel on a GPU machine (correctness only): the p5mps kit (results/p5-mps-h200/prepare.sh)
# for the patched tree and tvm_ffi, build/p6rope.tar.xz for flashinfer 0.7.2's headers + bundled CCCL,
# 0.6.3's headers and ninja (made as results/p6-rope-h200/README.md says).
#   bash tests/gpu/p6_rope/run_rope.sh build/p5mps build/p6rope.tar.xz OUTDIR
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KIT=$(cd "${1:?p5mps kit}" && pwd); RK=$(cd "$(dirname "${2:?p6rope tarball}")" && pwd)/$(basename "$2")
O=$(mkdir -p "${3:?outdir}" && cd "$3" && pwd)
S=/tmp/p5site; T=/tmp/p5tree; R=/tmp/p6r
if [ ! -d $T/p5kit ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S "$KIT"/whl/*.whl || exit 125
  mkdir -p $T && tar xJf "$KIT/sglang-059-patched.tar.xz" -C $T && tar xJf "$KIT/flashinfer-0.7.2-kit.tar.xz" -C $T || exit 125
fi
mkdir -p $R && tar xJf "$RK" -C $R && python3 -m pip install -q --no-index --no-deps --target $R/ninja $R/p6rope/whl/*.whl || exit 125
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -2
  (cd $T/python && sha256sum sglang/jit_kernel/rope.py); } > "$O/rope-env.txt" 2>&1
PATH=$R/ninja/bin:$PATH PYTHONPATH=$S:$T/p5kit/site SGLANG_TREE=$T FI072=$R/p6rope/fi072 FI063=$R/p6rope/fi063 \
  timeout 600 python3 "$HERE/rope_check.py" > "$O/rope.json" 2> "$O/rope.err"
r=$?; echo "rope rc $r" >> "$O/rope-env.txt"; exit $r
