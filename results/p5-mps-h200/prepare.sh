#!/usr/bin/env bash
# Builds build/p5mps/ here (carry it to the GPU machine, which has torch + nvcc and no network):
# the patched 0.5.9 tree (sglpatch apply --source sdist --no-install) as a tarball, flashinfer 0.7.2's
# PCIe-IPC kit (mk-flashinfer-pcie-kit.sh) as a tarball, the pure-Python deps 0.5.9's parallel_state
# imports that the GPU image lacks or holds at another version (cp312 wheels).
#   PYTHON=/path/to/python-with-sglpatch results/p5-mps-h200/prepare.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); HERE=$ROOT/results/p5-mps-h200; B=$ROOT/build/p5mps
PY=${PYTHON:-python3}
WD=$(mktemp -d)/p5fork  # outside the checkout: apply refuses a workdir inside it
trap 'rm -rf "$(dirname "$WD")"' EXIT
rm -rf "$B" "$ROOT/build/p5kit"; mkdir -p "$B/whl"
PYTHONPATH=$ROOT/src "$PY" -m sglpatch apply --project "$ROOT" --workdir "$WD" --source sdist --no-install
(cd "$WD" && tar cf - python) | xz -6 > "$B/sglang-059-patched.tar.xz"
bash "$HERE/mk-flashinfer-pcie-kit.sh" "$ROOT/build/p5kit" 0.7.2
(cd "$ROOT/build" && tar cf - p5kit) | xz -6 > "$B/flashinfer-0.7.2-kit.tar.xz"
# what tests/gpu's harness imports beyond the GPU image (read from an import trace of the harness's
# GroupCoordinator on CPU); transformers 4.57.1 (0.5.9's pin) checks hub and tokenizers at import
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$B/whl" \
  annotated-types==0.8.0 dill==0.4.1 httpx2==2.16.2 huggingface_hub==0.36.2 ipython==9.18.1 openai==3.57.0 \
  orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 \
  pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.22.2 traitlets==5.16.1 transformers==4.57.1 \
  typing-inspection==0.4.5 typing_extensions==4.16.0
# the probe travels with the tree (tests/gpu/p5_edges): bash tests/gpu/p5_edges/run_edges.sh build/p5mps OUT
du -sh --apparent-size "$B"
