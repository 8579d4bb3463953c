"""`regress --tier kernel --stress N` on real GPUs (>= 2 CUDA devices): every non-NCCL backend
present survives N iterations eager and as CUDA-graph replays with every result equal to
NCCL's, and a fault planted on the device inside the CUDA graph (selftest_wrong) fails the
tier naming its iteration and rank.  Skips cleanly elsewhere.

Run on a GPU box:  PYTHONPATH=src python -m pytest tests/gpu/test_kernel_stress.py -q
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: skipped before torch loads (every xdist worker collects this)
    pytest.skip("needs CUDA GPUs: no NVIDIA driver here (/dev/nvidiactl)", allow_module_level=True)
torch = pytest.importorskip("torch")

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs >= 2 CUDA GPUs", allow_module_level=True)

from sglpatch.gpu import regress  # noqa: E402

pytestmark = pytest.mark.gpu


def _project(tmp_path: Path, stress_backends: list[str]) -> Path:
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "targets" / "g.toml").write_text(textwrap.dedent(f"""
        [kernel]
        world_size = 2
        sizes = [3]
        backends = ["nccl"]
        p2p_disabled_run = false
        required_backends = ["nccl"]
        samples = 5
        inner = 2
        timeout_s = 240
        stress_backends = {json.dumps(stress_backends)}
        stress_sizes = [1, 3, 16]
        stress_step_timeout_s = 120
        """))
    return proj


def test_present_backends_match_nccl_for_every_iteration(tmp_path):
    proj = _project(tmp_path, ["custom_ar", "symm_mem"])
    res = regress.run_regress("kernel", "g", str(tmp_path / "r"), str(proj), stress=3000)
    k = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]
    st = k["stress"]
    rows = st["stress"]
    if not rows:
        pytest.skip(f"neither custom_ar nor symm_mem is available here: {st['absent']}")
    assert res["exit_code"] == 0, k["failures"]
    assert {r["mode"] for r in rows} == {"eager", "graph"}
    for r in rows:
        assert r["status"] == "ok" and r["iterations_done"] == 3000 and r["first_mismatch"] is None, r
        assert r["graph_impl"] in (None, "cuda_graph")
    assert st["reference"] == "nccl"


def test_fault_inside_the_cuda_graph_fails_naming_iteration_and_rank(tmp_path):
    proj = _project(tmp_path, ["selftest_wrong"])
    res = regress.run_regress("kernel", "g", str(tmp_path / "r"), str(proj), stress=3000)
    k = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]
    assert res["exit_code"] == 1
    # default fault: iteration N/2 = 1500, last rank, element 7; groups of 24 ops (rows 1, 3, 16,
    # 8 times each): 1500 % 24 = 12 -> rows 3
    want = "iteration 1500, rank 1, [3,7168] element [0,7]: got "
    assert [f.split(":")[0] for f in k["failures"]] == ["STRESS MISMATCH selftest_wrong eager",
                                                         "STRESS MISMATCH selftest_wrong graph"]
    assert all(want in f for f in k["failures"]), k["failures"]
    graph = next(r for r in k["stress"]["stress"] if r["mode"] == "graph")
    assert graph["graph_impl"] == "cuda_graph" and graph["mismatched_iterations"] == 1
