"""P5 (0005) on a real GPU: the edge probe (tests/gpu/p5_edges/p5_edges_mps.py) at world size 2, all
ranks on GPU 0 (start MPS first for 4 or 8, or use tests/gpu/p5_edges/run_edges.sh). Needs CUDA,
flashinfer-python >= 0.7.0 (or FLASHINFER_KIT) and the patched 0.5.9 tree (SGLANG_TREE); skips
cleanly elsewhere. Correctness only, never timing.

Run on a GPU box:  SGLANG_TREE=... python -m pytest tests/gpu/test_pcie_ipc_backport.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: skipped before torch loads (every xdist worker collects this)
    pytest.skip("needs CUDA GPUs: no NVIDIA driver here (/dev/nvidiactl)", allow_module_level=True)
torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if not os.environ.get("FLASHINFER_KIT") and importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer-python >= 0.7.0 or FLASHINFER_KIT", allow_module_level=True)
if not os.environ.get("SGLANG_TREE"):
    pytest.skip("needs SGLANG_TREE (the patched 0.5.9 workdir)", allow_module_level=True)

pytestmark = pytest.mark.gpu

PROBE = Path(__file__).with_name("p5_edges") / "p5_edges_mps.py"


def test_world_size_2_edges_graphs_and_forced_failures():
    env = dict(os.environ, DEADLINE="300", BUDGET_S="10", BUILD_TIMEOUT_S="240", PHASE_TIMEOUT_S="120")
    proc = subprocess.run([sys.executable, str(PROBE), "2"], capture_output=True, text=True, timeout=600, env=env)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], json.dumps(report)[-3000:]
