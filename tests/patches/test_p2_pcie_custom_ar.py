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
    def all_gather(outs, t, group=None):
        for i, o in enumerate(outs):
            o.copy_(torch.tensor([i], dtype=torch.int))
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
    assert result["defaults"] == {"enable": False, "cap": CAP}


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
