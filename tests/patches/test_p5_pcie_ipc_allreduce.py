"""P5 (0005, FlashInfer PCIe-IPC allreduce backport): the rules of the real patched modules.

One subprocess imports the patched 0.5.9 tree: the pure width and blocker rules, the width read
from the server settings, P1's gate yielding, the start-up path's order, the Envs declarations.
Then real processes on a real gloo group construct the real ``PcieIpcAllReduce``; only
flashinfer's ``PcieIpcAllReduceWorkspace`` (it needs CUDA) is a recording stand-in, and
torch.cuda's stream queries. A blocker on one rank turns it off on every rank, with no hang.
"""

from __future__ import annotations

import json

import pytest
from forked_ranks import RANK_RUNNER

CODE = r"""
import datetime, json, logging, os, signal, socket, sys, tempfile, time, types
import torch
import torch.distributed as dist
import sglang.srt.distributed.device_communicators.pcie_ipc_allreduce as m
import sglang.srt.server_args as sa
from sglang.srt.environ import envs

out = {}
out["envs"] = [envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get(), envs.SGLANG_PCIE_IPC_MAX_NUMEL.get(),
               envs.SGLANG_PCIE_IPC_TUNE.get()]
out["numel"] = {f"{r}x{h}": m.pcie_ipc_max_numel(r, h) for r, h in ((3, 7168), (1, 7), (2, 5), (24, 7168), (0, 7168))}
B = lambda ws, cuda=True, det=False, hidden=7168, numel=3 * 7168: m.pcie_ipc_blocker(ws, cuda, det, hidden, numel)
out["blocker_no_fi"] = B(8)
class FakeWorkspace:  # flashinfer.comm.pcie_ipc_ar.PcieIpcAllReduceWorkspace needs CUDA
    calls = []
    def __init__(self, group, max_numel, dtype, tune_cache):
        FakeWorkspace.calls.append(["init", max_numel, str(dtype), tune_cache])
    def prepare(self, shapes, dtype):
        FakeWorkspace.calls.append(["prepare", len(shapes), shapes[0], shapes[-1]])
        return {s: (None if s[0] == 2 else object()) for s in shapes}
    def supports(self, inp):
        return True
    def rebind_stream(self):
        FakeWorkspace.calls.append(["rebind"])
    def all_reduce(self, inp):
        FakeWorkspace.calls.append(["all_reduce", list(inp.shape)])
        return inp
    def tune(self, hiddens, tune_group):
        FakeWorkspace.calls.append(["tune", hiddens])
        return {}
    def destroy(self):
        FakeWorkspace.calls.append(["destroy"])
def install_fake_flashinfer():
    fi = types.ModuleType("flashinfer"); fi.__path__ = []
    comm = types.ModuleType("flashinfer.comm"); comm.__path__ = []
    ar = types.ModuleType("flashinfer.comm.pcie_ipc_ar"); ar.PcieIpcAllReduceWorkspace = FakeWorkspace
    tun = types.ModuleType("flashinfer.comm.pcie_ipc_tuning")
    tun.default_cache_path = lambda ws: f"/nonexistent/pcie_ipc_all_reduce_ws{ws}.json"
    sys.modules.update({"flashinfer": fi, "flashinfer.comm": comm, "flashinfer.comm.pcie_ipc_ar": ar,
                        "flashinfer.comm.pcie_ipc_tuning": tun})
install_fake_flashinfer()
out["blocker"] = {str(ws): B(ws) for ws in (1, 2, 3, 4, 6, 8, 16)}
out["blocker_cpu"] = B(8, cuda=False)
out["blocker_det"] = B(8, det=True)
out["blocker_hidden0"] = B(8, hidden=0)
out["blocker_below_row"] = B(8, numel=7167)
out["blocker_one_row"] = B(8, numel=7168)

class MC:
    hidden_size = 7168
def server(bs, max_bs, algo, tokens):
    return types.SimpleNamespace(cuda_graph_bs=bs, cuda_graph_max_bs=max_bs, speculative_algorithm=algo,
        speculative_num_draft_tokens=tokens, get_model_config=lambda: MC, enable_deterministic_inference=False,
        enable_flashinfer_allreduce_fusion=False)
shapes = {}
for name, args in {"bs_list": ([1, 2, 16, 4], 99, None, None), "max_bs": (None, 24, None, None),
                   "eagle3": ([1, 2, 8], 99, "EAGLE3", 3), "no_spec_tokens": ([8], 99, None, 3),
                   "eagle_none_tokens": ([8], 99, "EAGLE", None)}.items():
    sa._global_server_args = server(*args)
    shapes[name] = list(m.captured_decode_shape()[:2])
out["shape"] = shapes
G = sa.get_flashinfer_allreduce_fusion_blocker
out["p1"] = {"sm120_ipc": G(12, "0.7.2", True, True, pcie_ipc_on=True), "sm120": G(12, "0.7.2", True, True),
             "sm90_ipc": G(9, "0.6.3", True, True, pcie_ipc_on=True),
             "sm100_ipc": G(10, "0.6.3", True, True, pcie_ipc_on=True)}
N = types.SimpleNamespace
on, off = N(disabled=False), N(disabled=True)
paths = {}
for name, (fused, ca, ipc) in {"all": (True, on, on), "ca_ipc": (False, on, on), "ipc": (False, off, on),
                               "none": (False, None, off), "ca_off_ipc_none": (False, off, None)}.items():
    sa._global_server_args = server([1], 1, None, None); sa._global_server_args.enable_flashinfer_allreduce_fusion = fused
    paths[name] = m.decode_allreduce_path(N(ca_comm=ca, pcie_ipc_comm=ipc))
out["paths"] = paths

class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO); self.records = []
    def emit(self, record):
        self.records.append([record.levelname, record.getMessage()])

class Stream:  # torch.Stream's comparison before pytorch PR 192523 (torch 2.9.1, 2.11): False against None
    def __init__(self, sid):
        self.sid = sid
    def __eq__(self, other):
        return other is not None and self.sid == other.sid
    def __ne__(self, other):
        return other is not None and self.sid != other.sid

WS = 4
def child(rank, port, outdir, bad_rank, max_numel_env):
    os.environ.pop("SGLANG_PCIE_IPC_MAX_NUMEL", None)
    if rank == bad_rank:
        os.environ["SGLANG_PCIE_IPC_MAX_NUMEL"] = max_numel_env
    os.environ["SGLANG_PCIE_IPC_TUNE"] = "0"
    sa._global_server_args = server([1, 2, 4], 4, "EAGLE3", 3)  # 12 rows of 7168
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WS,
                            timeout=datetime.timedelta(seconds=30))
    cap = Capture(); m.logger.addHandler(cap); m.logger.setLevel(logging.INFO)
    capturing = [False]; stream = [Stream(0)]
    torch.cuda.is_current_stream_capturing = lambda: capturing[0]
    torch.cuda.current_stream = lambda: stream[0]
    comm = m.PcieIpcAllReduce(group=dist.group.WORLD, device=torch.device("cuda", 3))
    res = {"disabled": comm.disabled, "max_numel": comm.max_numel, "max_rows": comm.max_rows, "log": cap.records}
    if not comm.disabled:
        bf = torch.bfloat16
        t = lambda rows, hidden=7168, dtype=bf: torch.empty(rows, hidden, dtype=dtype)
        res["eager"] = {k: comm.should_pcie_ipc_ar(v) for k, v in {
            "1": t(1), "12": t(12), "13": t(13), "fp16": t(3, dtype=torch.float16), "fp32": t(3, dtype=torch.float32),
            "hidden4096": t(3, 4096), "1d": torch.empty(7168, dtype=bf)}.items()}
        comm.prepare(); comm.prepare()
        capturing[0] = True
        res["capture"] = {str(r): comm.should_pcie_ipc_ar(t(r)) for r in (1, 2, 3, 12, 13)}
        capturing[0] = False
        comm.all_reduce(t(3)); comm.all_reduce(t(3)); stream[0] = Stream(7); comm.all_reduce(t(1))
        comm.destroy()
        res["after_destroy"] = comm.should_pcie_ipc_ar(t(1))
    res["calls"] = FakeWorkspace.calls
    json.dump(res, open(os.path.join(outdir, f"{rank}.json"), "w"))
    dist.barrier()
    open(os.path.join(outdir, f"{rank}.done"), "w").write("ok")

def run_case(bad_rank=-1, max_numel_env=""):
    return run_ranks(WS, child, 90, bad_rank, max_numel_env)

out["ok"] = run_case()
out["rank2_below_row"] = run_case(2, "7000")
out["rank1_other_width"] = run_case(1, str(16 * 7168))
print("RESULT" + json.dumps(out))
"""

ROWS = 12  # captured batch 4 x 3 EAGLE-3 tokens
NUMEL = ROWS * 7168


@pytest.fixture(scope="module")
def result(run_patched):
    proc = run_patched(RANK_RUNNER + CODE, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_off_by_default_and_tune_auto(result):
    assert result["envs"] == [False, None, "auto"]


def test_width_rounds_up_to_a_whole_pack(result):
    assert result["numel"] == {"3x7168": 21504, "1x7": 8, "2x5": 16, "24x7168": 172032, "0x7168": 0}


def test_blocker_rules(result):
    assert "flashinfer.comm.pcie_ipc_ar.PcieIpcAllReduceWorkspace does not import" in result["blocker_no_fi"]
    assert "flashinfer-python>=0.7.0" in result["blocker_no_fi"]
    for ws in ("2", "4", "8"):
        assert result["blocker"][ws] is None
    for ws in ("1", "3", "6", "16"):
        assert result["blocker"][ws] == f"it supports (2, 4, 8) ranks, not {ws}"
    assert result["blocker_cpu"] == "it needs CUDA"
    assert result["blocker_det"].startswith("--enable-deterministic-inference is on")
    assert "hidden 0" in result["blocker_hidden0"]
    assert "max_numel 7167" in result["blocker_below_row"]
    assert result["blocker_one_row"] is None


def test_width_from_the_server_settings(result):
    assert result["shape"] == {
        "bs_list": [16, 7168],  # max(--cuda-graph-bs), not the last or the max_bs
        "max_bs": [24, 7168],
        "eagle3": [24, 7168],  # 8 x 3 draft tokens
        "no_spec_tokens": [8, 7168],  # draft tokens without speculation do not count
        "eagle_none_tokens": [8, 7168],
    }


def test_p1_yields_on_sm120_only(result):
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 hands the decode/verify reductions" in result["p1"]["sm120_ipc"]
    assert result["p1"]["sm120"] is None
    assert result["p1"]["sm90_ipc"] is None and result["p1"]["sm100_ipc"] is None


def test_startup_path_in_dispatch_order(result):
    assert result["paths"] == {
        "all": "trtllm fused",
        "ca_ipc": "custom allreduce",
        "ipc": "PCIe-IPC",
        "none": "NCCL",
        "ca_off_ipc_none": "NCCL",
    }


def test_every_rank_builds_and_serves_the_same_shapes(result):
    case = result["ok"]
    assert case["blocked"] == 0
    for rank, r in case["ranks"].items():
        assert r["in_step"], (rank, r)
        assert not r["disabled"] and r["max_numel"] == NUMEL and r["max_rows"] == ROWS
        assert r["calls"][0] == ["init", NUMEL, "torch.bfloat16", "/nonexistent/pcie_ipc_all_reduce_ws4.json"]
        assert ["prepare", ROWS, [1, 7168], [ROWS, 7168]] in r["calls"]
        assert sum(c[0] == "prepare" for c in r["calls"]) == 1  # prepare is once per process
        assert not any(c[0] == "tune" for c in r["calls"])  # SGLANG_PCIE_IPC_TUNE=0
        assert r["eager"] == {"1": True, "12": True, "13": False, "fp16": False, "fp32": False,
                              "hidden4096": False, "1d": False}
        # inside a capture only prepared row counts (2 resolved to unsupported)
        assert r["capture"] == {"1": True, "2": False, "3": True, "12": True, "13": False}
        tail = r["calls"][-6:]
        assert tail == [["rebind"], ["all_reduce", [3, 7168]], ["all_reduce", [3, 7168]], ["rebind"],
                        ["all_reduce", [1, 7168]], ["destroy"]]
        assert r["after_destroy"] is False
    infos = [msg for lvl, msg in case["ranks"]["0"]["log"] if lvl == "INFO"]
    assert any(f"up to {NUMEL} elements ({ROWS} rows of 7168, captured batch 4 x 3 tokens)" in i for i in infos)
    assert case["ranks"]["1"]["log"] == []


@pytest.mark.parametrize("case,rank,why", [("rank2_below_row", 2, "max_numel 7000"),
                                           ("rank1_other_width", 0, "the ranks disagree on the width")])
def test_one_rank_off_turns_every_rank_off_without_a_hang(result, case, rank, why):
    c = result[case]
    assert c["blocked"] == 0
    for r in c["ranks"].values():
        assert r["in_step"] and r["disabled"] and r["max_numel"] == 0
        assert not any(call[0] == "init" for call in r["calls"])  # nobody entered the collective
        warnings = [msg for lvl, msg in r["log"] if lvl == "WARNING"]
        assert len(warnings) == 1
        assert warnings[0].startswith(f"PCIe-IPC allreduce is off on all 4 ranks because rank {rank}: ")
        assert why in warnings[0] and "unset SGLANG_ENABLE_PCIE_IPC_ALLREDUCE" in warnings[0]
