"""The back-to-back CUDA-graph replay check (kernel/microbench/replay.py) on real GPUs: the worker
under torchrun with NCCL on min(2, GPUs) ranks; every backend present replays the same as NCCL,
and a fault planted on the device inside the graph (selftest_wrong at replay 5 on the last rank)
is named.  Skips cleanly without CUDA.

Run on a GPU box:  python -m pytest tests/gpu/test_kernel_replay_gpu.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: skipped before torch loads (every xdist worker collects this)
    pytest.skip("needs CUDA GPUs: no NVIDIA driver here (/dev/nvidiactl)", allow_module_level=True)
torch = pytest.importorskip("torch")

if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def worker(tmp_path: Path, backends: str, extra: list[str] = ()) -> dict:
    ws = min(2, torch.cuda.device_count())
    out = tmp_path / "kb.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ws),
           "-m", "sglpatch.gpu.kernel.bench", "--backends", backends, "--sizes", "1,3", "--samples", "3",
           "--inner", "2", "--replay", "64", "--replay-sizes", "1,3,24", "--out", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_present_backend_replays_back_to_back_the_same_as_nccl(tmp_path):
    doc = worker(tmp_path, "nccl,nccl_add_rmsnorm,symm_mem,custom_ar,pcie_ipc,b12x_oneshot,b12x_fused,flashinfer_fused")
    ran = {r["backend"] for r in doc["replay"]}
    assert "nccl" in ran
    for r in doc["replay"]:
        assert r["status"] in ("ok", "declined"), r
        assert r["status"] == "declined" or r["graph_impl"] == "cuda_graph"
    assert {(r["rows"]) for r in doc["replay"] if r["backend"] == "nccl"} == {1, 3, 24}


def test_a_fault_inside_the_graph_is_named_by_replay_and_rank(tmp_path):
    ws = min(2, torch.cuda.device_count())
    doc = worker(tmp_path, "nccl,selftest_wrong", ["--selftest-fault", f"5:{ws - 1}:7"])
    bad = [r for r in doc["replay"] if r["backend"] == "selftest_wrong"]
    assert bad and all(r["status"] == "mismatch" and r["mismatched_replays"] == 1 for r in bad), bad
    f = bad[0]["first_mismatch"]
    assert (f["replay"], f["rank"], f["element"], f["got"] - f["nccl"]) == (5, ws - 1, [0, 7], 1.0)
    assert all(r["status"] == "ok" for r in doc["replay"] if r["backend"] == "nccl")


class _OneRank:
    """torch.distributed for one rank, in this process: the sum over one rank is the tensor itself."""

    def all_reduce(self, t, group=None):
        return t

    def barrier(self, group=None):
        pass


class _FusedInTorch:
    """A fused allreduce + residual add + RMSNorm written in torch (one rank): what the check captures
    for a fused backend, here without a library that needs SM120."""

    name, fused = "fused_in_torch", True

    def fused_op(self, x, residual, gamma, res_out, norm_out):
        from sglpatch.gpu.kernel.microbench.common import add_rmsnorm_reference

        r, n = add_rmsnorm_reference(torch, x, residual, gamma)
        res_out.copy_(r)
        norm_out.copy_(n)

    def capture_ctx(self):
        import contextlib

        return contextlib.nullcontext()


def test_a_fused_path_is_captured_and_its_residual_and_norm_compared(tmp_path):
    from types import SimpleNamespace

    from sglpatch.gpu.kernel.microbench import replay

    ctx = SimpleNamespace(torch=torch, dist=_OneRank(), rank=0, world_size=1, device=torch.device("cuda", 0),
                          hidden=7168, is_cuda=True, cpu_group=None)
    torch.cuda.set_device(0)
    for rows in (1, 3, 24):
        assert replay.replay_one(_FusedInTorch(), ctx, rows, 64) == {"mismatched_replays": 0, "first_mismatch": None}
