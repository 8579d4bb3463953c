"""P5 (0005) through SGLang 0.5.9's real patched ``GroupCoordinator("tp")``: real forked ranks on a real gloo group.

One subprocess imports the patched tree and runs every case; each case forks its ranks (2 or 4). Rank r's GroupCoordinator gets
local_rank 3, 5, 6, 7, so its device is cuda:3, cuda:5, ...: a rule using the rank for the GPU id answers otherwise. Real:
GroupCoordinator (construction guard, P2 switched off, dispatch, the ``outplace_all_reduce``/``inplace_all_reduce`` custom ops down to
``_all_reduce_out_place``/``_in_place``, whose reduction runs on the gloo device group, graph_capture, destroy), PcieIpcAllReduce
(agreement over the CPU group, P2P row, width, tune policy, prepare, serving, destroy, the decode/verify line), P2's CustomAllreduce
constructor, and CudaGraphRunner's ``get_batch_sizes_to_capture`` and __init__ from ``self.capture_bs = ...`` to
``serve_captured_graphs(self)``, compiled from the patched cuda_graph_runner.py.

Stand-ins, only for what needs CUDA or a GPU (a case's ``fail`` makes the marked ones raise):
* flashinfer's ``PcieIpcAllReduceWorkspace`` (CUDA IPC memory, kernels): records every call (marked: its constructor raises on the
  case's ranks); all_reduce returns a new tensor of 100 + rank; destroy is a barrier on its group (as flashinfer's, collective); prepare
  resolves every bucket but 12 rows; ``workspace_size`` a formula; a tmp cache folder.
* the GPU P2P probe (``gpu_p2p_access_check``, the driver's ``can_device_access_peer``): a matrix by GPU id; the platform probes
  (``is_cuda_alike``, custom_all_reduce's ``_is_cuda``, ``device_count``): CUDA, 8 GPUs.
* CUDA tensors: ``CudaLike``, a tensor on cuda:N whose data and aten ops are on the CPU; SGLang's custom ops (CUDA only) run their CUDA
  kernel, the real Python function; ``torch.ones``/``torch.empty`` on a CUDA device return one.
* torch.cuda's streams and capture state; P2's kernels and IPC buffers (sgl_kernel ops, the CUDA runtime: marked, its cudaMalloc raises
  on every rank), NVML's NVLink answer (False: PCIe only).
* in the dispatch cases, a custom allreduce taking 3-row reductions (the real class: test_p2_pcie_custom_ar.py);
  ``destroy_process_group`` is observed (recorded, then called). On a rebased line's tree (not 0.5.9) it skips.
"""

from __future__ import annotations

import json

import pytest
from forked_ranks import CUDA_LIKE, RANK_RUNNER

CODE = r'''
import __future__, ast, contextlib, datetime, hashlib, importlib, importlib.metadata, json, logging, os, sys, tempfile, types
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

H, TOKENS, UNRESOLVED = 7168, 3, 12  # hidden; EAGLE tokens per request; the bucket flashinfer resolves to no config
DEVICES = [3, 5, 6, 7]
CALLS, OPS, LOG, PROBES, CUR, CAPTURING, MATRIX, FAIL = [], [], [], [], [None], [False], [], {}  # FAIL: the case's failing stand-ins
N = types.SimpleNamespace
def fail(why): raise RuntimeError(why)

''' + CUDA_LIKE + r'''def result(value, inp, tag):
    out = CudaLike(torch.full(tuple(inp.shape), value + dist.get_rank(), dtype=inp.dtype))  # exact in bf16
    CALLS.append([tag, list(inp.shape), id(out)])
    return out

class FakeWorkspace:
    def __init__(self, group, max_numel, dtype, tune_batches, tune_cache):
        if dist.get_rank() in FAIL.get("workspace", ()): fail("no IPC memory")  # before any call recorded
        self.group, self.world_size, self.max_numel, self.elem_size, self.max_blocks = group, dist.get_world_size(group), max_numel, 2, 36
        self.profile, self.memop_supported = "rootcplx", False
        CALLS.append(["init", max_numel, str(dtype), list(tune_batches), tune_cache])
        if os.path.isfile(tune_cache): LOADED.extend(json.load(open(tune_cache)))  # flashinfer loads the cache at its build
    def prepare(self, shapes, dtype):
        CALLS.append(["prepare", [list(s) for s in shapes], str(dtype)])
        return {s: (None if s[0] == UNRESOLVED else f"cfg{s[0]}") for s in shapes}
    def supports(self, inp): return True
    def rebind_stream(self): CALLS.append(["rebind", CUR[0].sid])
    def all_reduce(self, inp): return result(100.0, inp, "pcie_ipc")
    def destroy(self): dist.barrier(group=self.group); CALLS.append(["destroy"])  # collective, as flashinfer's

fi, fcomm = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.comm")
fi.__path__ = fcomm.__path__ = []
far, ftun = types.ModuleType("flashinfer.comm.pcie_ipc_ar"), types.ModuleType("flashinfer.comm.pcie_ipc_tuning")
far.PcieIpcAllReduceWorkspace, far.get_pcie_ipc_comm_module = FakeWorkspace, lambda: N(workspace_size=lambda ws, numel, elem, blocks: 2 * ws * numel * elem + 4096 * blocks)
ftun.default_cache_path = lambda ws: os.path.join(os.environ["FI_DIR"], f"pcie_ipc_all_reduce_ws{ws}.json")
LOADED = []  # the entries flashinfer loaded: a key holds (tune version, world size, profile, max_blocks, max_numel, dtype)
ftun.cache_covers_workspace = lambda ws, profile, blocks, numel, memop=False: any(
    repr((3, ws, profile, blocks, numel))[:-1] + ", " in key for key in LOADED)
sys.modules.update({"flashinfer": fi, "flashinfer.comm": fcomm, "flashinfer.comm.pcie_ipc_ar": far, "flashinfer.comm.pcie_ipc_tuning": ftun})

import sglang.srt.distributed.parallel_state as ps  # noqa: E402
import sglang.srt.distributed.device_communicators.custom_all_reduce as car  # noqa: E402
import sglang.srt.distributed.device_communicators.custom_all_reduce_utils as caru  # noqa: E402

CGR = os.path.join(os.path.dirname(ps.__file__), "..", "model_executor", "cuda_graph_runner.py")
WANT = {"require_gathered_buffer", "get_attention_tp_size", "get_attention_cp_size", "log_info_on_rank0", "serve_captured_graphs"}

def cuda_graph_runner_code():
    tree = ast.parse(open(CGR).read())
    ns = {"logger": logging.getLogger("sglang.srt.model_executor.cuda_graph_runner")}
    for node in tree.body:  # the module's own imports of the names this code uses
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            ns.update({a.name: getattr(importlib.import_module(node.module), a.name) for a in node.names if a.name in WANT})
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_batch_sizes_to_capture")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CudaGraphRunner")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__").body
    i = next(k for k, s in enumerate(init) if isinstance(s, ast.Assign) and "self.capture_bs" in ast.unparse(s.targets[0]))
    j = next(k for k, s in enumerate(init) if ast.unparse(s).startswith("serve_captured_graphs("))
    hook = ast.parse("def capture_hook(self, model_runner): pass").body[0]
    hook.body = init[i : j + 1]
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn, hook], type_ignores=[])), CGR, "exec",
                 __future__.annotations.compiler_flag), ns)  # its hints name types it imports only for type checking
    return ns, [ast.unparse(s).split("(")[0] for s in hook.body]

CGR_NS, HOOK = cuda_graph_runner_code()
for name in "pymscclpp pynccl pynccl_allocator torch_symm_mem hpu_communicator npu_communicator xpu_communicator shm_broadcast".split():
    importlib.import_module("sglang.srt.distributed.device_communicators." + name)  # here once, not by every forked rank
importlib.import_module("sglang.srt.layers.moe.utils")
FI_VERSION = next((d.version for d in importlib.metadata.distributions(name="flashinfer-python")), None)

class Stream:
    def __init__(self, sid): self.sid = sid
    def wait_stream(self, other): CALLS.append(["wait_stream", self.sid, other.sid])
    def __eq__(self, other): return isinstance(other, Stream) and other.sid == self.sid
    def __ne__(self, other): return not self == other
class use_stream:  # torch.cuda.stream(stream)
    def __init__(self, stream): self.stream = stream
    def __enter__(self): self.prev, CUR[0] = CUR[0], self.stream
    def __exit__(self, *exc): CUR[0] = self.prev
probe = lambda tag: lambda src, dst: PROBES.append([tag, src, dst]) or MATRIX[src][dst]
class FakeOps:
    IS_CUSTOM_AR_AVAILABLE = True
    def meta_size(self): return 4096
    def init_custom_ar(self, meta_ptrs, rank_data, rank, full_nvlink): CALLS.append(["init_custom_ar", rank, full_nvlink]); return 1
    def register_buffer(self, ptr, ptrs): CALLS.append(["register_buffer"])
class FakeCudaRT:
    def cudaMalloc(self, n): CALLS.append(["cudaMalloc", n]); return N(value=0x1000) if not FAIL.get("malloc") else fail("out of memory")
    def cudaIpcGetMemHandle(self, p): return b"handle"
    def cudaIpcOpenMemHandle(self, h): return N(value=0x2000)
class CaStandIn:
    disabled = False
    def should_custom_ar(self, inp): return inp.numel() <= 3 * H
    def custom_all_reduce(self, inp): return result(200.0, inp, "ca")
    def capture(self): return contextlib.nullcontext()
class Capture(logging.Handler):
    def emit(self, record): LOG.append([record.levelname, record.name.rsplit(".", 1)[-1], record.getMessage()])
take = lambda: [LOG[:], LOG.clear()][0]
INPUTS = {"3": (3,), "6": (6,), "7": (7,), "12": (12,), "18": (18,), "19": (19,), "fp16": (3, H, torch.float16),
          "fp32": (3, H, torch.float32), "hidden4096": (3, 4096), "strided": (6, H, torch.bfloat16, True), "1d": (0,)}
def make(rows, hidden=H, dtype=torch.bfloat16, strided=False):
    v = dist.get_rank() + 1.0
    elem = torch.full((hidden, rows), v, dtype=dtype).t() if strided else torch.full((rows, hidden), v, dtype=dtype)
    return CudaLike(elem if rows else torch.full((hidden,), v, dtype=dtype))
def dispatch(g, names):
    out = {}
    for name in names:
        x, OPS[:], n = make(*INPUTS[name]), [], len(CALLS)
        y = g.all_reduce(x)
        got = "input" if y is x else "result" if CALLS[n:] and CALLS[-1][-1] == id(y) else "other"
        out[name] = [OPS[:], [c[:2] for c in CALLS[n:]], got, list(y.shape) == list(x.shape), float(y.elem.flatten()[0])]
    return out

def coordinator(rank, name, groups, use_ca=False):
    return ps.GroupCoordinator(group_ranks=groups, local_rank=DEVICES[rank], torch_distributed_backend="gloo", use_pynccl=False,
                               use_pymscclpp=False, use_custom_allreduce=use_ca, use_torch_symm_mem_all_reduce=False,
                               use_hpu_communicator=False, use_xpu_communicator=False, use_npu_communicator=False, group_name=name)

def install():
    ps.is_cuda_alike, torch.cuda.device_count = lambda: True, lambda: 8
    torch.ones, torch.empty = on_cpu(torch.ones), on_cpu(torch.empty)
    torch.cuda.current_stream, torch.cuda.is_current_stream_capturing = lambda device=None: CUR[0], lambda: CAPTURING[0]
    torch.cuda.stream, ps.get_current_device_stream_fast = use_stream, lambda: CUR[0]
    car.gpu_p2p_access_check = caru.gpu_p2p_access_check = probe("check")
    torch.cuda.can_device_access_peer = probe("driver")
    car._is_cuda, car.ops, car.CudaRTLibrary, car.is_full_nvlink = True, FakeOps(), FakeCudaRT, lambda ids, ws: False
    destroy_pg = dist.destroy_process_group  # observed: when the groups go
    dist.destroy_process_group = lambda group=None: (CALLS.append(["destroy_process_group"]), destroy_pg(group))[1]
    logging.getLogger("sglang").addHandler(Capture()); logging.getLogger("sglang").setLevel(logging.INFO)

def child(rank, port, outdir, case):
    ws = case["ws"]
    os.environ.update(dict(case["env"], **case.get("env_rank", {}).get(str(rank), {})))
    if rank in case.get("no_flashinfer", ()): sys.modules["flashinfer.comm.pcie_ipc_ar"] = None  # its import fails
    MATRIX[:], CUR[0] = case["matrix"], Stream(0); FAIL.update(case.get("fail", {}))
    install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=10))
    whole, single = [list(range(ws))], [[r] for r in range(ws)]
    tp = coordinator(rank, "tp", whole, case.get("use_ca", False))
    comm, ca = tp.pcie_ipc_comm, tp.ca_comm
    res = {"tp": [tp.device.index, comm and comm.agreed, comm and comm.disabled], "ca": ca and [type(ca).__name__, ca.disabled],
           "p2_env": os.environ.get("SGLANG_ENABLE_PCIE_CUSTOM_AR"), "probes": PROBES[:], "build": CALLS[:], "log_build": take()}
    if case.get("guard"):
        groups = [("attention_tp", whole), ("pp", whole), (None, whole), ("tp", single)]
        res["guard"] = {f"{n}/{len(g[0])}": coordinator(rank, n, g).pcie_ipc_comm is None for n, g in groups}
        os.environ["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] = "0"
        res["guard"]["tp/env off"] = coordinator(rank, "tp", whole).pcie_ipc_comm is None
        os.environ["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] = "1"
        res["log_guard"] = take()
    ps._TP, ps._ATTN_CP = tp, coordinator(rank, "attn_cp", single)  # as initialize_model_parallel sets them (cp size 1)
    args = N(cuda_graph_bs=[1, 2, 4, 8, 16, 32], enable_two_batch_overlap=False, enable_dp_attention=False, moe_dense_tp_size=None,
             enable_torch_compile=False, torch_compile_max_bs=32)
    mr = N(server_args=args, req_to_token_pool=N(size=6), model_config=N(hidden_size=H))
    runner, n = N(model_runner=mr, num_tokens_per_bs=TOKENS), len(CALLS)
    CGR_NS["capture_hook"](runner, mr)
    res.update(capture_bs=runner.capture_bs,
               served=comm and [comm.disabled, comm.max_numel, comm.hidden, list(comm.buckets), comm.tune_cache],
               serve_calls=CALLS[n:], log_serve=take())
    if case.get("eager"):
        res["eager"] = dispatch(tp, case["eager"])
        tp.ca_comm = CaStandIn(); res["eager_ca"] = dispatch(tp, ["3", "6"])
        tp.ca_comm, n = ca, len(CALLS)
        with tp.graph_capture(stream=Stream(9)):
            CALLS.append(["body"]); CAPTURING[0] = True
            res["capture"] = dispatch(tp, case["captured"])
            CAPTURING[0] = False
        with tp.graph_capture(stream=Stream(9)):
            res["capture2"] = dispatch(tp, ["3"])
        res["eager_after"] = dispatch(tp, ["3"])
        res["capture_calls"] = [c[:2] for c in CALLS[n:]]
    n = len(CALLS); tp.destroy()
    res.update(destroy=[CALLS[n:], tp.pcie_ipc_comm is None], log_rest=take())
    json.dump(res, open(os.path.join(outdir, f"{rank}.json"), "w"))
    dist.barrier()
    open(os.path.join(outdir, f"{rank}.done"), "w").write("ok")

matrix = lambda ws, missing=(), full=False: [[full or s == d or (s in DEVICES[:ws] and d in DEVICES[:ws] and (s, d) not in missing)
                                             for d in range(8)] for s in range(8)]  # P2P among the group's GPUs only: 0..2 reach nothing
def cache_dir(ws=None, rows=(3, 6, 12, 18), replaced=False):
    d = tempfile.mkdtemp()
    if ws:  # a tuned cache (flashinfer's entries for its workspace) and the key it was made for
        path = os.path.join(d, f"sglang_pcie_ipc_ws{ws}.json")
        cache = json.dumps({str(("op", "runner", ((r, H),), (3, ws, "rootcplx", 36, rows[-1] * H, "torch.bfloat16"))): 0
                            for r in rows}).encode()
        open(path, "wb").write(b'{"tuned": "by another step"}' if replaced else cache)
        json.dump({"world_size": ws, "hidden": H, "max_numel": rows[-1] * H, "buckets": list(rows), "flashinfer": FI_VERSION,
                   "cache_sha256": hashlib.sha256(cache).hexdigest()}, open(path + ".key", "w"))  # the key names its cache
    return d
ON = lambda **kw: dict(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE="1", FI_DIR=cache_dir(), **kw)
EAGER = ["3", "6", "7", "12", "18", "19", "fp16", "fp32", "hidden4096", "strided", "1d"]
CASES = {}
for ws in (2, 4):
    CASES[f"main{ws}"] = dict(ws=ws, matrix=matrix(ws), guard=True, eager=EAGER, captured=["3", "6", "7", "12", "18", "strided", "19"], env=ON())
    CASES[f"p2_{ws}"] = dict(ws=ws, matrix=matrix(ws, full=ws == 2), use_ca=True, env=ON(SGLANG_ENABLE_PCIE_CUSTOM_AR="1"))
    CASES[f"p2p_missing{ws}"] = dict(ws=ws, matrix=matrix(ws, {(5, {2: 3, 4: 7}[ws])}), eager=["3"], captured=["3"], env=ON())
CASES["p2p_missing_driver4"] = dict(CASES["p2p_missing4"], env=ON(SGLANG_SKIP_P2P_CHECK="1"))
CASES["p2_blocked4"] = dict(ws=4, matrix=matrix(4, full=True), use_ca=True, no_flashinfer=[2], env=ON(SGLANG_ENABLE_PCIE_CUSTOM_AR="1"))
CASES["tune_one_rank4"] = dict(ws=4, matrix=matrix(4), env=ON(), env_rank={"1": dict(SGLANG_PCIE_IPC_TUNE="cache", FI_DIR=cache_dir(4))})
CASES["tune_unknown4"] = dict(ws=4, matrix=matrix(4), env=ON(), env_rank={"2": dict(SGLANG_PCIE_IPC_TUNE="fast")})
CASES["tune_other_key4"] = dict(ws=4, matrix=matrix(4), env=dict(ON(SGLANG_PCIE_IPC_TUNE="cache"), FI_DIR=cache_dir(4, (3, 6, 12, 24))))
CASES["tune_match2"] = dict(ws=2, matrix=matrix(2), env=dict(ON(SGLANG_PCIE_IPC_TUNE="cache"), FI_DIR=cache_dir(2)))
# every rank asks for the cache, but it appeared, or was replaced, between the ranks' checks: the same policy, other states
CASES["tune_race4"] = dict(ws=4, matrix=matrix(4), env=dict(ON(SGLANG_PCIE_IPC_TUNE="cache"), FI_DIR=cache_dir(4)),
                           env_rank={"2": dict(FI_DIR=cache_dir(4, replaced=True)), "3": dict(FI_DIR=cache_dir())})
# P2-only users: P5's switch unset, P2's on at TP 4: custom allreduce built as before, not a word about P5
CASES["p2_only4"] = dict(ws=4, matrix=matrix(4, full=True), use_ca=True,
                         env=dict(SGLANG_ENABLE_PCIE_CUSTOM_AR="1", FI_DIR=cache_dir()))
CASES["numel_rounded2"] = dict(ws=2, matrix=matrix(2), eager=["18", "19"], captured=["19"], env=ON(SGLANG_PCIE_IPC_MAX_NUMEL=str(7169 * 20)))
BELOW = dict(ws=4, matrix=matrix(4), eager=["3"], captured=["3"], env_rank={"2": dict(SGLANG_PCIE_IPC_MAX_NUMEL="7000")})  # serve() fails
CASES["numel_below_row4"] = dict(BELOW, env=ON())
CASES["serve_fails_numel4"] = dict(BELOW, use_ca=True, env=ON(SGLANG_ENABLE_PCIE_CUSTOM_AR="1"))  # agreed with P2's switch on
CASES["serve_fails_workspace4"] = dict(CASES["serve_fails_numel4"], env_rank={}, fail={"workspace": [1]})
CASES["ca_raises2"] = dict(CASES["p2_2"], fail={"malloc": True})  # P2's cudaMalloc raises on every rank
CASES["ca_raises_unset2"] = dict(CASES["ca_raises2"], env=ON())  # SGLANG_ENABLE_PCIE_CUSTOM_AR unset
out = {name: run_ranks(c["ws"], child, 30, c) for name, c in CASES.items()}
out["hook"], out["fi_version"], out["fi_dirs"] = HOOK, FI_VERSION, {name: c["env"]["FI_DIR"] for name, c in CASES.items()}
print("RESULT" + json.dumps(out))
'''

H, ROWS, NUMEL, DEVICES, DEVNULL = 7168, [3, 6, 12, 18], 18 * 7168, [3, 5, 6, 7], "/dev/null"


@pytest.fixture(scope="module")
def result(run_patched, patched_tree):
    if "version = '0.5.9'" not in (patched_tree / "python" / "sglang" / "_version.py").read_text():
        pytest.skip("GroupCoordinator's, the runner's and P2's internals are 0.5.9's (the line the user runs)")
    assert (proc := run_patched(RANK_RUNNER + CODE, timeout=400)).returncode == 0, proc.stderr[-4000:]
    return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT") :])


def ranks(result, case):  # every rank of case finished and passed the barrier after it: no error, no hang
    assert (c := result[case])["blocked"] == 0, c
    for rank, r in c["ranks"].items():
        assert "error" not in r and r["in_step"], (case, rank, r)
    return [c["ranks"][str(k)] for k in range(len(c["ranks"]))]


decode_line = lambda path, ws: ["INFO", "pcie_ipc_allreduce", f"Decode/verify allreduce: {path} (world_size={ws})."]
on0 = lambda rank, *lines: list(lines) if rank == 0 else []  # rank 0's lines
LOST = " (SGLANG_ENABLE_PCIE_CUSTOM_AR's custom allreduce was not built)"
off_line = lambda ws, why, lost="": ["WARNING", "pcie_ipc_allreduce", f"PCIe-IPC allreduce is off on all {ws} ranks because {why}. Reductions "
                                     f"stay on custom allreduce/NCCL{lost}; unset SGLANG_ENABLE_PCIE_IPC_ALLREDUCE to silence this warning."]
BELOW_ROW = "rank 2: SGLANG_PCIE_IPC_MAX_NUMEL=7000 is below one row of 7168; unset it or set it to at least 7168"
# A reduction left to the next backend: in place over the group (gloo here), the input summed over the ranks' 1..ws
nccl = lambda ws: [[["inplace_all_reduce", "tp:0"]], [], "input", True, ws * (ws + 1) / 2]
p2_built = lambda rank, nvlink: [["cudaMalloc", 4096 + 8192 * 1024], ["cudaMalloc", 8192 * 1024], ["init_custom_ar", rank, nvlink],
                                 ["register_buffer"]]  # P2's IPC buffers and kernel
CAPTURE_LINE = ["INFO", "cuda_graph_runner", "Capture cuda graph bs [1, 2, 4, 6]"]
P2_PCIE_OFF = ["WARNING", "custom_all_reduce", "Custom allreduce is disabled because it's not supported on more than two PCIe-only "
               "GPUs. To silence this warning, specify disable_custom_all_reduce=True explicitly. To use it for small tensors "
               "only, set SGLANG_ENABLE_PCIE_CUSTOM_AR=1."]
P2_IGNORED = ["WARNING", "pcie_ipc_allreduce", "SGLANG_ENABLE_PCIE_CUSTOM_AR=1 is ignored: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 serves "
              "these reductions."]


def serving_line(ws, numel=NUMEL, buckets=ROWS, why="widest captured reduction 18 rows", policy="seed", extra=""):
    mib = (2 * ws * numel * 2 + 4096 * 36) / (1 << 20)  # the stand-in's workspace_size
    step = (f"python -m sglang.srt.pcie_ipc_tune --tp {ws} --hidden {H} "
            f"--rows {','.join(map(str, buckets))}{extra} --pin-clocks MHZ")
    return ["INFO", "pcie_ipc_allreduce", f"PCIe-IPC allreduce on {ws} GPUs: workspace {mib:.1f} MiB per GPU, bf16 reductions "
            f"up to {numel} elements ({numel // H} rows of {H}, {why}); buckets {buckets}; {policy} launch configurations "
            f"(SGLANG_PCIE_IPC_TUNE; the tuning step: {step})."]


def ipc(rows, rank, rebind=None):  # a reduction served by PCIe-IPC, out of place: the caller got the workspace's new tensor (100 + rank)
    calls = ([["rebind", rebind]] if rebind is not None else []) + [["pcie_ipc", [rows, H]]]
    return [[["outplace_all_reduce", "tp:0", "pcie_ipc"]], calls, "result", True, 100.0 + rank]


@pytest.mark.parametrize("ws", [2, 4])
def test_only_the_tp_group_builds_it_with_the_switch_on_above_one_rank(result, ws):
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        assert r["tp"] == [DEVICES[rank], True, True]  # agreed at construction, serving from serve()
        assert r["guard"] == dict.fromkeys([f"attention_tp/{ws}", f"pp/{ws}", f"None/{ws}", "tp/1", "tp/env off"], True)
        assert r["log_build"] == []  # agreed: the path is decided only when serve() builds (or fails) the workspace
        assert r["log_guard"] == on0(rank, decode_line("NCCL", ws))  # the tp group with the switch off: decided at construction
        assert r["probes"] == [["check", DEVICES[rank], d] for d in DEVICES[:ws] if d != DEVICES[rank]]  # by GPU id, not rank


@pytest.mark.parametrize("ws", [2, 4])
def test_width_and_buckets_from_the_clamped_capture_list(result, ws):
    assert result["hook"] == ["self.capture_bs, self.compile_bs = get_batch_sizes_to_capture", "log_info_on_rank0", "serve_captured_graphs"]
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        assert r["capture_bs"] == [1, 2, 4, 6]  # 8..32 above the 6 requests dropped, 6 added
        assert r["served"] == [False, NUMEL, H, ROWS, DEVNULL] and r["serve_calls"] == [["init", NUMEL, "torch.bfloat16", ROWS, DEVNULL]]
        assert r["log_serve"] == on0(rank, CAPTURE_LINE, serving_line(ws), decode_line("PCIe-IPC", ws))


def test_max_numel_override_rounded_up_to_a_pack(result):
    numel, rows = 143384, ROWS + [20]  # 7169 x 20 = 143380 -> 143384; 20 rows of 7168 fit
    why = "SGLANG_PCIE_IPC_MAX_NUMEL=143380 rounded up to a 16-byte pack, 143384"
    for rank, r in enumerate(ranks(result, "numel_rounded2")):
        assert r["served"] == [False, numel, H, rows, DEVNULL] and r["serve_calls"] == [["init", numel, "torch.bfloat16", rows, DEVNULL]]
        line = serving_line(2, numel, rows, why, extra=" --max-numel 143384")
        assert r["log_serve"] == on0(rank, CAPTURE_LINE, line, decode_line("PCIe-IPC", 2))
        assert r["eager"] == {"18": ipc(18, rank, rebind=0), "19": ipc(19, rank)}
        assert r["capture"] == {"19": ipc(19, rank, rebind=9)}  # within the wider workspace: prepared (1..20 rows), served in a capture


@pytest.mark.parametrize("ws", [2, 4])
def test_dispatch_order_and_what_each_route_returns(result, ws):
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        assert r["eager"]["3"] == ipc(3, rank, rebind=0)  # the first call binds the workspace to its stream
        for rows in ("6", "7", "12", "18"):  # out of capture any shape within the workspace
            assert r["eager"][rows] == ipc(int(rows), rank), rows
        for name in ("19", "fp16", "fp32", "hidden4096", "strided", "1d"):  # over the cap, not bf16, other width, strided, 1-D
            assert r["eager"][name] == nccl(ws), name
        ca = [[["outplace_all_reduce", "tp:0", "ca"]], [["ca", [3, H]]], "result", True, 200.0 + rank]
        assert r["eager_ca"] == {"3": ca, "6": ipc(6, rank)}  # custom allreduce first, PCIe-IPC where it declines


@pytest.mark.parametrize("ws", [2, 4])
def test_graph_capture_prepares_every_admitted_row_once_and_a_capture_serves_only_those_resolved(result, ws):
    for rank, r in enumerate(ranks(result, f"main{ws}")):
        assert r["capture_calls"] == [
            ["wait_stream", 9], ["prepare", [[rows, H] for rows in range(1, 19)]], ["body"],  # inside graph_capture, every row
            ["rebind", 9], ["pcie_ipc", [3, H]], ["pcie_ipc", [6, H]], ["pcie_ipc", [7, H]], ["pcie_ipc", [18, H]],
            ["wait_stream", 9], ["pcie_ipc", [3, H]],  # a second capture: nothing prepared again
            ["rebind", 0], ["pcie_ipc", [3, H]],
        ]
        # 7 rows: no bucket but admitted (the draft's graphs); 12: flashinfer resolved no configuration; strided: not contiguous
        assert r["capture"] == {"3": ipc(3, rank, rebind=9), "6": ipc(6, rank), "7": ipc(7, rank), "18": ipc(18, rank), "12": nccl(ws),
                                "strided": nccl(ws), "19": nccl(ws)}
        assert r["capture2"] == {"3": ipc(3, rank)} and r["eager_after"] == {"3": ipc(3, rank, rebind=0)}


@pytest.mark.parametrize("case", ["p2_2", "p2_4", "ca_raises2", "ca_raises_unset2"])
def test_p2_is_not_built_when_pcie_ipc_is_agreed_and_the_users_switch_comes_back(result, case):
    ws, user = int(case[-1]), None if case == "ca_raises_unset2" else "1"
    failed = ["WARNING", "parallel_state", "Setup Custom allreduce failed with out of memory. To silence this warning, "
              "specify --disable-custom-all-reduce explicitly."]
    for rank, r in enumerate(ranks(result, case)):
        assert r["tp"] == [DEVICES[rank], True, True] and r["served"][0] is False
        assert r["p2_env"] == user  # the override ends with the constructor, also when it raised (unset stays unset)
        if ws == 4:  # the real CustomAllreduce saw SGLANG_ENABLE_PCIE_CUSTOM_AR off: no IPC buffer, no kernel
            assert r["ca"] == ["CustomAllreduce", True] and r["build"] == []
            assert r["log_build"] == on0(rank, P2_IGNORED) + [P2_PCIE_OFF]
        elif case == "p2_2":  # two GPUs: custom allreduce as upstream builds it, ahead of PCIe-IPC
            assert r["ca"] == ["CustomAllreduce", False] and r["build"] == p2_built(rank, False) and r["log_build"] == on0(rank, P2_IGNORED)
        else:  # its constructor raised inside the override
            assert r["ca"] is None and r["build"] == p2_built(rank, False)[:1]
            assert r["log_build"] == on0(rank, *[P2_IGNORED] * (user == "1")) + [failed]
        assert r["log_serve"] == on0(rank, CAPTURE_LINE, serving_line(ws), decode_line("custom allreduce" if case == "p2_2" else "PCIe-IPC", ws))


def test_p2_is_built_as_before_when_pcie_ipc_is_blocked(result):
    why = ("rank 2: flashinfer.comm.pcie_ipc_ar.PcieIpcAllReduceWorkspace does not import (ModuleNotFoundError: import of "
           "flashinfer.comm.pcie_ipc_ar halted; None in sys.modules); flashinfer-python>=0.7.0 has it")
    p2_on = ["INFO", "custom_all_reduce", "Custom allreduce on 4 PCIe-only GPUs for tensors up to 65536 bytes (default; server "
             "settings unknown: Global server args is not set yet!), NCCL above."]  # _TP is not set yet: every rank says it
    for rank, r in enumerate(ranks(result, "p2_blocked4")):
        assert r["tp"] == [DEVICES[rank], False, True] and r["ca"] == ["CustomAllreduce", False] and r["build"] == p2_built(rank, True)
        assert r["probes"] == [["check", rank, k] for k in range(4) if k != rank]  # P2's own probe (by rank); P5 stopped first
        assert r["log_build"] == [off_line(4, why), p2_on] + on0(rank, decode_line("custom allreduce", 4))
        assert r["served"] == [True, 0, 0, [], None] and r["serve_calls"] == [] and r["log_serve"] == on0(rank, CAPTURE_LINE)


@pytest.mark.parametrize("case,pair,tag", [("p2p_missing2", "5->3", "check"), ("p2p_missing4", "5->7", "check"),
                                           ("p2p_missing_driver4", "5->7", "driver")])
def test_one_missing_p2p_pair_turns_every_rank_off_without_a_hang(result, case, pair, tag):
    ws = int(case[-1])
    for rank, r in enumerate(ranks(result, case)):
        assert r["tp"] == [DEVICES[rank], False, True]
        assert r["probes"] == [[tag, DEVICES[rank], d] for d in DEVICES[:ws] if d != DEVICES[rank]]
        warning = off_line(ws, f"GPU P2P access is missing between GPUs {pair}")
        assert r["log_build"] == [warning] + on0(rank, decode_line("NCCL", ws))
        assert r["log_serve"] == on0(rank, CAPTURE_LINE) and r["serve_calls"] == []  # no workspace
        assert r["eager"] == {"3": nccl(ws)} and r["capture"] == {"3": nccl(ws)}
        assert r["capture_calls"] == [["wait_stream", 9], ["body"], ["wait_stream", 9]]  # nothing prepared


@pytest.mark.parametrize("case", ["tune_one_rank4", "tune_unknown4", "tune_other_key4", "tune_match2"])
def test_every_rank_builds_with_the_agreed_tune_decision(result, case):
    ws = int(case[-1])
    path = f"{result['fi_dirs'][case]}/sglang_pcie_ipc_ws{ws}.json"
    key = "{'world_size': 4, 'hidden': 7168, 'max_numel': %d, 'buckets': %s, 'flashinfer': %r}"
    made, want = key % (24 * H, [3, 6, 12, 24], result["fi_version"]), key % (NUMEL, ROWS, result["fi_version"])
    step = "python -m sglang.srt.pcie_ipc_tune --tp 4 --hidden 7168 --rows 3,6,12,18 --pin-clocks MHZ"
    warning = {  # rank: its one warning
        "tune_one_rank4": dict.fromkeys(range(4), "PCIe-IPC allreduce: the ranks see different tune caches ([('cache', 'match'), "
                                        "('seed', 'absent')]); every rank runs the seed configurations."),
        "tune_unknown4": {2: "SGLANG_PCIE_IPC_TUNE='fast' is not one of 0|seed, cache, 1|tune; using the seed launch configurations."},
        "tune_other_key4": dict.fromkeys(range(4), f"PCIe-IPC allreduce: SGLANG_PCIE_IPC_TUNE=cache, but {path} was made for {made}, "
                                         f"not {want}; running the seed configurations. Tune for this server: {step}"),
    }.get(case, {})
    cache = path if case == "tune_match2" else DEVNULL  # a seed start reads no cache
    for rank, r in enumerate(ranks(result, case)):
        assert r["served"] == [False, NUMEL, H, ROWS, cache] and r["serve_calls"] == [["init", NUMEL, "torch.bfloat16", ROWS, cache]]
        lines = [["WARNING", "pcie_ipc_allreduce", warning[rank]]] if rank in warning else []
        policy = "cache" if cache == path else "seed"
        assert r["log_serve"] == on0(rank, CAPTURE_LINE) + lines + on0(rank, serving_line(ws, policy=policy), decode_line("PCIe-IPC", ws))


@pytest.mark.parametrize("case", ["main2", "main4", "p2_4", "tune_match2", "p2p_missing4", "numel_below_row4", "serve_fails_workspace4"])
def test_destroy_releases_the_workspace_on_every_rank_before_the_groups_go(result, case):
    served = case not in ("p2p_missing4", "numel_below_row4", "serve_fails_workspace4")  # the ranks that built drop theirs unused
    for r in ranks(result, case):
        assert r["destroy"] == [[["destroy"]] * served + [["destroy_process_group"]] * 2, True]
        assert r["log_rest"] == []


@pytest.mark.parametrize("case", ["numel_below_row4", "serve_fails_numel4", "serve_fails_workspace4"])
def test_pcie_ipc_failing_at_serve_names_the_lost_custom_allreduce_and_then_the_real_path(result, case):
    why = "rank 1: the workspace failed: RuntimeError: no IPC memory" if case == "serve_fails_workspace4" else BELOW_ROW
    lost, built = LOST * (case != "numel_below_row4"), [0, 2, 3] * (case == "serve_fails_workspace4")  # built, then dropped unused
    for rank, r in enumerate(ranks(result, case)):  # the last two: agreed with SGLANG_ENABLE_PCIE_CUSTOM_AR=1, so P2 was not built
        assert r["tp"] == [DEVICES[rank], True, True] and r["ca"] == (["CustomAllreduce", True] if lost else None)
        assert r["log_build"] == (on0(rank, P2_IGNORED) + [P2_PCIE_OFF] if lost else [])  # no path named before serve() decided it
        assert r["log_serve"] == on0(rank, CAPTURE_LINE) + [off_line(4, why, lost)] + on0(rank, decode_line("NCCL", 4))
        assert r["served"] == [True, 0, 0, [], DEVNULL if built else None] and r["p2_env"] == ("1" if lost else None)
        assert r["serve_calls"] == [["init", NUMEL, "torch.bfloat16", ROWS, DEVNULL]] * (rank in built)
        assert r["eager"] == r["capture"] == {"3": nccl(4)} and r["log_rest"] == []  # reductions on the next backend; none named later


def test_ranks_that_all_ask_for_the_cache_but_see_it_differently_run_the_seed(result):
    """The race the agreed decision exists for: SGLANG_PCIE_IPC_TUNE=cache on every rank, while the cache
    appears (rank 3 saw none) or is replaced (rank 2's key names other bytes) between the ranks' checks."""
    for rank, r in enumerate(ranks(result, "tune_race4")):
        assert r["served"] == [False, NUMEL, H, ROWS, DEVNULL] and r["serve_calls"] == [["init", NUMEL, "torch.bfloat16", ROWS, DEVNULL]]
        w = [line for line in r["log_serve"] if line[0] == "WARNING"]
        assert len(w) == 1 and w[0][2].startswith("PCIe-IPC allreduce: the ranks see different tune caches ([('cache', ")
        assert "('cache', 'absent')" in w[0][2] and "('cache', 'match')" in w[0][2]
        assert "was written for another cache (sha256 differs" in w[0][2]
        assert w[0][2].endswith("every rank runs the seed configurations.")
        info = [line for line in r["log_serve"] if line[:2] == ["INFO", "pcie_ipc_allreduce"]]
        assert info == on0(rank, serving_line(4, policy="seed"), decode_line("PCIe-IPC", 4))


def test_p2_only_users_get_custom_allreduce_as_before_and_no_word_of_p5(result):
    p2_on = ["INFO", "custom_all_reduce", "Custom allreduce on 4 PCIe-only GPUs for tensors up to 65536 bytes (default; server "
             "settings unknown: Global server args is not set yet!), NCCL above."]
    for rank, r in enumerate(ranks(result, "p2_only4")):
        assert r["tp"] == [DEVICES[rank], None, None] and r["served"] is None  # no PCIe-IPC object at all
        assert r["ca"] == ["CustomAllreduce", False] and r["build"] == p2_built(rank, True)  # P2's IPC buffers and kernel
        assert r["p2_env"] == "1" and r["probes"] == [["check", rank, k] for k in range(4) if k != rank]
        logs = r["log_build"] + r["log_serve"] + r["log_rest"]
        assert not [line for line in logs if "PCIE_IPC" in line[2] or "PCIe-IPC" in line[2]], logs
        assert r["log_build"] == [p2_on] + on0(rank, decode_line("custom allreduce", 4))
