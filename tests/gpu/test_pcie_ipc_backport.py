"""P5 (0005) on a real GPU: tests/gpu/pcie_ipc_backport_mps.py at world size 2 (all ranks on GPU 0;
start MPS first for 4 or 8). Needs CUDA, flashinfer-python >= 0.7.0 (or FLASHINFER_KIT) and the
patched 0.5.9 tree importable; skips cleanly elsewhere. Correctness only, never timing.

Run on a GPU box:  SGLANG_TREE=... PYTHONPATH=$SGLANG_TREE python -m pytest tests/gpu/test_pcie_ipc_backport.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if not os.environ.get("FLASHINFER_KIT") and importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer-python >= 0.7.0 or FLASHINFER_KIT", allow_module_level=True)

pytestmark = pytest.mark.gpu

HARNESS = Path(__file__).with_name("pcie_ipc_backport_mps.py")


def test_world_size_2_eager_graphs_and_forced_failures():
    proc = subprocess.run([sys.executable, str(HARNESS), "2", "1000"], capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], json.dumps(report)[-3000:]
