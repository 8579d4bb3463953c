"""Issue 53, the kernel side: every allreduce path captured in a CUDA graph and replayed back to back
(fresh inputs drawn on the device, no host sync in between), each replay compared with NCCL on the
same inputs (kernel/microbench/replay.py); a difference fails the tier and the backend is never
eligible in the decision table, which also calls a backend eligible only once its server-tier
parity pairs passed (kernel/eligibility.py).  On CPU: the comparison itself in this process (torch,
one rank, a stand-in for the collective), and the tier's judging with the stand-in worker
(tests/standin_kernel_bench.py); the real worker runs it in tests/test_kernel_candidates.py (gloo)
and tests/gpu/test_kernel_replay_gpu.py (CUDA)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglpatch.gpu import regress
from sglpatch.gpu.kernel import decision, eligibility
from sglpatch.gpu.kernel import launch as kernel_launch
from sglpatch.gpu.shared import profile as profiles

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin_kernel_bench.py"
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


# ----------------------------------------------------------------------------- the comparison, in this process


class OneRank:
    """torch.distributed for one rank: the sum over one rank is the tensor itself."""

    def all_reduce(self, t, group=None):
        return t

    def barrier(self, group=None):
        pass

    def all_gather_object(self, out, obj, group=None):
        out[0] = obj


def ctx(torch, hidden=16):
    return SimpleNamespace(torch=torch, dist=OneRank(), rank=0, world_size=1, device=torch.device("cpu"),
                           hidden=hidden, is_cuda=False, cpu_group=None)


class Plain:
    """An allreduce that is wrong (one element off by one) at the calls in `bad`, else right."""

    name, fused = "plain", False

    def __init__(self, bad=()):
        self.bad, self.calls = set(bad), 0

    def stress_op(self, x, it):
        y = x.clone()
        if self.calls in self.bad:
            y.view(-1)[5] += 1
        self.calls += 1
        return y

    def supports(self, rows):
        return None


class Fused(Plain):
    """Allreduce + residual add + RMSNorm, with a fault at the calls in `bad`: "norm" (the normed
    output off by 10 %), "stale" (residual_out not written: what the last call left there)."""

    name, fused = "fused", True

    def __init__(self, bad=(), how="norm"):
        super().__init__(bad)
        self.how = how

    def fused_op(self, x, residual, gamma, res_out, norm_out):
        from sglpatch.gpu.kernel.microbench.common import add_rmsnorm_reference

        r, n = add_rmsnorm_reference(self_torch(), x, residual, gamma)
        if self.calls in self.bad and self.how == "norm":
            n = n * 1.1
        if not (self.calls in self.bad and self.how == "stale"):
            res_out.copy_(r)
        norm_out.copy_(n)
        self.calls += 1


def self_torch():
    import torch

    return torch


@needs_torch
def test_each_replay_is_compared_with_nccl_on_its_own_inputs():
    import torch

    from sglpatch.gpu.kernel.microbench import replay

    c = ctx(torch)
    got = replay.replay_one(Plain(), c, 3, 32)
    assert got == {"mismatched_replays": 0, "first_mismatch": None}
    got = replay.replay_one(Plain(bad={9, 20}), c, 3, 32)
    assert got["mismatched_replays"] == 2
    f = got["first_mismatch"]
    assert (f["replay"], f["rank"], f["output"], f["element"], f["got"] - f["nccl"]) == (9, 0, "output", [0, 5], 1.0)
    assert replay.replay_one(Fused(), c, 3, 16) == {"mismatched_replays": 0, "first_mismatch": None}
    f = replay.replay_one(Fused(bad={4}), c, 3, 16)["first_mismatch"]
    assert (f["replay"], f["output"]) == (4, "norm")
    # a write that did not happen: the output ring was poisoned, so the stale slot differs
    f = replay.replay_one(Fused(bad={6}, how="stale"), c, 2, 16)["first_mismatch"]
    assert (f["replay"], f["output"], f["element"]) == (6, "residual", [0, 0])


@needs_torch
def test_every_backend_of_the_worker_has_a_capturable_op_for_the_replay_check():
    from sglpatch.gpu.kernel.microbench import replay
    from sglpatch.gpu.kernel.microbench.backends import BACKEND_CLASSES

    for name, cls in BACKEND_CLASSES.items():
        obj = cls.__new__(cls)  # not constructed: most need CUDA
        assert replay.has_replay_op(obj), f"{name} has no op the replay check can capture"
    assert all(hasattr(BACKEND_CLASSES[b], "fused_op") for b in ("nccl_add_rmsnorm", "flashinfer_fused", "b12x_fused"))


def test_the_tier_asks_for_the_replay_check_at_the_served_sizes(tmp_path):
    prof = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    cmd = kernel_launch.kernel_launches(prof, 8, tmp_path, {"key": "A", "python": "/py"}, True)[0]["cmd"]
    assert cmd[cmd.index("--replay") + 1] == str(prof["kernel"]["replay_iterations"]) == "256"
    assert cmd[cmd.index("--replay-sizes") + 1] == "1,2,3,4,6,8,12,16,24"
    q = kernel_launch.kernel_launches(prof, 8, tmp_path, {"key": "A", "python": "/py"}, True, quick=True)[0]["cmd"]
    assert q[q.index("--replay-sizes") + 1] == "1,3"
    off = {**prof, "kernel": {**prof["kernel"], "replay_iterations": 0}}
    c = kernel_launch.kernel_launches(off, 8, tmp_path, {"key": "A", "python": "/py"}, True)[0]["cmd"]
    assert c[c.index("--replay") + 1] == "0"


# ----------------------------------------------------------------------------- eligibility


def server_report(tmp_path: Path, status: str, why: str | None = None, side: bool = False) -> Path:
    pair = {"name": "P5 PCIe-IPC vs NCCL, EAGLE-3", "a": "eagle3_nccl", "b": "eagle3_pcie_ipc", "status": status,
            "detail": "greedy text identical, but the accept length 2.500 vs 2.100 ...", "backends": ["pcie_ipc"]}
    if why:
        pair["why"] = why
    other = {"name": "P5 PCIe-IPC vs NCCL, no speculation", "status": "same", "detail": "8 greedy outputs identical",
             "backends": ["pcie_ipc"]}
    modes = [{"mode": "no_spec_nccl", "benchmark": {"median_tpot_ms": 12.2}},
             {"mode": "eagle3_nccl", "benchmark": {"accept_length": 2.5}, "verify_profile": {"median_of_records": {
                 "draft_ms_median": 0.8, "verify_ms_median": 28.6, "extend_ms_median": 0.6}}}]
    srv = {"modes": modes, "parity": [other, pair]} if not side else {"ab": {"sides": [
        {"label": "A: 0.5.9 + P5 (~/ml-env)", "modes": modes, "parity": [other, pair]},
        {"label": "B: 0.5.23 (~/ml-env-0.5.23)", "modes": modes, "parity": [{**pair, "status": "same"}, other]}]}}
    d = tmp_path / f"srv-{status}-{side}"
    d.mkdir()
    (d / "report.json").write_text(json.dumps({"tiers": {"server": srv}}))
    return d


def test_a_backend_is_eligible_only_once_its_pairs_passed(tmp_path):
    failed = eligibility.parity_from_report(server_report(tmp_path, "differ", "accept length"))
    v = eligibility.of("pcie_ipc", failed)
    assert v["eligible"] is False and v["why"].startswith(
        "pair 'P5 PCIe-IPC vs NCCL, EAGLE-3' failed (accept length): greedy text identical, but the accept length")
    assert eligibility.of("pcie_ipc", eligibility.parity_from_report(server_report(tmp_path, "same")))["eligible"] is True
    unrun = eligibility.of("pcie_ipc", eligibility.parity_from_report(server_report(tmp_path, "not_run")))
    assert unrun["eligible"] is None and unrun["why"].startswith("pair 'P5 PCIe-IPC vs NCCL, EAGLE-3' not run")
    # --ab: a pair that failed on one side fails it, named with the side
    ab = eligibility.of("pcie_ipc", eligibility.parity_from_report(server_report(tmp_path, "differ", side=True)))
    assert ab["eligible"] is False and " failed on side A: 0.5.9 + P5 (~/ml-env)" in ab["why"]
    assert eligibility.of("nccl_p2p_off", None)["eligible"] is True  # NCCL is the reference
    none = eligibility.of("b12x_fused", None, "scripts/regress.sh --tier server --modes x")
    assert none == {"eligible": None, "why": "no server-tier parity yet (--with-profile REPORT); run "
                                             "`scripts/regress.sh --tier server --modes x` and pass its report with --with-profile"}
    assert "no parity pair in" in eligibility.of("mscclpp", failed)["why"]


def test_the_decision_table_marks_what_is_not_eligible_and_picks_the_fastest_eligible(tmp_path):
    rows = [{"backend": b, "install": "A", "mode": "graph", "rows": n, "hidden": 7168, "status": "ok", "median_us": us}
            for b, pts in (("nccl", {1: 60.0, 3: 150.0}), ("pcie_ipc", {1: 10.0, 3: 14.0}), ("custom_ar", {1: 20.0, 3: 40.0}),
                           ("b12x_oneshot", {1: 8.0, 3: 12.0})) for n, us in pts.items()]
    cfg = {**decision.DEFAULTS, "hidden": 7168, "confirm": {"pcie_ipc": "scripts/regress.sh --tier server --modes a,b"}}
    parity = eligibility.parity_from_report(server_report(tmp_path, "differ", "accept length"))
    parity["pairs"].append({"name": "P2", "status": "same", "detail": "same", "backends": ["custom_ar"], "side": None})
    bad = {("b12x_oneshot", "A"): "b12x_oneshot [3,7168] x 256 back-to-back CUDA-graph replays: 5 differ from NCCL ..."}
    d = decision.project(rows, cfg, None, None, parity, bad)
    c = {x["backend"]: x for x in d["candidates"]}
    assert [x["backend"] for x in d["candidates"]] == ["pcie_ipc", "custom_ar", "nccl"]
    assert (c["pcie_ipc"]["eligible"], c["custom_ar"]["eligible"], c["nccl"]["eligible"]) == (False, True, True)
    assert d["winner"] == "custom_ar [A]"
    why = {x["backend"]: x for x in d["not_ranked"]}["b12x_oneshot"]
    assert why["eligible"] is False and why["why"].startswith("wrong over back-to-back CUDA-graph replays")
    md = "\n".join(decision.markdown(d, {}, cfg["confirm"]))
    assert "| SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 (0.5.9 + P5" in md and md.count("| **NO** |") == 1
    assert "- pcie_ipc [A]: **NO**: pair 'P5 PCIe-IPC vs NCCL, EAGLE-3' failed (accept length)" in md
    assert "Fastest by this projection: **pcie_ipc** (install A), **NOT eligible**: pair 'P5 PCIe-IPC vs NCCL, " \
           "EAGLE-3' failed" in md and "Winner among the eligible: **custom_ar [A]**" in md
    assert "- b12x_oneshot [A]: wrong over back-to-back CUDA-graph replays" in md


# ----------------------------------------------------------------------------- the tier, with the stand-in worker


def fake_python(tmp_path: Path) -> str:
    p = tmp_path / "fakepy"
    p.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    p.chmod(0o755)
    return str(p)


def kernel_project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "targets" / "c.toml").write_text(textwrap.dedent(f"""
        [kernel]
        python = "{fake_python(tmp_path)}"
        device = "cpu"
        world_size = 2
        hidden = 7168
        sizes = [1, 3]
        backends = ["nccl", "pcie_ipc"]
        required_backends = ["nccl"]
        p2p_disabled_run = false
        default_env_run = false
        replay_iterations = 32
        replay_sizes = [1, 3]
        nvidia_smi = "/nonexistent/nvidia-smi"
        [kernel.decision]
        layers = 61
        [kernel.decision.confirm]
        pcie_ipc = "scripts/regress.sh --tier server --modes eagle3_nccl,eagle3_pcie_ipc"
        """))
    return proj


def test_a_replay_that_differs_from_nccl_fails_the_tier_and_the_backend_is_never_eligible(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLPATCH_STANDIN_KB", "replay_mismatch")
    proj = kernel_project(tmp_path)
    srv = server_report(tmp_path, "same")
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), with_profile=str(srv))
    k = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]
    assert res["exit_code"] == 1
    assert k["failures"] == ["REPLAY MISMATCH: pcie_ipc [3,7168] x 32 back-to-back CUDA-graph replays: 5 differ from "
                             "NCCL on the same inputs, first replay 17 on rank 1, output element [2,4402]: got 7.0, NCCL 6.0"]
    assert all(r["status"] == "ok" for r in k["results"])  # right in every latency sample
    d = k["decision"]
    assert [c["backend"] for c in d["candidates"]] == ["nccl"] and d["winner"] == "nccl [A]"
    assert {x["backend"]: x["eligible"] for x in d["not_ranked"]} == {"pcie_ipc": False}
    md = (tmp_path / "r" / "report.md").read_text()
    assert "### Back-to-back CUDA-graph replays against NCCL" in md and "| pcie_ipc | 3 | 32 | **MISMATCH**: " in md


def test_with_every_replay_right_the_server_pairs_decide(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLPATCH_STANDIN_KB", "latency")
    proj = kernel_project(tmp_path)
    for status, eligible, winner in (("same", "yes", "pcie_ipc [A]"), ("differ", "**NO**", "nccl [A]")):
        rep = tmp_path / f"r-{status}"
        res = regress.run_regress("kernel", "c", str(rep), str(proj),
                                  with_profile=str(server_report(tmp_path, status, "accept length")))
        k = json.loads((rep / "report.json").read_text())["tiers"]["kernel"]
        assert res["exit_code"] == 0, k["failures"]
        assert all(r["status"] == "ok" for r in k["replay"]) and len(k["replay"]) == 4
        assert k["decision"]["winner"] == winner and k["decision"]["candidates"][0]["backend"] == "pcie_ipc"
        md = (rep / "report.md").read_text()
        assert f"| {eligible} |" in md and "| pcie_ipc | 1 | 32 | same as NCCL |" in md
        assert f"eligible winner {winner}" in k["summary"]
