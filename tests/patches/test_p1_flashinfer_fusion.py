"""P1 (0001-sm120-flashinfer-allreduce-fusion): the flashinfer allreduce+RMSNorm fusion on SM120
only on explicit opt-in, with flashinfer >= 0.6.17 and P2P between all TP GPUs.

Everything runs once, in one subprocess, against the patched tree: the real gate function,
the real ServerArgs methods (auto-enable rule and the SM120 check) and the real
``apply_flashinfer_allreduce_fusion``. Only what this CPU machine lacks is faked: the GPU
probes (SM version, device name, the GPU P2P test), the installed flashinfer distribution
(a ``flashinfer_python-X.dist-info`` on sys.path) and, if absent, the third-party
``compressed_tensors``/``gguf`` packages that the model-config import chain pulls in.
"""

from __future__ import annotations

import json

import pytest

FLOOR = "0.6.17"
# both sides of the floor, with multi-digit and post parts (0.6.9 < 0.6.17 < 0.10.0, unlike as strings)
VERSIONS = [None, "0.6.3", "0.6.7.post3", "0.6.9", "0.6.16", "0.6.16.post4", "0.6.17", "0.6.17.post1", "0.6.18", "0.7.4", "0.10.0"]
SMS = [8, 9, 10, 11, 12]  # SM11x must be refused like SM8x; SM90/SM100 unchanged
AUTO_ARCHS = ["KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"]

CODE = r"""
import dataclasses, importlib.abc, importlib.machinery, importlib.util, inspect, json, logging
import os, sys, tempfile, types

# Third-party packages the model-config import chain needs; stubbed only when not installed.
class _Any(type):
    def __getattr__(cls, name):
        return cls
class _StubModule(types.ModuleType):
    __path__ = []
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(name, (), {})
class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAMES = ("compressed_tensors", "gguf")
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.NAMES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        return _StubModule(spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.append(_StubFinder())  # after the real finders: only for missing packages

# A fake installed flashinfer-python distribution whose version the test picks.
FI_DIR = tempfile.mkdtemp()
sys.path.insert(0, FI_DIR)
def install_flashinfer(version):
    for d in os.listdir(FI_DIR):
        import shutil; shutil.rmtree(os.path.join(FI_DIR, d))
    if version is not None:
        d = os.path.join(FI_DIR, f"flashinfer_python-{version}.dist-info")
        os.makedirs(d)
        with open(os.path.join(d, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n")
    importlib.invalidate_caches()

# The serving venv's own flashinfer-python (the target's, after apply --with-flashinfer) is hidden:
# the case's version is the one FI_DIR holds, None when it holds none.
import importlib.metadata
_version = importlib.metadata.version
def _case_version(name):
    if name.replace("_", "-").lower() != "flashinfer-python":
        return _version(name)
    for dist in importlib.metadata.distributions(path=[FI_DIR], name="flashinfer-python"):
        return dist.version
    raise importlib.metadata.PackageNotFoundError(name)
importlib.metadata.version = _case_version

import sglang.srt.server_args as sa
from sglang.srt.distributed.device_communicators import custom_all_reduce_utils as cu

VERSIONS = __VERSIONS__
ARCHS = __ARCHS__
out = {"gate": {}, "auto": {}, "optin": {}, "runtime": {}}

# 1. the pure gate, full matrix
for sm in (8, 9, 10, 11, 12):
    for v in VERSIONS:
        for req in (False, True):
            for p2p in (False, True):
                out["gate"][f"{sm}|{v}|{req}|{p2p}"] = sa.get_flashinfer_allreduce_fusion_blocker(sm, v, req, p2p)
out["floor"] = sa.FLASHINFER_ALLREDUCE_FUSION_SM120_MIN_VERSION

# 2. ServerArgs on a simulated GPU
def fresh(**kw):
    obj = sa.ServerArgs.__new__(sa.ServerArgs)
    for f in dataclasses.fields(sa.ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(obj, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(obj, f.name, f.default_factory())
        else:
            setattr(obj, f.name, None)
    obj.model_path = "dummy"
    for k, v in kw.items():
        setattr(obj, k, v)
    return obj

def simulate_gpu(sm):
    sa.get_device_sm = lambda: sm
    sa.is_sm90_supported = lambda: sm // 10 == 9
    sa.is_sm100_supported = lambda: sm // 10 == 10
    sa.is_sm120_supported = lambda: sm // 10 == 12
    sa.is_blackwell_supported = lambda: sm // 10 in (10, 11, 12)
    sa.get_device_name = lambda *a: "NVIDIA RTX PRO 6000 Blackwell Server Edition"

class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []
    def emit(self, record):
        self.records.append(record.getMessage())
cap = Capture()
sa.logger.addHandler(cap)

P2P = {"ok": True, "calls": []}
def fake_p2p(src, tgt):  # stands in for the CUDA P2P probe
    P2P["calls"].append([src, tgt])
    return P2P["ok"]
cu.gpu_p2p_access_check = fake_p2p

def post_init_fusion_steps(obj):
    # the two steps of __post_init__ that decide the flag, in __post_init__'s order
    obj._handle_model_specific_adjustments()
    obj._handle_flashinfer_allreduce_fusion()

install_flashinfer("0.6.17")
for sm in (90, 100, 120):
    simulate_gpu(sm)
    for arch in ARCHS:
        o = fresh(tp_size=8)
        o.get_model_config = lambda arch=arch: types.SimpleNamespace(
            hf_config=types.SimpleNamespace(architectures=[arch])
        )
        post_init_fusion_steps(o)
        out["auto"][f"{sm}|{arch}"] = o.enable_flashinfer_allreduce_fusion

simulate_gpu(120)
for v in VERSIONS:
    install_flashinfer(v)
    for p2p in (False, True):
        for nnodes in (1, 2):
            P2P["ok"], P2P["calls"] = p2p, []
            cap.records.clear()
            o = fresh(tp_size=8, nnodes=nnodes, enable_flashinfer_allreduce_fusion=True)
            o._handle_flashinfer_allreduce_fusion()
            out["optin"][f"{v}|{p2p}|{nnodes}"] = {
                "enabled": o.enable_flashinfer_allreduce_fusion,
                "warnings": list(cap.records),
                "p2p_pairs": sorted(map(tuple, P2P["calls"])),
            }
# GPUs from a non-default base_gpu_id with a non-default gpu_id_step: the probe walks those ids
install_flashinfer("0.6.17"); P2P["ok"], P2P["calls"] = True, []; cap.records.clear()
o = fresh(tp_size=4, base_gpu_id=2, gpu_id_step=2, enable_flashinfer_allreduce_fusion=True)
o._handle_flashinfer_allreduce_fusion()
out["p2p_offset"] = {"enabled": o.enable_flashinfer_allreduce_fusion, "pairs": sorted(map(tuple, P2P["calls"]))}
# not requested on SM120: nothing probed, nothing logged
install_flashinfer("0.6.17"); P2P["calls"] = []; cap.records.clear()
o = fresh(tp_size=8)
o._handle_flashinfer_allreduce_fusion()
out["not_requested"] = {"enabled": o.enable_flashinfer_allreduce_fusion, "warnings": list(cap.records), "p2p_calls": len(P2P["calls"])}
# SM90 with an old flashinfer and no P2P: upstream behaviour, the explicit flag stays
simulate_gpu(90); install_flashinfer("0.6.3"); P2P["ok"] = False; P2P["calls"] = []; cap.records.clear()
o = fresh(tp_size=8, enable_flashinfer_allreduce_fusion=True)
o._handle_flashinfer_allreduce_fusion()
out["sm90_explicit"] = {"enabled": o.enable_flashinfer_allreduce_fusion, "warnings": list(cap.records), "p2p_calls": len(P2P["calls"])}

src = inspect.getsource(sa.ServerArgs.__post_init__)
out["post_init_order"] = [
    src.find("self._handle_model_specific_adjustments()"),
    src.find("self._handle_flashinfer_allreduce_fusion()"),
]

# 3. the runtime check in communicator.py on a simulated SM120
import torch
import sglang.srt.layers.communicator as comm
import sglang.srt.layers.flashinfer_comm_fusion as fcf

class FakeComm:  # plays flashinfer.comm: records the workspace size, optionally fails
    fail = False
    def __init__(self):
        self.created = []
    def _create(self, world_size, max_token_num, hidden_dim):
        self.created.append({"world_size": world_size, "max_token_num": max_token_num, "hidden_dim": hidden_dim})
        if self.fail:
            raise RuntimeError("symmetric memory rendezvous failed")
    # the API sglang 0.5.9 calls
    def trtllm_create_ipc_workspace_for_all_reduce_fusion(self, rank, world_size, max_token_num, hidden_dim, group=None, use_fp32_lamport=False):
        self._create(world_size, max_token_num, hidden_dim)
        return ["handles"], torch.zeros(1)
    def trtllm_allreduce_fusion(self, **kw):
        kw["norm_out"].fill_(7.0)
        kw["residual_out"].fill_(7.0)
    def trtllm_destroy_ipc_workspace_for_all_reduce(self, *a, **k):
        pass
    # the unified API sglang 0.5.10 calls
    def create_allreduce_fusion_workspace(self, backend, world_size, rank, max_token_num, hidden_dim, dtype, force_oneshot_support=False):
        self._create(world_size, max_token_num, hidden_dim)
        return types.SimpleNamespace(is_buffer_size_sufficient=lambda **kw: True, destroy=lambda: None)
    def allreduce_fusion(self, **kw):
        self.trtllm_allreduce_fusion(**kw)
    AllReduceFusionPattern = types.SimpleNamespace(kARResidualRMSNorm=1)

def set_comm(fake):  # what a (failed) `import flashinfer.comm` leaves behind
    fcf._flashinfer_comm = fcf.comm = fake  # 0.5.9's initialize() calls it as `comm`
    if hasattr(fcf, "_flashinfer_allreduce_unavailable"):  # 0.5.10 also sets this flag
        fcf._flashinfer_allreduce_unavailable = fake is None

def fusion_usable():
    if hasattr(fcf, "is_flashinfer_allreduce_fusion_usable"):
        return fcf.is_flashinfer_allreduce_fusion_usable()
    return fcf._flashinfer_comm is not None and not fcf.is_flashinfer_allreduce_unavailable()

comm._is_sm90_supported = False
comm._is_sm100_supported = False
comm._is_flashinfer_available = True
set_comm(FakeComm())  # flashinfer.comm imported fine
for sm120 in (False, True):
    comm._is_sm120_supported = sm120
    for flag in (False, True):
        sa.set_global_server_args_for_scheduler(fresh(enable_flashinfer_allreduce_fusion=flag, cuda_graph_max_bs=8))
        for bs in (1, 3, 8, 9, 4096):
            out["runtime"][f"{sm120}|{flag}|{bs}"] = comm.apply_flashinfer_allreduce_fusion(bs)
comm._is_sm120_supported = True
sa.set_global_server_args_for_scheduler(fresh(
    enable_flashinfer_allreduce_fusion=True, cuda_graph_max_bs=8,
    speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4))
out["runtime_spec"] = {bs: comm.apply_flashinfer_allreduce_fusion(bs) for bs in (1, 32, 33, 2048)}
out["runtime_spec_max"] = comm.get_fuse_allreduce_max_tokens()
sa.set_global_server_args_for_scheduler(fresh(
    enable_flashinfer_allreduce_fusion=True, cuda_graph_bs=[1, 2, 4], cuda_graph_max_bs=160))
out["runtime_bs_list_max"] = comm.get_fuse_allreduce_max_tokens()
set_comm(None)  # "import flashinfer.comm" failed
out["runtime_no_comm"] = comm.apply_flashinfer_allreduce_fusion(1)
out["max_tokens"] = {
    f"{sm}|{bs}|{tpb}": sa.get_flashinfer_allreduce_fusion_max_tokens(sm, bs, tpb, 2048)
    for sm in (9, 10, 12) for bs in (None, 1, 8, 160, 1024) for tpb in (1, 4)
}

# 4. the fused RMSNorm's fallback: when nothing was fused it must still allreduce
import sglang.srt.distributed as sdist
from sglang.srt.layers.layernorm import RMSNorm
fcf.logger.addHandler(cap)
torch.manual_seed(0)
HID, TOK = 64, 3
x_mine, x_peer, res = torch.randn(TOK, HID), torch.randn(TOK, HID), torch.randn(TOK, HID)
allreduce_calls = []
def fake_all_reduce(t):  # plays the TP allreduce of two ranks: this rank's partial + the peer's
    allreduce_calls.append(tuple(t.shape))
    return t + x_peer
sdist.tensor_model_parallel_all_reduce = fake_all_reduce
for mod in (sdist, fcf):  # two TP ranks (0.5.10 asks the attention-TP group)
    for name, value in (("get_tensor_model_parallel_world_size", 2), ("get_attn_tensor_model_parallel_world_size", 2),
                        ("get_attn_tensor_model_parallel_rank", 0), ("get_moe_expert_parallel_world_size", 1),
                        ("get_moe_tensor_parallel_world_size", 2), ("get_moe_tensor_parallel_rank", 0)):
        if hasattr(mod, name):
            setattr(mod, name, lambda value=value: value)
fcf.is_flashinfer_available = lambda: True
if hasattr(fcf, "dist"):
    fcf.dist.get_rank = lambda group=None: 0
# The op is registered for CUDA only; register the same Python body (the real one,
# compiled from the patched source without its decorator) for CPU.
import ast as _ast
_tree = _ast.parse(open(fcf.__file__).read())
_fn = next(n for n in _tree.body if isinstance(n, _ast.FunctionDef) and n.name == "flashinfer_allreduce_residual_rmsnorm")
_fn.decorator_list = []
_ns = {}
exec(compile(_ast.Module(body=[_fn], type_ignores=[]), fcf.__file__, "exec"), fcf.__dict__, _ns)
_cpu_lib = torch.library.Library("sglang", "IMPL")
_cpu_lib.impl("flashinfer_allreduce_residual_rmsnorm", _ns["flashinfer_allreduce_residual_rmsnorm"], "CPU")
norm = RMSNorm(HID, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.rand(HID) + 0.5)
    ref_out, ref_res = norm.forward_native(x_mine + x_peer, res.clone())

def fallback(case):
    allreduce_calls.clear(); cap.records.clear()
    with torch.no_grad():
        o, r = norm.forward_with_allreduce_fusion(x_mine.clone(), res.clone())
    return {
        "out_ok": bool(torch.allclose(o, ref_out, atol=1e-5)),
        "res_ok": bool(torch.allclose(r, ref_res, atol=1e-5)),
        "allreduce_calls": len(allreduce_calls),
        "warnings": list(cap.records),
        "usable": fusion_usable(),
        "gate": comm.apply_flashinfer_allreduce_fusion(TOK),
    }

comm._is_sm120_supported = True
sa.set_global_server_args_for_scheduler(fresh(
    enable_flashinfer_allreduce_fusion=True, cuda_graph_max_bs=8,
    speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4))
set_comm(None)
out["fallback_no_comm"] = fallback("no_comm")
fake = FakeComm()
set_comm(fake)
fcf._workspace_manager = fcf.FlashInferWorkspaceManager()
with torch.no_grad():
    norm.forward_with_allreduce_fusion(x_mine.clone(), res.clone())
out["workspace_created"] = fake.created
fake = FakeComm(); fake.fail = True
set_comm(fake)
fcf._workspace_manager = fcf.FlashInferWorkspaceManager()
out["fallback_ws_fail"] = fallback("ws_fail")
out["fallback_ws_fail_again"] = fallback("ws_fail_again")
out["ws_attempts"] = len(fake.created)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(run_patched):
    code = CODE.replace("__VERSIONS__", repr(VERSIONS)).replace("__ARCHS__", repr(AUTO_ARCHS))
    proc = run_patched(code, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def _at_floor(v):
    from packaging.version import Version

    return v is not None and Version(v) >= Version(FLOOR)


def test_floor_is_the_first_flashinfer_with_sm12x_comm(result):
    assert result["floor"] == FLOOR


@pytest.mark.parametrize("sm", SMS)
def test_gate_full_matrix(result, sm):
    for v in VERSIONS:
        for req in (False, True):
            for p2p in (False, True):
                reason = result["gate"][f"{sm}|{v}|{req}|{p2p}"]
                if not req:
                    expected = False
                elif sm in (9, 10):
                    expected = True  # upstream behaviour: no version or P2P condition
                elif sm == 12:
                    expected = _at_floor(v) and p2p
                else:
                    expected = False
                assert (reason is None) == expected, (sm, v, req, p2p, reason)


def test_gate_reason_names_the_failed_condition(result):
    g = result["gate"]
    assert "enable-flashinfer-allreduce-fusion" in g["12|0.6.17|False|True"]
    for v in ("None", "0.6.3", "0.6.16", "0.6.16.post4"):
        reason = g[f"12|{v}|True|True"]
        assert FLOOR in reason and "flashinfer" in reason, reason
        assert "P2P" not in reason
    assert "P2P" in g["12|0.6.17|True|False"]
    assert "SM8" in g["8|0.6.17|True|True"] and "SM11" in g["11|0.10.0|True|True"]


def test_never_auto_enabled_on_sm120(result):
    for arch in AUTO_ARCHS:
        assert result["auto"][f"120|{arch}"] is False, arch


def test_auto_enable_unchanged_on_sm90_sm100(result):
    for sm in (90, 100):
        for arch in AUTO_ARCHS:
            assert result["auto"][f"{sm}|{arch}"] is True, (sm, arch)


def test_gate_runs_after_the_auto_enable(result):
    model_step, fusion_step = result["post_init_order"]
    assert 0 <= model_step < fusion_step


@pytest.mark.parametrize("version", VERSIONS)
def test_sm120_opt_in_matrix_through_server_args(result, version):
    for p2p in (False, True):
        for nnodes in (1, 2):
            r = result["optin"][f"{version}|{p2p}|{nnodes}"]
            expected = _at_floor(version) and p2p and nnodes == 1
            assert r["enabled"] is expected, (version, p2p, nnodes, r)
            # exactly one warning when refused, none when accepted
            assert len(r["warnings"]) == (0 if expected else 1), r["warnings"]
            if not expected:
                w = r["warnings"][0]
                assert "unfused" in w and FLOOR in w
                if not _at_floor(version):
                    assert f"installed: {version or 'not installed'}" in w
                else:
                    assert "P2P" in w


def test_sm120_p2p_probe_covers_every_pair_of_tp_gpus(result):
    pairs = result["optin"]["0.6.17|True|1"]["p2p_pairs"]
    assert sorted(map(tuple, pairs)) == sorted((i, j) for i in range(8) for j in range(8) if i != j)
    # multi-node TP has no P2P between all ranks: refused without probing
    assert result["optin"]["0.6.17|True|2"]["p2p_pairs"] == []


def test_p2p_probe_walks_base_gpu_id_by_gpu_id_step(result):
    ids = [2, 4, 6, 8]  # --base-gpu-id 2 --gpu-id-step 2, tp 4
    assert result["p2p_offset"] == {"enabled": True, "pairs": [[i, j] for i in ids for j in ids if i != j]}


def test_not_requested_is_silent(result):
    r = result["not_requested"]
    assert r == {"enabled": False, "warnings": [], "p2p_calls": 0}


def test_sm90_explicit_flag_keeps_upstream_behaviour(result):
    r = result["sm90_explicit"]
    assert r == {"enabled": True, "warnings": [], "p2p_calls": 0}


def test_runtime_check_accepts_sm120_only_with_the_flag(result):
    rt = result["runtime"]
    for bs in (1, 3, 8):
        assert rt[f"True|True|{bs}"] is True
        assert rt[f"True|False|{bs}"] is False
        assert rt[f"False|True|{bs}"] is False
    assert rt["True|True|4096"] is False  # FUSE_ALLREDUCE_MAX_BATCH_SIZE still applies


def test_sm120_fuses_only_captured_decode_and_verify_sizes(result):
    # cuda_graph_max_bs 8 without speculation: 8 tokens; prefill-sized forwards stay on NCCL
    assert result["runtime"]["True|True|8"] is True and result["runtime"]["True|True|9"] is False
    # EAGLE-3 with 4 draft tokens: verify of batch 8 = 32 tokens
    assert result["runtime_spec"] == {"1": True, "32": True, "33": False, "2048": False}
    assert result["runtime_spec_max"] == 32
    assert result["runtime_bs_list_max"] == 4  # an explicit --cuda-graph-bs list wins
    # the workspace is created for that size, not for 2048 tokens
    assert result["workspace_created"] == [{"world_size": 2, "max_token_num": 32, "hidden_dim": 64}]


def test_sm90_sm100_keep_2048_tokens(result):
    rt = result["runtime"]
    assert rt["False|True|9"] is False  # the simulated GPU is neither SM90 nor SM100 here
    mt = result["max_tokens"]
    for sm in (9, 10):
        assert {mt[f"{sm}|{bs}|{t}"] for bs in ("None", 1, 8, 160, 1024) for t in (1, 4)} == {2048}
    assert mt["12|8|1"] == 8 and mt["12|8|4"] == 32 and mt["12|160|4"] == 640
    assert mt["12|1024|4"] == 2048 and mt["12|None|1"] == 1


def test_gate_requires_flashinfer_comm(result):
    assert result["runtime_no_comm"] is False


@pytest.mark.parametrize("case", ["fallback_no_comm", "fallback_ws_fail"])
def test_unfused_fallback_still_allreduces(result, case):
    r = result[case]
    assert r["allreduce_calls"] == 1, r
    assert r["out_ok"] and r["res_ok"], r
    assert r["usable"] is False and r["gate"] is False


def test_workspace_failure_warns_once_and_is_not_retried(result):
    first, again = result["fallback_ws_fail"], result["fallback_ws_fail_again"]
    assert len(first["warnings"]) == 1, first["warnings"]
    assert "workspace" in first["warnings"][0] and "fusion" in first["warnings"][0].lower()
    assert again["warnings"] == [] and again["out_ok"]
    assert result["ws_attempts"] == 1


def test_version_is_checked_before_the_slow_p2p_probe(result):
    for v in VERSIONS:
        if not _at_floor(v):
            assert result["optin"][f"{v}|True|1"]["p2p_pairs"] == [], v
