#!/usr/bin/env bash
# Builds build/p6rope.tar.xz here (carry it to the GPU machine with build/p5mps, which
# results/p5-mps-h200/prepare.sh builds): exactly what tests/gpu/p6_rope/run_rope.sh reads, under one
# top-level folder p6rope/:
#   p6rope/fi072/flashinfer/data/include                flashinfer-python 0.7.2's headers
#   p6rope/fi072/flashinfer/data/cccl/{cub,libcudacxx/include,thrust}   its bundled CCCL (P6 adds these)
#   p6rope/fi063/flashinfer/data/include                flashinfer-python 0.6.3's headers (0.5.9's pin)
# The wheels come from the package index through sglpatch's cached, sha256-checked fetch
# ($SGLPATCH_CACHE, else ~/.cache/sglpatch). No ninja: the GPU image has it.
#   PYTHON=/path/to/python-with-sglpatch bash results/p6-rope-h200/prepare.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); B=$ROOT/build
PY=${PYTHON:-python3}
rm -rf "$B/p6rope" "$B/p6rope.tar.xz"; mkdir -p "$B/p6rope"
PYTHONPATH=$ROOT/src "$PY" - "$B/p6rope" <<'PYEOF'
import sys
import zipfile
from pathlib import Path

from sglpatch.upstream import artifacts

dest = Path(sys.argv[1])
kit = {
    "0.7.2": ("fi072", ["data/include/", "data/cccl/cub/", "data/cccl/libcudacxx/include/", "data/cccl/thrust/"]),
    "0.6.3": ("fi063", ["data/include/"]),
}
for version, (folder, parts) in kit.items():
    _, whl = artifacts.fetch("flashinfer-python", version, "wheel")
    with zipfile.ZipFile(whl) as zf:
        for part in parts:
            names = [n for n in zf.namelist() if n.startswith("flashinfer/" + part) and not n.endswith("/")]
            if not names:
                sys.exit(f"prepare.sh: flashinfer-python {version}'s wheel has no flashinfer/{part}")
            zf.extractall(dest / folder, names)
PYEOF
(cd "$B" && tar cf - p6rope) | xz -6 > "$B/p6rope.tar.xz"
rm -rf "$B/p6rope"
du -sh --apparent-size "$B/p6rope.tar.xz"
