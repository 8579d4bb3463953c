#!/usr/bin/env bash
# Builds build/b12xkit/ here (carry it to the GPU machine: Python 3.12, torch, no network), 56 MB, under one
# call's 64 MiB with the tree: nvidia-cutlass-dsl 4.7.1 (the version flashinfer 0.7.2's b12x extra pins) as
# three xz tarballs of its wheels' files (the cu13 libraries: 88 MB zipped, 51 MB as xz with a 256 MiB
# dictionary), flashinfer 0.7.2's vendored b12x (flashinfer/experimental/b12x, the top-level b12x alias, an
# empty flashinfer/__init__.py: b12x needs flashinfer only to be found), and the patched tree's
# b12x_allreduce.py and environ.py, with this folder's run.sh and b12x_sm90_probe.py.
#   PYTHON=.venv/bin/python bash results/b12x-sm90/prepare.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); K=$ROOT/build/b12xkit; PY=${PYTHON:-python3}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
WD=$T/fork
PYTHONPATH=$ROOT/src "$PY" -m sglpatch apply --project "$ROOT" --workdir "$WD" --source sdist --no-install
rm -rf "$K"; mkdir -p "$K"
cp "$WD/python/sglang/srt/distributed/device_communicators/b12x_allreduce.py" "$WD/python/sglang/srt/environ.py" "$K/"
cp "$ROOT/results/b12x-sm90/run.sh" "$ROOT/results/b12x-sm90/b12x_sm90_probe.py" "$K/"
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$T/w" "$@"; }
dl nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1 nvidia-cutlass-dsl-libs-core==4.7.1 \
  nvidia-cutlass-dsl-libs-cu13==4.7.1 flashinfer-python==0.7.2
mkdir -p "$T/cu13" "$T/base" "$T/fi" "$T/b12x/flashinfer/experimental"
(cd "$T/cu13" && unzip -q "$T"/w/nvidia_cutlass_dsl_libs_cu13-*.whl)
(cd "$T/base" && for w in "$T"/w/nvidia_cutlass_dsl-4*.whl "$T"/w/nvidia_cutlass_dsl_libs_base-*.whl "$T"/w/nvidia_cutlass_dsl_libs_core-*.whl; do unzip -q -o "$w"; done)
(cd "$T/fi" && unzip -q "$T"/w/flashinfer_python-*.whl 'flashinfer/experimental/b12x/*' 'b12x/*' 'flashinfer_python-*.dist-info/*')
cp -a "$T/fi/flashinfer/experimental/b12x" "$T/b12x/flashinfer/experimental/" && cp -a "$T/fi/b12x" "$T"/fi/flashinfer_python-*.dist-info "$T/b12x/"
: > "$T/b12x/flashinfer/__init__.py"
tar cf - -C "$T/cu13" . | xz --lzma2=preset=9e,dict=256MiB -T1 > "$K/cu13.tar.xz"   # minutes: one 181 MB library
tar cf - -C "$T/base" . | xz -9 > "$K/base.tar.xz"
tar cf - -C "$T/b12x" . | xz -9 > "$K/b12x.tar.xz"
du -sh --apparent-size "$K"
