"""P2 (0002-pcie-custom-allreduce): opt-in custom allreduce for small tensors on more than two
PCIe-only GPUs, with the kernel initialised so that it launches (full_nvlink=True).

One subprocess drives the patched code itself: the pure ``custom_ar_max_bytes`` decision, the
``Envs`` declarations, and the real ``CustomAllreduce`` class constructed for world sizes 2/4/8.
Only what this CPU machine lacks is faked: the sgl_kernel allreduce ops (they record the
``init_custom_ar`` arguments), the CUDA runtime (IPC buffers), NVML's NVLink query, the GPU P2P
probe, the same-node probe and the torch.distributed collectives of the process group.
"""

from __future__ import annotations

import json

import pytest
from forked_ranks import RANK_RUNNER

CAP = 64 * 1024
MAX_SIZE = 8192 * 1024  # CustomAllreduce._MAX_CAR_SIZE on CUDA
HIDDEN = 7168  # Kimi-K2.5 hidden size; bf16 -> 14336 bytes per token
SIZES = [16, 14336, 43008, 57344, CAP - 16, CAP, CAP + 16, 71680, 131072, 458752, MAX_SIZE, MAX_SIZE + 16]

CODE = r"""
import ctypes, json, logging, os, sys, types
import torch
import sglang.srt.distributed.device_communicators.custom_all_reduce as car
from sglang.srt.environ import envs

SIZES = __SIZES__
out = {"pure": {}, "cls": {}, "tokens": {}, "warnings": {}}
out["defaults"] = {
    "enable": envs.SGLANG_ENABLE_PCIE_CUSTOM_AR.get(),
    "cap": envs.SGLANG_PCIE_CUSTOM_AR_MAX_BYTES.get(),
}

# 1. the pure decision
for ws in (2, 4, 8):
    for nvlink in (False, True):
        for p2p in (False, True):
            for pcie in (False, True):
                for cap in (0, 65536, 1 << 30):
                    out["pure"][f"{ws}|{nvlink}|{p2p}|{pcie}|{cap}"] = car.custom_ar_max_bytes(
                        ws, nvlink, p2p, __MAX_SIZE__, pcie, cap
                    )

# 2. the real class with fakes for what a CPU box lacks
class FakeOps:  # plays sgl_kernel.allreduce as wrapped by custom_all_reduce_ops
    IS_CUSTOM_AR_AVAILABLE = True
    def __init__(self):
        self.init_calls = []
    def meta_size(self):
        return 4096
    def init_custom_ar(self, meta_ptrs, rank_data, rank, full_nvlink):
        self.init_calls.append({"rank": rank, "full_nvlink": full_nvlink, "n_peers": len(meta_ptrs)})
        return 1234
    def register_buffer(self, ptr, ptrs):
        pass
    def dispose(self, ptr):
        pass

class FakeCudaRT:  # plays the CUDA runtime behind create_shared_buffer
    _next = [0x10000]
    def cudaMalloc(self, n):
        self._next[0] += n + 4096
        return ctypes.c_void_p(self._next[0])
    def cudaMemset(self, *a):
        pass
    def cudaIpcGetMemHandle(self, p):
        return b"handle"
    def cudaIpcOpenMemHandle(self, h):
        return ctypes.c_void_p(0x99)
    def cudaFree(self, p):
        pass

def fake_dist(world_size, rank):  # plays the torch.distributed group of world_size ranks
    d = types.SimpleNamespace(Backend=torch.distributed.Backend)
    d.get_backend = lambda group=None: "gloo"
    d.get_rank = lambda group=None: rank
    d.get_world_size = lambda group=None: world_size
    def all_gather(outs, t, group=None):  # physical ids are 0..n-1; other rows equal ours
        for i, o in enumerate(outs):
            o.copy_(torch.tensor([i], dtype=torch.int) if t.numel() == 1 else t)
    d.all_gather = all_gather
    def all_gather_object(outs, obj, group=None):
        for i in range(len(outs)):
            outs[i] = obj
    d.all_gather_object = all_gather_object
    return d

class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []
    def emit(self, record):
        self.records.append(record.getMessage())
cap_log = Capture()
car.logger.addHandler(cap_log)

car._is_cuda = True  # the platform probe: this box has no CUDA
car.CudaRTLibrary = FakeCudaRT
car.in_the_same_node_as = lambda group, source_rank=0: [True] * car.dist.get_world_size()
torch.cuda.device_count = lambda: 8
os.environ.pop("CUDA_VISIBLE_DEVICES", None)

# From 0.5.10 the NVLink/P2P gate lives in custom_all_reduce_utils (the rebased P2 is ported
# there); give that module the same stand-ins so the test runs on either layout.
caru = sys.modules.get("sglang.srt.distributed.device_communicators.custom_all_reduce_utils")
if caru is not None and hasattr(caru, "can_use_custom_all_reduce_with_nvlink"):
    caru.logger.addHandler(cap_log)
    caru._is_hip = False
    caru.in_the_same_node_as = car.in_the_same_node_as
else:
    caru = None

def build(ws, nvlink, p2p, rank=1):
    ops = FakeOps()
    car.ops = ops
    car.dist = fake_dist(ws, rank)
    car.is_full_nvlink = lambda ids, world_size: nvlink
    car.gpu_p2p_access_check = lambda src, tgt: p2p
    if caru is not None:
        caru.dist = car.dist
        caru.is_full_nvlink = car.is_full_nvlink
        caru.gpu_p2p_access_check = car.gpu_p2p_access_check
    ca = car.CustomAllreduce(group=object(), device=torch.device("cpu", rank))
    return ca, ops

def bf16_bytes(n):
    return torch.empty(n // 2, dtype=torch.bfloat16)

for env in (None, "0", "1"):
    for env_cap in (None, "32768"):
        if env is None:
            os.environ.pop("SGLANG_ENABLE_PCIE_CUSTOM_AR", None)
        else:
            os.environ["SGLANG_ENABLE_PCIE_CUSTOM_AR"] = env
        if env_cap is None:
            os.environ.pop("SGLANG_PCIE_CUSTOM_AR_MAX_BYTES", None)
        else:
            os.environ["SGLANG_PCIE_CUSTOM_AR_MAX_BYTES"] = env_cap
        for ws in (2, 4, 8):
            for nvlink in (False, True):
                for p2p in (False, True):
                    cap_log.records.clear()
                    ca, ops = build(ws, nvlink, p2p)
                    key = f"{env}|{env_cap}|{ws}|{nvlink}|{p2p}"
                    out["cls"][key] = {
                        "disabled": ca.disabled,
                        "init": ops.init_calls,
                        "custom": {str(n): ca.should_custom_ar(bf16_bytes(n)) for n in SIZES},
                    }
                    out["warnings"][key] = list(cap_log.records)
                    if key == "1|None|8|False|True":
                        for tokens in (1, 3, 4, 5, 32):
                            x = torch.empty(tokens, __HIDDEN__, dtype=torch.bfloat16)
                            out["tokens"][str(tokens)] = ca.should_custom_ar(x)
                        # still needs 16-byte multiples and a contiguous tensor
                        out["odd"] = ca.should_custom_ar(torch.empty(3, dtype=torch.bfloat16))
                        out["strided"] = ca.should_custom_ar(torch.empty(8, 64, dtype=torch.bfloat16)[:, ::2])
                    ca.close()

# 3. the default cap: the widest allreduce captured in CUDA graphs, within the one-stage kernel
out["one_stage"] = {str(ws): car.one_stage_max_bytes(ws) for ws in (4, 6, 8)}
out["default_cap"] = {
    f"{ws}|{bs}|{t}": car.pcie_custom_ar_default_max_bytes(ws, bs, t, __HIDDEN__)
    for ws in (4, 8) for bs in (1, 2, 4, 6, 160) for t in (1, 3)
}
import sglang.srt.server_args as sa
os.environ["SGLANG_ENABLE_PCIE_CUSTOM_AR"] = "1"
out["server_cap"] = {}
for ws in (4, 8):
    for bs, bs_list, algo, draft in ((1, None, "EAGLE3", 3), (2, None, "EAGLE3", 3), (160, None, None, 3),
                                     (160, [1, 2, 4], "EAGLE3", 3), (160, None, "EAGLE3", 3)):
        sa.set_global_server_args_for_scheduler(types.SimpleNamespace(
            cuda_graph_max_bs=bs, cuda_graph_bs=bs_list, speculative_algorithm=algo,
            speculative_num_draft_tokens=draft,
            get_model_config=lambda: types.SimpleNamespace(hidden_size=__HIDDEN__)))
        for env_cap in (None, "32768", "0"):
            if env_cap is None:
                os.environ.pop("SGLANG_PCIE_CUSTOM_AR_MAX_BYTES", None)
            else:
                os.environ["SGLANG_PCIE_CUSTOM_AR_MAX_BYTES"] = env_cap
            ca, ops = build(ws, False, True)
            key = f"{ws}|{bs}|{bs_list}|{algo}|{env_cap}"
            out["server_cap"][key] = ca.max_custom_ar_bytes
            if key == "8|2|None|EAGLE3|None":
                out["verify_bs2"] = ca.should_custom_ar(torch.empty(6, __HIDDEN__, dtype=torch.bfloat16))
            ca.close()
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(run_patched):
    code = (
        CODE.replace("__SIZES__", repr(SIZES)).replace("__MAX_SIZE__", str(MAX_SIZE)).replace("__HIDDEN__", str(HIDDEN))
    )
    proc = run_patched(code, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def expected_limit(ws, nvlink, p2p, pcie, cap):
    if not p2p:
        return 0
    if ws == 2 or nvlink:
        return MAX_SIZE
    if pcie:
        return min(MAX_SIZE, cap)
    return 0


def test_env_defaults_are_safe(result):
    # cap unset: derived from the captured CUDA-graph sizes (65536 when those are unknown)
    assert result["defaults"] == {"enable": False, "cap": None}


def test_one_stage_limits_match_sgl_kernel(result):
    # custom_all_reduce.cuh: 1stage if (ws <= 4 && bytes < 512 KiB) || (ws <= 8 && bytes < 256 KiB)
    assert result["one_stage"] == {"4": 512 * 1024 - 16, "6": 256 * 1024 - 16, "8": 256 * 1024 - 16}


def test_default_cap_is_the_widest_captured_allreduce(result):
    dc = result["default_cap"]
    assert dc["8|1|3"] == 3 * HIDDEN * 2 == 43008  # batch-1 EAGLE-3 verify
    assert dc["8|2|3"] == 6 * HIDDEN * 2 == 86016  # batch-2 verify: was NCCL with 64 KiB
    assert dc["8|4|1"] == 4 * HIDDEN * 2
    assert dc["8|6|3"] == 18 * HIDDEN * 2 == 258048  # still one-stage at 8 ranks
    assert dc["8|160|1"] == dc["8|160|3"] == 256 * 1024 - 16  # clamped: stays one-stage
    assert dc["4|160|3"] == 512 * 1024 - 16 and dc["4|6|3"] == 258048


def test_server_derives_the_cap_and_the_env_var_still_overrides(result):
    sc = result["server_cap"]
    for ws, limit in ((8, 256 * 1024 - 16), (4, 512 * 1024 - 16)):
        assert sc[f"{ws}|1|None|EAGLE3|None"] == 43008
        assert sc[f"{ws}|2|None|EAGLE3|None"] == 86016
        assert sc[f"{ws}|160|None|None|None"] == min(160 * HIDDEN * 2, limit)
        assert sc[f"{ws}|160|[1, 2, 4]|EAGLE3|None"] == 4 * 3 * HIDDEN * 2  # explicit --cuda-graph-bs
        assert sc[f"{ws}|160|None|EAGLE3|None"] == limit
        for key in ("1|None|EAGLE3", "160|None|EAGLE3"):
            assert sc[f"{ws}|{key}|32768"] == 32768
            assert sc[f"{ws}|{key}|0"] == 0
    assert result["verify_bs2"] is True  # [6, 7168] bf16 now takes the custom kernel


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_pure_decision_matrix(result, ws):
    for nvlink in (False, True):
        for p2p in (False, True):
            for pcie in (False, True):
                for cap in (0, 65536, 1 << 30):
                    got = result["pure"][f"{ws}|{nvlink}|{p2p}|{pcie}|{cap}"]
                    assert got == expected_limit(ws, nvlink, p2p, pcie, cap), (ws, nvlink, p2p, pcie, cap)


@pytest.mark.parametrize("env", [None, "0", "1"])
@pytest.mark.parametrize("ws", [2, 4, 8])
def test_class_matrix(result, env, ws):
    for env_cap in (None, "32768"):
        cap = CAP if env_cap is None else int(env_cap)
        for nvlink in (False, True):
            for p2p in (False, True):
                r = result["cls"][f"{env}|{env_cap}|{ws}|{nvlink}|{p2p}"]
                pcie = env == "1" and ws > 2 and not nvlink
                enabled = p2p and (ws == 2 or nvlink or pcie)
                assert r["disabled"] is (not enabled), (env, env_cap, ws, nvlink, p2p, r)
                limit = expected_limit(ws, nvlink, p2p, env == "1", cap) if enabled else 0
                for n, custom in r["custom"].items():
                    assert custom is (int(n) <= limit), (env, env_cap, ws, nvlink, p2p, n)


@pytest.mark.parametrize("ws", [4, 8])
def test_pcie_kernel_is_initialised_so_that_it_launches(result, ws):
    # sgl-kernel launches nothing for world_size > 2 unless full_nvlink is true
    r = result["cls"][f"1|None|{ws}|False|True"]
    assert r["init"] == [{"rank": 1, "full_nvlink": True, "n_peers": ws}]


def test_true_topology_still_reaches_the_kernel_elsewhere(result):
    assert result["cls"]["1|None|2|False|True"]["init"][0]["full_nvlink"] is False
    assert result["cls"]["None|None|2|False|True"]["init"][0]["full_nvlink"] is False
    assert result["cls"]["None|None|8|True|True"]["init"][0]["full_nvlink"] is True


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_p2p_is_still_required(result, env):
    for ws in (2, 4, 8):
        for nvlink in (False, True):
            r = result["cls"][f"{env}|None|{ws}|{nvlink}|False"]
            assert r["disabled"] is True and r["init"] == []


def test_decode_and_verify_tensors_use_custom_larger_use_nccl(result):
    assert result["tokens"] == {"1": True, "3": True, "4": True, "5": False, "32": False}
    assert result["odd"] is False and result["strided"] is False


def test_warning_points_to_the_opt_in(result):
    w = result["warnings"]["None|None|8|False|True"]
    assert len(w) == 1 and "SGLANG_ENABLE_PCIE_CUSTOM_AR=1" in w[0]
    assert result["warnings"]["1|None|8|False|True"] == []


# --------------------------------------------------------------------------------------
# Every rank takes the same path (issue 13): 8 real processes, a real gloo group, the real
# CustomAllreduce constructor; only the P2P probe (an asymmetric matrix), NVML's NVLink
# answer, the same-node probe, the CUDA runtime behind the IPC buffers and the sgl_kernel
# ops are stand-ins. A rank that backs out alone leaves the others waiting in
# create_shared_buffer's all_gather: that shows as a rank without a result at the deadline.

RANKS_CODE = r"""
import ctypes, datetime, json, logging, os, signal, socket, sys, tempfile, time
import torch
import torch.distributed as dist
import sglang.srt.distributed.device_communicators.custom_all_reduce as car
import sglang.srt.server_args  # imported once here, not by each forked rank
caru = sys.modules.get("sglang.srt.distributed.device_communicators.custom_all_reduce_utils")

WS = 8
DEADLINE = 120.0  # seconds for all 8 ranks to construct; a rank still running then is blocked

class FakeOps:
    IS_CUSTOM_AR_AVAILABLE = True
    def meta_size(self): return 4096
    def init_custom_ar(self, meta_ptrs, rank_data, rank, full_nvlink): return 1234
    def register_buffer(self, ptr, ptrs): pass
    def dispose(self, ptr): pass

class FakeCudaRT:
    def cudaMalloc(self, n): return ctypes.c_void_p(0x10000)
    def cudaMemset(self, *a): pass
    def cudaIpcGetMemHandle(self, p): return b"handle"
    def cudaIpcOpenMemHandle(self, h): return ctypes.c_void_p(0x99)
    def cudaFree(self, p): pass

class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []
    def emit(self, record):
        self.records.append(record.getMessage())

def child(rank, port, outdir, matrix, skip_check):
    os.environ["SGLANG_ENABLE_PCIE_CUSTOM_AR"] = "1"
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    if skip_check:
        os.environ["SGLANG_SKIP_P2P_CHECK"] = "1"
    else:
        os.environ.pop("SGLANG_SKIP_P2P_CHECK", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WS, timeout=datetime.timedelta(seconds=30))
    cap = Capture()
    probe = lambda src, tgt: matrix[src][tgt]  # stands in for the GPU P2P probe
    torch.cuda.device_count = lambda: WS
    torch.cuda.can_device_access_peer = probe  # the driver's report (SGLANG_SKIP_P2P_CHECK)
    for mod in filter(None, (car, caru)):
        mod.logger.addHandler(cap)
        for name, value in (("gpu_p2p_access_check", probe), ("is_full_nvlink", lambda ids, ws: False),
                            ("in_the_same_node_as", lambda group, source_rank=0: [True] * WS),
                            ("_is_cuda", True), ("_is_hip", False)):
            if hasattr(mod, name):
                setattr(mod, name, value)
    car.ops = FakeOps()
    car.CudaRTLibrary = FakeCudaRT
    ca = car.CustomAllreduce(group=dist.group.WORLD, device=torch.device("cpu", rank))
    res = {"disabled": ca.disabled, "warnings": cap.records,
           "max_bytes": getattr(ca, "max_custom_ar_bytes", None)}
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()  # every rank is still in step after the constructor
    with open(os.path.join(outdir, f"{rank}.done"), "w") as f:
        f.write("ok")

def run_case(matrix, skip_check):
    return run_ranks(WS, child, DEADLINE, matrix, skip_check)

full = [[True] * WS for _ in range(WS)]
asym = [row[:] for row in full]
asym[2][5] = False  # GPU 2 cannot reach GPU 5, GPU 5 can reach GPU 2
result = {
    "asym": run_case(asym, False),
    "asym_skip_check": run_case(asym, True),
    "full": run_case(full, False),
}
print("RESULT" + json.dumps(result))
"""


@pytest.fixture(scope="module")
def ranks_result(run_patched):
    proc = run_patched(RANK_RUNNER + RANKS_CODE, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.mark.parametrize("case", ["asym", "asym_skip_check"])
def test_one_missing_p2p_pair_disables_custom_ar_on_every_rank_without_a_hang(ranks_result, case):
    r = ranks_result[case]
    assert r["blocked"] == 0, r
    ranks = r["ranks"]
    assert all("error" not in ranks[str(k)] for k in range(8)), ranks
    assert {ranks[str(k)]["disabled"] for k in range(8)} == {True}, ranks
    assert all(ranks[str(k)]["in_step"] for k in range(8)), ranks
    for k in range(8):  # every rank names the failing pair
        w = [m for m in ranks[str(k)]["warnings"] if "P2P" in m]
        assert len(w) == 1 and "2->5" in w[0], (k, ranks[str(k)]["warnings"])


def test_full_p2p_matrix_enables_custom_ar_on_every_rank(ranks_result):
    r = ranks_result["full"]
    assert r["blocked"] == 0, r
    ranks = r["ranks"]
    assert {ranks[str(k)]["disabled"] for k in range(8)} == {False}, ranks
    assert len({ranks[str(k)]["max_bytes"] for k in range(8)}) == 1
    assert all(ranks[str(k)]["in_step"] and ranks[str(k)]["warnings"] == [] for k in range(8)), ranks
