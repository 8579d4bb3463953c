#!/usr/bin/env bash
# Build a ~29 MB kit that runs flashinfer's PCIe-IPC allreduce on a device machine (Python 3.12,
# torch + nvcc already there, no network): flashinfer-python's Python files minus the large kernel
# families, the headers and the one .cu the JIT module compiles, and apache-tvm-ffi. The full wheel
# (65 MB) is over one call's carry. Import it through the harness's stub_flashinfer(), which skips
# flashinfer/__init__.py (that imports cutlass-dsl, not on the device).
#   mk-flashinfer-pcie-kit.sh KITDIR [FLASHINFER_VERSION]     (then carry KITDIR)
set -euo pipefail
K=${1:?kit dir}; V=${2:-0.7.2}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
py() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$T/w" "$@"; }
py "flashinfer-python==$V"; py "apache-tvm-ffi>=0.1.11,<0.2"
mkdir -p "$K/site" && S=$K/site
(cd "$T" && mkdir x && cd x && for w in ../w/*.whl; do unzip -q -o "$w"; done)
X=$T/x/flashinfer
mkdir -p "$S/flashinfer/data/csrc"
# the top-level modules and the packages the PCIe-IPC path imports (eagerly or lazily)
(cd "$T/x" && find flashinfer -maxdepth 1 -name '*.py' && for d in autotuner comm jit trace tuning_configs; do
   find "flashinfer/$d" -name '*.py'; done) | (cd "$T/x" && tar cf - -T -) | tar xf - -C "$S"
cp -a "$X/data/include" "$X/data/spdlog" "$S/flashinfer/data/"
cp "$X/data/csrc/pcie_ipc_all_reduce.cu" "$X/data/csrc/tvm_ffi_utils.h" "$S/flashinfer/data/csrc/"
cp -a "$T"/x/flashinfer_python-*.dist-info "$T"/x/tvm_ffi "$T"/x/apache_tvm_ffi-*.dist-info "$S/"
find "$K" -name __pycache__ -prune -exec rm -rf {} +
du -sh --apparent-size "$K"
