#!/usr/bin/env bash
# P6's rope kernel on a GPU machine (correctness only): the p5mps kit (results/p5-mps-h200/prepare.sh)
# for the patched tree and tvm_ffi, build/p6rope.tar.xz (results/p6-rope-h200/prepare.sh) for
# flashinfer 0.7.2's headers + bundled CCCL and 0.6.3's headers, under its top-level folder p6rope/:
# p6rope/fi072/flashinfer/data/{include,cccl/{cub,libcudacxx/include,thrust}}, p6rope/fi063/flashinfer/data/include.
# ninja is the GPU image's own. P5_SITE, P5_TREE, P6_DIR move the unpacked kits (default /tmp/...).
#   bash tests/gpu/p6_rope/run_rope.sh build/p5mps build/p6rope.tar.xz OUTDIR
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KIT=$(cd "${1:?p5mps kit}" && pwd); RK=$(cd "$(dirname "${2:?p6rope tarball}")" && pwd)/$(basename "$2")
O=$(mkdir -p "${3:?outdir}" && cd "$3" && pwd)
S=${P5_SITE:-/tmp/p5site}; T=${P5_TREE:-/tmp/p5tree}; R=${P6_DIR:-/tmp/p6r}
if [ ! -d $T/p5kit ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S "$KIT"/whl/*.whl || exit 125
  mkdir -p $T && tar xJf "$KIT/sglang-059-patched.tar.xz" -C $T && tar xJf "$KIT/flashinfer-0.7.2-kit.tar.xz" -C $T || exit 125
fi
rm -rf $R/p6rope; mkdir -p $R && tar xJf "$RK" -C $R || exit 125
for d in fi072/flashinfer/data/include fi072/flashinfer/data/cccl/cub fi072/flashinfer/data/cccl/libcudacxx/include \
         fi072/flashinfer/data/cccl/thrust fi063/flashinfer/data/include; do
  [ -d "$R/p6rope/$d" ] || { echo "run_rope.sh: $RK has no p6rope/$d" >&2; exit 125; }
done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -2
  (cd $T/python && sha256sum sglang/jit_kernel/rope.py); } > "$O/rope-env.txt" 2>&1
PYTHONPATH=$S:$T/p5kit/site SGLANG_TREE=$T FI072=$R/p6rope/fi072 FI063=$R/p6rope/fi063 \
  timeout 600 python3 "$HERE/rope_check.py" > "$O/rope.json" 2> "$O/rope.err"
r=$?; echo "rope rc $r" >> "$O/rope-env.txt"; exit $r
