"""P7 (0007) through SGLang 0.5.9's real patched ``GroupCoordinator("tp")`` and its real layer communicator: real forked ranks on a
real gloo group (world sizes 2, 3 and 4).

One subprocess imports the patched tree and runs every case; each case forks its ranks. Rank r's GroupCoordinator gets local_rank 3,
5, 6, 7, so its device is cuda:3, cuda:5, ...: a rule using the rank for the GPU id answers otherwise. Real: GroupCoordinator
(construction guard, the order with P5 and P2, dispatch, the ``outplace_all_reduce``/``inplace_all_reduce`` custom ops, graph_capture,
destroy), B12xAllReduce (agreement over the CPU group, P2P row, width, plans, prepare, serving, destroy, the decode/verify line), P5's
PcieIpcAllReduce where P7 is blocked, P2's CustomAllreduce constructor, CudaGraphRunner's ``get_batch_sizes_to_capture`` and __init__
from ``self.capture_bs = ...`` to ``serve_b12x_captured_graphs(self)``, compiled from the patched cuda_graph_runner.py; the layer
communicator's ``apply_flashinfer_allreduce_fusion``, ``LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer`` and
``CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual``, RMSNorm.forward_with_allreduce_fusion and the
``flashinfer_allreduce_residual_rmsnorm`` custom op (P1's fusion hook); ServerArgs' P1 gate.

Stand-ins, only for what needs CUDA or a GPU (a case's ``fail`` makes the marked ones raise):
* flashinfer's b12x (``b12x.comm.pcie``: OneshotAllReduce, query_from_runtime, plan; ``b12x.preparation``; cutlass's version check):
  records every call; the runtime's construction and close are collectives on the group (as b12x's: a failure raises on every
  rank); all_reduce returns a new tensor of 300 + rank, the fused op (400 + rank, 500 + rank); the session binds each plan's input.
* flashinfer's P5 workspace (as in test_p5_group_coordinator.py), the GPU P2P probe (a matrix by GPU id), the compute capability
  (SM120 unless a case says), the platform probes, CUDA tensors (``CudaLike``: data and aten ops on the CPU), torch.cuda's streams
  and capture state, P2's kernels and IPC buffers, NVML's NVLink answer (False).
On a rebased line's tree (not 0.5.9) it skips.
"""

from __future__ import annotations

import json

import pytest
from forked_ranks import CUDA_LIKE, RANK_RUNNER

CODE = r'''
import __future__, ast, contextlib, dataclasses, datetime, importlib, importlib.machinery, json, logging, os, sys, tempfile, types
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

H, TOKENS, DEVICES = 7168, 3, [3, 5, 6, 7]
CALLS, OPS, LOG, PROBES, CUR, CAPTURING, MATRIX, FAIL = [], [], [], [], [None], [False], [], {}
N = types.SimpleNamespace
def fail(why): raise RuntimeError(why)

''' + CUDA_LIKE + r'''def full(shape, value, dtype=torch.bfloat16):
    return CudaLike(torch.full(tuple(shape), value + dist.get_rank(), dtype=dtype))

# ---- flashinfer's b12x (the names P7 imports) ----
def collective_fail(what):  # b12x exchanges a setup failure: every rank raises together
    local = dist.get_rank() in FAIL.get(what, ())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if any(gathered): fail(f"{what} failed on ranks {[r for r, f in enumerate(gathered) if f]}")
class FakeRuntime:
    @classmethod
    def from_exchange_group(cls, exchange_group, device, eager_buffer_bytes, max_size, rank_data_bytes, stream_affine):
        CALLS.append(["runtime", str(device), eager_buffer_bytes, max_size, rank_data_bytes, stream_affine])
        collective_fail("runtime")
        rt = cls(); rt.group = exchange_group
        return rt
    def all_reduce(self, inp, plan):
        CALLS.append(["b12x", list(inp.shape), plan.surface, plan.rows])
        return full(inp.shape, 64.0)
    def all_reduce_fused_add_rms_norm(self, x, residual, weight, eps, plan):
        CALLS.append(["b12x_fused", list(x.shape), plan.surface, plan.rows, eps])
        return full(x.shape, 96.0), full(x.shape, 112.0)
    def close(self):
        dist.barrier(group=self.group); CALLS.append(["close"])  # collective, as b12x's coordinated close
class FakePlan:
    def __init__(self, query): self.surface, self.rows = query.surface, query.rows
    def request(self, name, prepare_call): return N(name=name, plan=self, prepare_call=prepare_call)
    def memory_requirements(self): return N(persistent=[N(required_nbytes=3 << 20), N(required_nbytes=1 << 19)])
def query_from_runtime(runtime, surface, call):
    assert list(call) == ["inp"] and call["inp"].shape[-1] == H and call["inp"].is_contiguous()
    return N(surface=surface.split(".")[1], rows=call["inp"].shape[0])
class FakeSession:
    def __init__(self, device, autotune, compile_workers):
        CALLS.append(["session", str(device), autotune, compile_workers])
    def prepare(self, requests):
        if dist.get_rank() in FAIL.get("compile", ()): fail("CuTe DSL: no kernel for sm_90a\nthe second line of the trace")
        for req in requests:
            state = N(bind_input=lambda inp, req=req: CALLS.append(["bind", req.plan.surface, req.plan.rows, list(inp.shape)]))
            call = req.prepare_call(state)
            assert call.run() is None  # no launch while preparing
        CALLS.append(["prepared", [r.name for r in requests]])
    def close(self): CALLS.append(["session_close"])
def require_cutlass_dsl():
    if dist.get_rank() in FAIL.get("cutlass", ()):
        raise ImportError("b12x requires nvidia-cutlass-dsl >= 4.6.0 (not installed)")
mods = {name: types.ModuleType(name) for name in ("b12x", "b12x._lib", "b12x._lib.gating", "b12x.comm", "b12x.comm.pcie", "b12x.preparation")}
for m in mods.values(): m.__path__ = []
mods["b12x._lib.gating"].require_cutlass_dsl = require_cutlass_dsl
mods["b12x.comm.pcie"].OneshotAllReduce, mods["b12x.comm.pcie"].plan = FakeRuntime, lambda query, runtime: FakePlan(query)
mods["b12x.comm.pcie"].query_from_runtime = query_from_runtime
mods["b12x.preparation"].PreparationSession, mods["b12x.preparation"].PreparedCall = FakeSession, lambda run: N(run=run)
B12X = mods

# ---- flashinfer's P5 workspace (where P7 is blocked, P5 is built as before) ----
class FakeWorkspace:
    def __init__(self, group, max_numel, dtype, tune_batches, tune_cache):
        self.group, self.world_size, self.max_numel, self.elem_size, self.max_blocks = group, dist.get_world_size(group), max_numel, 2, 36
        CALLS.append(["p5_init", max_numel, list(tune_batches)])
    def prepare(self, shapes, dtype): CALLS.append(["p5_prepare", len(shapes)]); return {s: "cfg" for s in shapes}
    def supports(self, inp): return True
    def rebind_stream(self): pass
    def all_reduce(self, inp): CALLS.append(["pcie_ipc", list(inp.shape)]); return full(inp.shape, 80.0)
    def destroy(self): dist.barrier(group=self.group); CALLS.append(["p5_destroy"])
fi, fcomm = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.comm")
fi.__path__ = fcomm.__path__ = []
fi.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)  # found, yet no CUDA: P1's op declines
far, ftun = types.ModuleType("flashinfer.comm.pcie_ipc_ar"), types.ModuleType("flashinfer.comm.pcie_ipc_tuning")
far.PcieIpcAllReduceWorkspace, far.get_pcie_ipc_comm_module = FakeWorkspace, lambda: N(workspace_size=lambda ws, numel, elem, blocks: 2 * ws * numel * elem)
ftun.default_cache_path = lambda ws: os.path.join(tempfile.gettempdir(), f"pcie_ipc_all_reduce_ws{ws}.json")
sys.modules.update({"flashinfer": fi, "flashinfer.comm": fcomm, "flashinfer.comm.pcie_ipc_ar": far, "flashinfer.comm.pcie_ipc_tuning": ftun})

import sglang.srt.distributed.parallel_state as ps  # noqa: E402
import sglang.srt.distributed.device_communicators.custom_all_reduce as car  # noqa: E402
import sglang.srt.distributed.device_communicators.custom_all_reduce_utils as caru  # noqa: E402
import sglang.srt.server_args as sa  # noqa: E402
import sglang.srt.layers.communicator as lcomm  # noqa: E402
import sglang.srt.layers.flashinfer_comm_fusion as fcf  # noqa: E402
from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402

CGR = os.path.join(os.path.dirname(ps.__file__), "..", "model_executor", "cuda_graph_runner.py")
WANT = {"require_gathered_buffer", "get_attention_tp_size", "get_attention_cp_size", "log_info_on_rank0", "serve_captured_graphs",
        "serve_b12x_captured_graphs"}

def cuda_graph_runner_code():
    tree = ast.parse(open(CGR).read())
    ns = {"logger": logging.getLogger("sglang.srt.model_executor.cuda_graph_runner")}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            ns.update({a.name: getattr(importlib.import_module(node.module), a.name) for a in node.names if a.name in WANT})
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_batch_sizes_to_capture")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CudaGraphRunner")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__").body
    i = next(k for k, s in enumerate(init) if isinstance(s, ast.Assign) and "self.capture_bs" in ast.unparse(s.targets[0]))
    j = next(k for k, s in enumerate(init) if ast.unparse(s).startswith("serve_b12x_captured_graphs("))
    hook = ast.parse("def capture_hook(self, model_runner): pass").body[0]
    hook.body = init[i : j + 1]
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn, hook], type_ignores=[])), CGR, "exec",
                 __future__.annotations.compiler_flag), ns)
    return ns, [ast.unparse(s).split("(")[0] for s in hook.body]

CGR_NS, HOOK = cuda_graph_runner_code()
for name in "pymscclpp pynccl pynccl_allocator torch_symm_mem hpu_communicator npu_communicator xpu_communicator shm_broadcast".split():
    importlib.import_module("sglang.srt.distributed.device_communicators." + name)
importlib.import_module("sglang.srt.layers.moe.utils")

class Stream:
    def __init__(self, sid): self.sid = sid
    def wait_stream(self, other): CALLS.append(["wait_stream", self.sid])
    def __eq__(self, other): return isinstance(other, Stream) and other.sid == self.sid
    def __ne__(self, other): return not self == other
class use_stream:
    def __init__(self, stream): self.stream = stream
    def __enter__(self): self.prev, CUR[0] = CUR[0], self.stream
    def __exit__(self, *exc): CUR[0] = self.prev
probe = lambda tag: lambda src, dst: PROBES.append([tag, src, dst]) or MATRIX[src][dst]
class FakeOps:
    IS_CUSTOM_AR_AVAILABLE = True
    def meta_size(self): return 4096
    def init_custom_ar(self, meta_ptrs, rank_data, rank, full_nvlink): CALLS.append(["init_custom_ar", rank]); return 1
    def register_buffer(self, ptr, ptrs): pass
class FakeCudaRT:
    def cudaMalloc(self, n): CALLS.append(["cudaMalloc"]); return N(value=0x1000)
    def cudaIpcGetMemHandle(self, p): return b"handle"
    def cudaIpcOpenMemHandle(self, h): return N(value=0x2000)
class CaStandIn:  # custom allreduce taking 3-row reductions (the real class: test_p2_pcie_custom_ar.py)
    disabled = False
    def should_custom_ar(self, inp): return inp.numel() <= 3 * H
    def custom_all_reduce(self, inp): CALLS.append(["ca", list(inp.shape)]); return full(inp.shape, 48.0)
    def capture(self): return contextlib.nullcontext()
class Capture(logging.Handler):
    def emit(self, record): LOG.append([record.levelname, record.name.rsplit(".", 1)[-1], record.getMessage()])
take = lambda: [LOG[:], LOG.clear()][0]
INPUTS = {"1": (1,), "3": (3,), "6": (6,), "17": (17,), "18": (18,), "19": (19,), "36": (36,), "37": (37,), "48": (48,), "49": (49,),
          "3d": (6, H, torch.bfloat16, False, True), "fp16": (3, H, torch.float16), "hidden4096": (3, 4096),
          "strided": (6, H, torch.bfloat16, True), "1d": (0,)}
def make(rows, hidden=H, dtype=torch.bfloat16, strided=False, three_d=False):
    v = dist.get_rank() + 1.0
    elem = torch.full((hidden, rows), v, dtype=dtype).t() if strided else torch.full((rows, hidden), v, dtype=dtype)
    if three_d: elem = elem.view(2, rows // 2, hidden)
    return CudaLike(elem if rows else torch.full((hidden,), v, dtype=dtype))
def val(y):  # the first element (a CudaLike's index would ask CUDA)
    return float((y.elem if isinstance(y, CudaLike) else y).flatten()[0])
def route(n):  # the calls a reduction made: which path served it
    calls = [c for c in CALLS[n:] if c[0] in ("b12x", "ca", "pcie_ipc", "b12x_fused")]
    return calls[0][0] if calls else "nccl"
def dispatch(g, names):
    out = {}
    for name in names:
        x, OPS[:], n = make(*INPUTS[name]), [], len(CALLS)
        y = g.all_reduce(x)
        out[name] = [route(n), [c[1:] for c in CALLS[n:] if c[0] == "b12x"], list(y.shape) == list(x.shape), val(y), OPS[:]]
    return out

def coordinator(rank, name, groups, use_ca=False):
    return ps.GroupCoordinator(group_ranks=groups, local_rank=DEVICES[rank], torch_distributed_backend="gloo", use_pynccl=False,
                               use_pymscclpp=False, use_custom_allreduce=use_ca, use_torch_symm_mem_all_reduce=False,
                               use_hpu_communicator=False, use_xpu_communicator=False, use_npu_communicator=False, group_name=name)

def install(case, rank):
    ps.is_cuda_alike, torch.cuda.device_count = lambda: True, lambda: 8
    torch.ones, torch.empty = on_cpu(torch.ones), on_cpu(torch.empty)
    torch.cuda.current_stream, torch.cuda.is_current_stream_capturing = lambda device=None: CUR[0], lambda: CAPTURING[0]
    torch.cuda.stream, ps.get_current_device_stream_fast = use_stream, lambda: CUR[0]
    sm = case.get("sm", {}).get(str(rank), (12, 0))
    torch.cuda.get_device_capability = lambda device=None: (CALLS.append(["capability", str(device)]), sm)[1]
    car.gpu_p2p_access_check = caru.gpu_p2p_access_check = probe("check")
    torch.cuda.can_device_access_peer = probe("driver")
    car._is_cuda, car.ops, car.CudaRTLibrary, car.is_full_nvlink = True, FakeOps(), FakeCudaRT, lambda ids, ws: False
    destroy_pg = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: (CALLS.append(["destroy_process_group"]), destroy_pg(group))[1]
    logging.getLogger("sglang").addHandler(Capture()); logging.getLogger("sglang").setLevel(logging.INFO)

@torch.no_grad()  # as serving runs (autograd would ask CUDA for a stream)
def fused_hook(tp, ws, rows, weight_dtype=torch.bfloat16):
    """The layer communicator's fusion hook for rows: the MoE's decision (should_fuse_mlp_allreduce_with_next_layer), the
    attention's (_gather_hidden_states_and_residual) and RMSNorm.forward_with_allreduce_fusion through P1's custom op."""
    lc = lcomm.LayerCommunicator.__new__(lcomm.LayerCommunicator)
    lc._speculative_algo, lc.is_last_layer, lc._context = None, False, N(tp_size=ws)
    mlp = lc.should_fuse_mlp_allreduce_with_next_layer(N(input_ids=torch.zeros(rows)))
    norm = RMSNorm(H).to(weight_dtype)
    x, res = full((rows, H), 1.0), full((rows, H), 2.0)
    OPS[:], n = [], len(CALLS)
    ctx = N(attn_dp_size=1, attn_tp_size=ws, attn_tp_rank=dist.get_rank(), cache=None)
    h, r = lcomm.CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual(
        x, res, None, norm, ctx, residual_input_mode=lcomm.ScatterMode.TP_ATTN_FULL)
    attn = [route(n), [c[1:] for c in CALLS[n:] if c[0] in ("b12x", "b12x_fused")], val(h), val(r), OPS[:]]
    OPS[:], n = [], len(CALLS)
    h, r = norm.forward_with_allreduce_fusion(x, res)  # the next layer's input norm, the MoE's allreduce skipped
    moe = [route(n), [c[1:] for c in CALLS[n:] if c[0] in ("b12x", "b12x_fused")], val(h), val(r), OPS[:]]
    return {"gate": lcomm.apply_flashinfer_allreduce_fusion(rows), "mlp": mlp, "attn": attn, "moe": moe}

def child(rank, port, outdir, case):
    try:
        run_case(rank, port, outdir, case)
    except BaseException:
        import traceback
        raise RuntimeError(traceback.format_exc()[-2500:])

def run_case(rank, port, outdir, case):
    ws = case["ws"]
    os.environ.update(dict(case["env"], **case.get("env_rank", {}).get(str(rank), {})))
    sys.modules.update(dict.fromkeys(B12X, None) if case.get("hide_b12x") else B12X)  # hidden: any import of b12x fails
    for name in case.get("no_module", {}).get(str(rank), ()): sys.modules[name] = None  # its import fails
    MATRIX[:], CUR[0] = case["matrix"], Stream(0); FAIL.update(case.get("fail", {}))
    install(case, rank)
    flags = case.get("flags_rank", {}).get(str(rank))
    if flags:
        sa.set_global_server_args_for_scheduler(N(**dict(dict(enable_deterministic_inference=False, disable_cuda_graph=False), **flags)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=10))
    whole, single = [list(range(ws))], [[r] for r in range(ws)]
    tp = coordinator(rank, "tp", whole, case.get("use_ca", False))
    comm = tp.b12x_comm
    res = {"b12x": comm and [comm.agreed, comm.disabled], "p5": tp.pcie_ipc_comm is not None and tp.pcie_ipc_comm.agreed,
           "ca": tp.ca_comm and [type(tp.ca_comm).__name__, tp.ca_comm.disabled], "p2_env": os.environ.get("SGLANG_ENABLE_PCIE_CUSTOM_AR"),
           "probes": PROBES[:], "build": [c for c in CALLS if c[0] != "capability"], "capability": [c for c in CALLS if c[0] == "capability"],
           "log_build": take()}
    if case.get("ca_standin"):  # built for real above; its kernels stood in from here
        tp.ca_comm = CaStandIn()
    if case.get("guard"):
        groups = [("attention_tp", whole), ("pp", whole), (None, whole), ("tp", single)]
        res["guard"] = {f"{n}/{len(g[0])}": coordinator(rank, n, g).b12x_comm is None for n, g in groups}
        res["log_guard"] = take()
    ps._TP, ps._ATTN_CP = tp, coordinator(rank, "attn_cp", single)
    take()
    args = N(cuda_graph_bs=[1, 2, 4, 8, 16, 32], enable_two_batch_overlap=False, enable_dp_attention=False, moe_dense_tp_size=None,
             enable_torch_compile=False, torch_compile_max_bs=32)
    mr = N(server_args=args, req_to_token_pool=N(size=case.get("pool", 6)), model_config=N(hidden_size=H))
    runner, n = N(model_runner=mr, num_tokens_per_bs=TOKENS), len(CALLS)
    CGR_NS["capture_hook"](runner, mr)
    res.update(capture_bs=runner.capture_bs, serve_calls=CALLS[n:], log_serve=take())
    names = case.get("eager", [])
    res["before_capture"] = dispatch(tp, names[:1])  # nothing prepared yet: today's path
    res["fused_before"] = fused_hook(tp, ws, 3)
    n = len(CALLS)
    with tp.graph_capture(stream=Stream(9)):
        CALLS.append(["body"]); CAPTURING[0] = True
        res["capture"] = dispatch(tp, case.get("captured", []))
        res["fused_capture"] = {rows: fused_hook(tp, ws, rows) for rows in case.get("fused", [])}
        CAPTURING[0] = False
    res["prepare_calls"] = CALLS[n:n + [c[0] for c in CALLS[n:]].index("body") + 1]
    res["log_capture"] = take()
    with tp.graph_capture(stream=Stream(9)):
        res["capture2"] = [c[0] for c in CALLS[n:]].count("prepared")  # a second capture prepares nothing more
    res["eager"] = dispatch(tp, names)
    res["fused"] = {rows: fused_hook(tp, ws, rows) for rows in case.get("fused", [])}
    res["fused_fp32_weight"] = fused_hook(tp, ws, 3, torch.float32)
    res["log_serving"] = take()
    n = len(CALLS); tp.destroy()
    res.update(destroy=[[c[0] for c in CALLS[n:]], tp.b12x_comm is None], log_rest=take())
    json.dump(res, open(os.path.join(outdir, f"{rank}.json"), "w"))
    dist.barrier()
    open(os.path.join(outdir, f"{rank}.done"), "w").write("ok")

def server_args_order():
    """P1's gate on a simulated SM120 with flashinfer 0.7.2: it yields to b12x (and to PCIe-IPC, as before)."""
    out = {}
    for b12x, ipc in ((False, False), (True, False), (False, True), (True, True)):
        out[f"{b12x}|{ipc}"] = sa.get_flashinfer_allreduce_fusion_blocker(12, "0.7.2", True, True, pcie_ipc_on=ipc, b12x_on=b12x)
    out["sm90"] = sa.get_flashinfer_allreduce_fusion_blocker(9, "0.7.2", True, True, b12x_on=True)
    obj = sa.ServerArgs.__new__(sa.ServerArgs)
    for f in dataclasses.fields(sa.ServerArgs):
        setattr(obj, f.name, f.default if f.default is not dataclasses.MISSING else
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    obj.tp_size, obj.enable_flashinfer_allreduce_fusion, sa.get_device_sm = 8, True, lambda: 120
    caru.gpu_p2p_access_check = lambda a, b: True
    import importlib.metadata as md
    version = md.version
    md.version = lambda name: "0.7.2" if name == "flashinfer-python" else version(name)
    os.environ["SGLANG_ENABLE_B12X_ALLREDUCE"] = "1"
    warnings = []
    handler = logging.Handler(); handler.emit = lambda record: warnings.append(record.getMessage())
    sa.logger.addHandler(handler)
    obj._handle_flashinfer_allreduce_fusion()
    os.environ.pop("SGLANG_ENABLE_B12X_ALLREDUCE")
    md.version = version
    out["server_args"] = [obj.enable_flashinfer_allreduce_fusion, warnings]
    return out

matrix = lambda ws, missing=(), full=False: [[full or s == d or (s in DEVICES[:ws] and d in DEVICES[:ws] and (s, d) not in missing)
                                             for d in range(8)] for s in range(8)]  # P2P among the group's GPUs only
ON = lambda **kw: dict(SGLANG_ENABLE_B12X_ALLREDUCE="1", **kw)
EAGER = ["1", "3", "17", "18", "19", "3d", "fp16", "hidden4096", "strided", "1d"]
CASES = {}
for ws in (2, 4):
    CASES[f"off{ws}"] = dict(ws=ws, matrix=matrix(ws), eager=["3", "18"], captured=["3"], fused=[3], env={}, hide_b12x=True)
    CASES[f"main{ws}"] = dict(ws=ws, matrix=matrix(ws), guard=True, eager=EAGER, captured=["3", "18", "19", "strided"], fused=[1, 3, 18, 19],
                              env=ON())
    CASES[f"p2p_missing{ws}"] = dict(ws=ws, matrix=matrix(ws, {(5, {2: 3, 4: 7}[ws])}), eager=["3"], fused=[3], env=ON())
CASES["wide4"] = dict(ws=4, matrix=matrix(4), pool=16, eager=["36", "37", "48", "49"], captured=["48", "49"], fused=[36, 37, 48], env=ON())
CASES["ws3"] = dict(ws=3, matrix=matrix(3), eager=["3"], env=ON())
for name, extra in {"sm90": dict(sm={"1": (9, 0)}), "sm100": dict(sm={"1": (10, 0)}), "sm121": dict(sm={"0": (12, 1), "1": (12, 1)}),
                    "no_b12x": dict(no_module={"1": ["b12x.comm.pcie"]}), "no_cutlass": dict(fail={"cutlass": [1]}),
                    "deterministic": dict(flags_rank={"1": dict(enable_deterministic_inference=True)}),
                    "no_graphs": dict(flags_rank={"1": dict(disable_cuda_graph=True)})}.items():
    CASES[f"{name}4"] = dict(ws=4, matrix=matrix(4), eager=["3"], fused=[3], env=ON(), **extra)
CASES["runtime_fails4"] = dict(ws=4, matrix=matrix(4), eager=["3"], fused=[3], fail={"runtime": [1]},
                               env=ON(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE="1"))
CASES["compile_fails4"] = dict(ws=4, matrix=matrix(4), eager=["3"], captured=["3"], fused=[3], fail={"compile": [2]}, env=ON())
CASES["with_p5_4"] = dict(ws=4, matrix=matrix(4), eager=["3"], fused=[3], env=ON(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE="1"))
CASES["blocked_p5_4"] = dict(CASES["with_p5_4"], sm={"2": (9, 0)})
CASES["p2_4"] = dict(ws=4, matrix=matrix(4), use_ca=True, eager=["3"], env=ON(SGLANG_ENABLE_PCIE_CUSTOM_AR="1"))
CASES["ca2"] = dict(ws=2, matrix=matrix(2, full=True), use_ca=True, eager=["3", "6"], ca_standin=True, env=ON())
out = {name: run_ranks(c["ws"], child, 40, c) for name, c in CASES.items()}
out["hook"], out["server_args"] = HOOK, server_args_order()
print("RESULT" + json.dumps(out))
'''

H, DEVICES = 7168, [3, 5, 6, 7]
ROWS = 18  # the clamped capture list [1, 2, 4, 6] x 3 tokens (--cuda-graph-bs 1..32, a pool of 6 requests)


@pytest.fixture(scope="module")
def result(run_patched, patched_tree):
    if "version = '0.5.9'" not in (patched_tree / "python" / "sglang" / "_version.py").read_text():
        pytest.skip("GroupCoordinator's, the runner's and the communicator's internals are 0.5.9's (the line the user runs)")
    assert (proc := run_patched(RANK_RUNNER + CODE, timeout=500)).returncode == 0, proc.stderr[-4000:]
    return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT") :])


def ranks(result, case):  # every rank of case finished and passed the barrier after it: no error, no hang
    assert (c := result[case])["blocked"] == 0, c
    for rank, r in c["ranks"].items():
        assert "error" not in r and r["in_step"], (case, rank, r)
    return [c["ranks"][str(k)] for k in range(len(c["ranks"]))]


decode_line = lambda path, ws: ["INFO", "pcie_ipc_allreduce", f"Decode/verify allreduce: {path} (world_size={ws})."]
on0 = lambda rank, *lines: list(lines) if rank == 0 else []
CAPTURE_LINE = ["INFO", "cuda_graph_runner", "Capture cuda graph bs [1, 2, 4, 6]"]
P2_PCIE_OFF = ["WARNING", "custom_all_reduce", "Custom allreduce is disabled because it's not supported on more than two PCIe-only "
               "GPUs. To silence this warning, specify disable_custom_all_reduce=True explicitly. To use it for small tensors "
               "only, set SGLANG_ENABLE_PCIE_CUSTOM_AR=1."]


def off_line(ws, why, lost=""):
    return ["WARNING", "b12x_allreduce", f"b12x one-shot allreduce is off on all {ws} ranks because {why}. Reductions take the next "
            f"path{lost}; unset SGLANG_ENABLE_B12X_ALLREDUCE to silence this warning."]


def size_line(ws, rows=ROWS, fused=ROWS):
    return ["INFO", "b12x_allreduce", f"b12x one-shot allreduce on {ws} GPUs: workspace 3.5 MiB per GPU, bf16 reductions up to {rows} "
            f"rows of {H} (widest captured reduction), fused add+RMSNorm up to {fused} rows; built at the first graph capture, nothing tuned."]


def b12x(rows, rank):  # a reduction served by b12x's plain one-shot, out of place: 64 + rank (exact in bf16)
    return ["b12x", [[[rows, H], "all_reduce", rows]], True, 64.0 + rank, [["outplace_all_reduce", "tp:0", "b12x"]]]


def nccl(ws):  # the next backend: in place over the gloo group, the ranks' 1..ws summed
    return ["nccl", [], True, ws * (ws + 1) / 2, [["inplace_all_reduce", "tp:0"]]]


FUSED_OPS = [["flashinfer_allreduce_residual_rmsnorm"]]


def fused(rows, rank):  # the fusion hook served by b12x's fused kernel: (96 + rank, 112 + rank)
    return ["b12x_fused", [[[rows, H], "all_reduce_fused_add_rms_norm", rows, 1e-06]], 96.0 + rank, 112.0 + rank, FUSED_OPS]


def test_off_by_default_is_todays_path_exactly(result):
    for ws in (2, 4):
        for rank, r in enumerate(ranks(result, f"off{ws}")):
            assert r["b12x"] is None and r["p5"] is False and r["capability"] == []  # b12x hidden: nothing imported it
            assert r["log_build"] == on0(rank, decode_line("NCCL", ws)) and r["log_serve"] == on0(rank, CAPTURE_LINE)  # P5's line, as before
            assert r["serve_calls"] == [] and r["prepare_calls"] == [["wait_stream", 9], ["body"]] and r["log_capture"] == []
            assert r["eager"] == {"3": nccl(ws), "18": nccl(ws)} and r["capture"] == {"3": nccl(ws)}
            for hook in (r["fused"]["3"], r["fused_capture"]["3"]):  # nothing fuses; the hook reaches P1's op, which declines: NCCL
                assert hook["gate"] is False and hook["mlp"] is False and hook["attn"][:2] == ["nccl", []]
                assert hook["moe"][:2] == ["nccl", []] and hook["moe"][4] == FUSED_OPS + [["inplace_all_reduce", "tp:0"]]
            assert r["log_serving"] == [] and r["log_rest"] == [] and r["destroy"] == [["destroy_process_group"] * 2, True]


@pytest.mark.parametrize("ws", [2, 4])
def test_every_rank_agrees_and_only_the_tp_group_builds_it(result, ws):
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        assert r["b12x"] == [True, True] and r["capability"] == [["capability", f"cuda:{DEVICES[rank]}"]]
        assert r["guard"] == dict.fromkeys([f"attention_tp/{ws}", f"pp/{ws}", f"None/{ws}", "tp/1"], True)
        assert r["probes"] == [["check", DEVICES[rank], d] for d in DEVICES[:ws] if d != DEVICES[rank]]  # by GPU id, not rank
        assert r["log_build"] == []  # agreed: the path is named once the first capture built (or failed) the kernels


@pytest.mark.parametrize("ws", [2, 4])
def test_sized_from_the_clamped_capture_list_and_built_without_a_launch_at_capture(result, ws):
    assert result["hook"] == ["self.capture_bs, self.compile_bs = get_batch_sizes_to_capture", "log_info_on_rank0",
                              "serve_captured_graphs", "serve_b12x_captured_graphs"]
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        assert r["capture_bs"] == [1, 2, 4, 6]  # 8..32 above the 6 requests dropped, 6 added
        nbytes = ROWS * H * 2  # the widest captured reduction, 18 rows of 7168 bf16
        assert r["serve_calls"] == [["runtime", f"cuda:{DEVICES[rank]}", nbytes, nbytes, 4096, False]]
        assert r["log_serve"] == on0(rank, CAPTURE_LINE, size_line(ws))
        names = [f"sglang:OneshotAllReduce.{s}:{n}" for s in ("all_reduce", "all_reduce_fused_add_rms_norm") for n in range(1, ROWS + 1)]
        binds = [["bind", s, n, [n, H]] for s in ("all_reduce", "all_reduce_fused_add_rms_norm") for n in range(1, ROWS + 1)]
        assert r["prepare_calls"] == [["wait_stream", 9], ["session", f"cuda:{DEVICES[rank]}", False, 0]] + binds + [["prepared", names], ["body"]]
        assert r["capture2"] == 1 and r["log_capture"] == on0(rank, decode_line("b12x one-shot", ws))


@pytest.mark.parametrize("ws", [2, 4])
def test_dispatch_serves_only_prepared_rows_in_and_out_of_capture(result, ws):
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        assert r["before_capture"] == {"1": nccl(ws)}  # served once the first capture prepared the plans
        assert r["eager"]["3d"] == ["b12x", [[[6, H], "all_reduce", 6]], True, 64.0 + rank, [["outplace_all_reduce", "tp:0", "b12x"]]]
        for rows in ("1", "3", "17", "18"):
            assert r["eager"][rows] == b12x(int(rows), rank), rows
        for name in ("19", "fp16", "hidden4096", "strided", "1d"):  # past the width, not bf16, other width, strided, 1-D
            assert r["eager"][name] == nccl(ws), name
        assert r["capture"] == {"3": b12x(3, rank), "18": b12x(18, rank), "19": nccl(ws), "strided": nccl(ws)}
        assert r["log_serving"] == []


@pytest.mark.parametrize("ws", [2, 4])
def test_the_layer_communicators_fusion_hook_fuses_the_prepared_rows(result, ws):
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        before = r["fused_before"]  # before the first capture: not fused, and the hook's P1 op is never reached
        assert before["gate"] is False and before["mlp"] is False and before["attn"][:2] == ["nccl", []]
        for where in ("fused", "fused_capture"):
            for rows in (1, 3, 18):
                hook = r[where][str(rows)]
                assert hook["gate"] is True and hook["mlp"] is True, (where, rows)
                assert hook["attn"] == hook["moe"] == fused(rows, rank), (where, rows)
            past = r[where]["19"]  # past the width: not fused; the MoE keeps its allreduce, the attention reduces unfused
            assert past["gate"] is False and past["mlp"] is False and past["attn"][:2] == ["nccl", []]
            # the hook called anyway: b12x declines, the norm reduces unfused (not P1's trtllm: its op returned at b12x's answer)
            assert past["moe"][:2] == ["nccl", []] and past["moe"][4] == FUSED_OPS + [["inplace_all_reduce", "tp:0"]]
        weight = r["fused_fp32_weight"]  # a weight b12x has no plan for: declined, reduced unfused through the plain route
        assert weight["gate"] is True and weight["moe"][:2] == ["b12x", [[[3, H], "all_reduce", 3]]]


def test_rows_past_36_are_not_fused(result):
    for rank, r in enumerate(ranks(result, "wide4")):
        assert r["capture_bs"] == [1, 2, 4, 8, 16] and r["log_serve"] == on0(rank, [
            "INFO", "cuda_graph_runner", "Capture cuda graph bs [1, 2, 4, 8, 16]"], size_line(4, 48, 36))
        assert r["eager"] == {"36": b12x(36, rank), "37": b12x(37, rank), "48": b12x(48, rank), "49": nccl(4)}
        assert r["capture"] == {"48": b12x(48, rank), "49": nccl(4)}
        for where in ("fused", "fused_capture"):
            assert r[where]["36"]["gate"] is True and r[where]["36"]["moe"] == fused(36, rank)
            for rows in ("37", "48"):  # b12x's fused kernel takes at most 36 rows: the plain one-shot, then the norm
                hook = r[where][rows]
                assert hook["gate"] is False and hook["mlp"] is False and hook["attn"][:2] == ["b12x", [[[int(rows), H], "all_reduce", int(rows)]]]


BLOCKERS = {
    "sm90": "rank 1: b12x's kernels are for SM120/SM121, this GPU is SM90",
    "sm100": "rank 1: b12x's kernels are for SM120/SM121, this GPU is SM100",
    "no_b12x": "rank 1: flashinfer's b12x does not import (ModuleNotFoundError: import of b12x.comm.pcie halted; None in sys.modules); "
               "flashinfer-python>=0.7.2 with nvidia-cutlass-dsl>=4.6 has it",
    "no_cutlass": "rank 1: flashinfer's b12x does not import (ImportError: b12x requires nvidia-cutlass-dsl >= 4.6.0 (not installed)); "
                  "flashinfer-python>=0.7.2 with nvidia-cutlass-dsl>=4.6 has it",
    "deterministic": "rank 1: --enable-deterministic-inference is on",
    "no_graphs": "rank 1: --disable-cuda-graph is on (it serves the captured decode/verify graphs)",
}


@pytest.mark.parametrize("case", sorted(BLOCKERS))
def test_a_blocker_on_one_rank_turns_it_off_on_every_rank_with_one_warning(result, case):
    for rank, r in enumerate(ranks(result, f"{case}4")):
        assert r["b12x"] == [False, True] and r["probes"] == []  # decided before any P2P probe or IPC handle
        assert r["log_build"] == [off_line(4, BLOCKERS[case])] + on0(rank, decode_line("NCCL", 4))
        assert r["serve_calls"] == [] and r["log_serve"] == on0(rank, CAPTURE_LINE) and r["log_capture"] == r["log_serving"] == []
        assert r["eager"] == {"3": nccl(4)} and r["fused"]["3"]["gate"] is False and r["fused"]["3"]["attn"][:2] == ["nccl", []]
        assert r["destroy"] == [["destroy_process_group"] * 2, True]


def test_sm121_is_admitted_and_other_world_sizes_are_not(result):
    for rank, r in enumerate(ranks(result, "sm1214")):
        assert r["b12x"] == [True, True] and r["log_capture"] == on0(rank, decode_line("b12x one-shot", 4))
    for rank, r in enumerate(ranks(result, "ws3")):
        assert r["b12x"] == [False, True] and r["log_build"] == [off_line(3, "rank 0: it supports (2, 4, 6, 8) ranks, not 3")] + on0(
            rank, decode_line("NCCL", 3))


@pytest.mark.parametrize("ws, pair", [(2, "5->3"), (4, "5->7")])
def test_one_missing_p2p_pair_turns_every_rank_off(result, ws, pair):
    for rank, r in enumerate(ranks(result, f"p2p_missing{ws}")):
        assert r["b12x"] == [False, True] and r["probes"] == [["check", DEVICES[rank], d] for d in DEVICES[:ws] if d != DEVICES[rank]]
        assert r["log_build"] == [off_line(ws, f"GPU P2P access is missing between GPUs {pair}")] + on0(rank, decode_line("NCCL", ws))
        assert r["serve_calls"] == [] and r["eager"] == {"3": nccl(ws)} and r["fused"]["3"]["gate"] is False


def test_a_runtime_failing_on_one_rank_is_off_on_all_naming_what_was_not_built(result):
    lost = " (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE's PCIe-IPC allreduce not built)"
    why = "rank 0: the runtime failed: RuntimeError: runtime failed on ranks [1]"  # b12x raises on every rank together
    for rank, r in enumerate(ranks(result, "runtime_fails4")):
        assert r["b12x"] == [True, True] and r["p5"] is False  # agreed at construction: P5 was not built
        assert r["log_build"] == on0(rank, ["WARNING", "b12x_allreduce", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 is ignored: "
                                             "SGLANG_ENABLE_B12X_ALLREDUCE=1 serves these reductions."])
        assert r["log_serve"] == on0(rank, CAPTURE_LINE) + [off_line(4, why, lost)] + on0(rank, decode_line("NCCL", 4))
        assert r["eager"] == {"3": nccl(4)} and r["destroy"] == [["destroy_process_group"] * 2, True]  # no runtime: nothing to close


def test_kernels_failing_to_build_on_one_rank_turn_it_off_on_all_and_close_the_runtime_together(result):
    why = "rank 2: its kernels did not build: RuntimeError: CuTe DSL: no kernel for sm_90a"  # the error's first line
    for rank, r in enumerate(ranks(result, "compile_fails4")):
        assert r["b12x"] == [True, True] and r["log_serve"] == on0(rank, CAPTURE_LINE, size_line(4))
        assert [c[0] for c in r["prepare_calls"]][-3:] == ["session_close", "close", "body"]  # closed on every rank, before the capture
        assert r["log_capture"] == [off_line(4, why)] + on0(rank, decode_line("NCCL", 4))
        assert r["capture"] == r["eager"] == {"3": nccl(4)} and r["fused"]["3"]["gate"] is False and r["fused"]["3"]["attn"][:2] == ["nccl", []]
        assert r["destroy"] == [["destroy_process_group"] * 2, True]


def test_b12x_wins_over_pcie_ipc_with_one_warning_and_pcie_ipc_stays_the_fallback_when_b12x_is_blocked(result):
    ignored = ["WARNING", "b12x_allreduce", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 is ignored: SGLANG_ENABLE_B12X_ALLREDUCE=1 serves these "
               "reductions."]
    for rank, r in enumerate(ranks(result, "with_p5_4")):
        assert r["b12x"] == [True, True] and r["p5"] is False and r["log_build"] == on0(rank, ignored)
        assert r["log_capture"] == on0(rank, decode_line("b12x one-shot", 4)) and r["eager"] == {"3": b12x(3, rank)}
        assert not any(c[0].startswith("p5_") for c in r["serve_calls"])
    for rank, r in enumerate(ranks(result, "blocked_p5_4")):
        assert r["b12x"] == [False, True] and r["p5"] is True  # P5 built as without P7's switch
        assert r["log_build"] == [off_line(4, "rank 2: b12x's kernels are for SM120/SM121, this GPU is SM90")]
        assert [c[0] for c in r["serve_calls"]] == ["p5_init"] and r["log_serve"][-1:] == on0(rank, decode_line("PCIe-IPC", 4))
        assert r["eager"]["3"][0] == "pcie_ipc" and r["fused"]["3"]["gate"] is False


def test_p1_yields_to_b12x_on_sm120(result):
    sa = result["server_args"]
    b12x_why = "SGLANG_ENABLE_B12X_ALLREDUCE=1 hands the decode/verify allreduce+RMSNorm to b12x's one-shot kernels on SM120"
    assert sa["False|False"] is None and sa["True|False"] == sa["True|True"] == b12x_why and sa["sm90"] is None
    assert sa["False|True"].startswith("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1")
    enabled, warnings = sa["server_args"]
    assert enabled is False and len(warnings) == 1 and warnings[0].startswith(f"FlashInfer allreduce fusion is disabled because {b12x_why}.")


def test_p2_is_not_built_when_b12x_is_agreed_and_the_switch_comes_back(result):
    for rank, r in enumerate(ranks(result, "p2_4")):
        assert r["b12x"] == [True, True] and r["ca"] == ["CustomAllreduce", True] and r["p2_env"] == "1"
        assert not any(c[0] in ("cudaMalloc", "init_custom_ar") for c in r["build"])  # no IPC buffer, no kernel
        assert r["log_build"] == on0(rank, ["WARNING", "b12x_allreduce", "SGLANG_ENABLE_PCIE_CUSTOM_AR=1 is ignored: "
                                            "SGLANG_ENABLE_B12X_ALLREDUCE=1 serves these reductions."]) + [P2_PCIE_OFF]


def test_custom_allreduce_first_for_the_plain_reductions_at_two_ranks_and_the_line_says_so(result):
    for rank, r in enumerate(ranks(result, "ca2")):
        assert r["ca"] == ["CustomAllreduce", False]  # two GPUs: upstream's custom allreduce, as without P7
        assert r["log_capture"] == on0(rank, decode_line("b12x one-shot (custom allreduce first)", 2))
        assert r["eager"]["3"][:4] == ["ca", [], True, 48.0 + rank] and r["eager"]["6"] == b12x(6, rank)


@pytest.mark.parametrize("case", ["main2", "main4", "with_p5_4", "wide4"])
def test_destroy_closes_the_session_and_the_runtime_before_the_groups_go(result, case):
    for r in ranks(result, case):
        assert r["destroy"] == [["session_close", "close"] + ["destroy_process_group"] * 2, True] and r["log_rest"] == []
