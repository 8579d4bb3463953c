"""P5 (0005, FlashInfer PCIe-IPC allreduce backport): the rules of the real patched modules.

One subprocess imports the patched 0.5.9 tree: the width and buckets from the captured rows
(both sides of the override and the pack), the blockers, the tune policy and the tune cache's key,
the tuning command, P1's gate yielding, the start-up path's order, the Envs declarations, and
the tuning step's refusals (its real ``main``, before anything needs a GPU). Then real processes
on a real gloo group construct the real ``PcieIpcAllReduce`` and ``serve()`` it; only flashinfer's
``PcieIpcAllReduceWorkspace`` (it needs CUDA) is a recording stand-in, with torch.cuda's stream
queries. A blocker, or a width, on one rank turns it off on every rank, with no hang. The real
``GroupCoordinator`` around it: test_p5_group_coordinator.py.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from forked_ranks import RANK_RUNNER

CODE = r"""
import contextlib, dataclasses, datetime, io, json, logging, os, signal, socket, sys, tempfile, time, types
import torch
import torch.distributed as dist
import sglang.srt.distributed.device_communicators.pcie_ipc_allreduce as m
import sglang.srt.pcie_ipc_tune as tune
import sglang.srt.server_args as sa
from sglang.srt.environ import envs

out = {}
out["envs"] = [envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get(), envs.SGLANG_PCIE_IPC_MAX_NUMEL.get(),
               envs.SGLANG_PCIE_IPC_TUNE.get()]
out["numel"] = {f"{r}x{h}": m.pcie_ipc_max_numel(r, h) for r, h in ((3, 7168), (1, 7), (2, 5), (24, 7168), (0, 7168))}
def width(rows, hidden=7168, override=None):
    try:
        return list(m.pcie_ipc_width(rows, hidden, override))
    except ValueError as e:
        return "ValueError: " + str(e)
out["width"] = {
    "eagle3": width([3, 6, 12, 24, 18]),  # unsorted, as a capture list x 3 tokens
    "dupes": width([6, 3, 3, 0]),
    "override_wider": width([3, 6], override=10 * 7168),
    "override_between": width([3, 6, 12], override=7 * 7168),
    "override_unaligned": width([3], hidden=12, override=37),
    "override_one_row": width([3, 6], override=7168),
    "override_below_row": width([3, 6], override=7167),
    "no_rows": width([]),
    "hidden0": width([3], hidden=0),
}
B = lambda ws, cuda=True, det=False, graphs=True: m.pcie_ipc_blocker(ws, cuda, det, graphs)
out["blocker_no_fi"] = B(8)
pol = {}
for v in (None, "", "0", "seed", " SEED ", "cache", "1", "tune", "auto", "yes"):
    cap = io.StringIO(); h = logging.StreamHandler(cap); m.logger.addHandler(h)
    pol[repr(v)] = [m.pcie_ipc_tune_policy(v), cap.getvalue()]
    m.logger.removeHandler(h)
cap = io.StringIO(); h = logging.StreamHandler(cap); m.logger.addHandler(h)
m.pcie_ipc_tune_policy("auto"); m.logger.removeHandler(h)
pol["auto_again"] = cap.getvalue()  # once per process
out["policy"] = pol

def fake_file_key(op, runner, shapes, config, extras):  # flashinfer's autotuner's on-disk key
    return types.SimpleNamespace(file_key=str((op, type(runner).__name__, shapes, extras)))
def fake_extras(world_size, profile, max_blocks, max_numel, dtype, memop=False):
    return (3, world_size, profile, max_blocks, max_numel, str(dtype))
class FakeRunner:
    def __init__(self, workspace):
        self.ws = workspace
LOADED = []  # flashinfer's loaded cache entries (its autotuner's _file_configs)
class FakeWorkspace:  # flashinfer.comm.pcie_ipc_ar.PcieIpcAllReduceWorkspace needs CUDA
    calls = []; fail = False
    def __init__(self, group, max_numel, dtype, tune_batches, tune_cache):
        FakeWorkspace.calls.append(["init", max_numel, str(dtype), list(tune_batches), tune_cache])
        if FakeWorkspace.fail:
            raise RuntimeError("cudaIpcOpenMemHandle failed")
        self.world_size, self.max_numel, self.elem_size, self.max_blocks = dist.get_world_size(group), max_numel, 2, 36
        self.profile, self.memop_supported, self.dtype, self.tune_batches = "rootcplx", False, dtype, tune_batches
        if os.path.isfile(tune_cache):  # flashinfer loads the cache at its build
            LOADED.extend(json.load(open(tune_cache)))
    def prepare(self, shapes, dtype):
        FakeWorkspace.calls.append(["prepare", [list(s) for s in shapes]])
        return {s: (None if s[0] == 6 else object()) for s in shapes}
    def supports(self, inp):
        return True
    def rebind_stream(self):
        FakeWorkspace.calls.append(["rebind"])
    def all_reduce(self, inp):
        FakeWorkspace.calls.append(["all_reduce", list(inp.shape)])
        return inp + 1
    def tune(self, hiddens, cache, tune_group):
        FakeWorkspace.calls.append(["tune", hiddens, cache])
        if os.environ.get("FAKE_TUNE") == "fail":  # on every rank, as flashinfer's collective checks fail
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if dist.get_rank(tune_group) == 0:  # flashinfer: rank 0 saves the configs, an entry per measured bucket
            cover = os.environ.get("FAKE_COVER", "all")
            rows = self.tune_batches if cover == "all" else [int(r) for r in cover.split(",") if r]
            extras = fake_extras(self.world_size, self.profile, self.max_blocks, self.max_numel, self.dtype)
            json.dump({fake_file_key("flashinfer::pcie_ipc_all_reduce", FakeRunner(self), ((r, hiddens[0]),), None,
                                     extras).file_key: [0, [1, 8, 512]] for r in rows}, open(cache, "w"))
        return {}
    def destroy(self):
        FakeWorkspace.calls.append(["destroy"])
CACHE_DIR = tempfile.mkdtemp()
def install_fake_flashinfer():
    fi = types.ModuleType("flashinfer"); fi.__path__ = []
    comm = types.ModuleType("flashinfer.comm"); comm.__path__ = []
    ar = types.ModuleType("flashinfer.comm.pcie_ipc_ar"); ar.PcieIpcAllReduceWorkspace = FakeWorkspace
    ar.get_pcie_ipc_comm_module = lambda: types.SimpleNamespace(
        workspace_size=lambda ws, numel, elem, blocks: ws * numel * elem * 2 + blocks * 4096)
    tun = types.ModuleType("flashinfer.comm.pcie_ipc_tuning")
    tun.default_cache_path = lambda ws: f"{CACHE_DIR}/pcie_ipc_all_reduce_ws{ws}.json"
    tun.PCIE_IPC_CUSTOM_OP, tun.PcieIpcAllReduceRunner = "flashinfer::pcie_ipc_all_reduce", FakeRunner
    tun.cache_key_extras, tun.pcie_ipc_tuning_config = fake_extras, lambda batches: batches
    tun.cache_covers_workspace = lambda ws, profile, blocks, numel, memop=False: any(
        repr((3, ws, profile, blocks, numel))[:-1] + ", " in key for key in LOADED)
    auto = types.ModuleType("flashinfer.autotuner")
    auto.AutoTuner = types.SimpleNamespace(_get_cache_key=fake_file_key)
    sys.modules.update({"flashinfer": fi, "flashinfer.comm": comm, "flashinfer.comm.pcie_ipc_ar": ar,
                        "flashinfer.comm.pcie_ipc_tuning": tun, "flashinfer.autotuner": auto})
install_fake_flashinfer()
out["blocker"] = {str(ws): B(ws) for ws in (1, 2, 3, 4, 6, 8, 16)}
out["blocker_cpu"] = B(8, cuda=False)
out["blocker_det"] = B(8, det=True)
out["blocker_no_graphs"] = B(8, graphs=False)
out["cache_path"] = m.tune_cache_path(4)
key = m.tune_cache_key(4, 7168, 24 * 7168, (3, 6, 24))
out["key"] = key
path = os.path.join(CACHE_DIR, "c.json")
states = {"absent": m.tune_cache_state(path, key)}
open(path, "w").write("{}")
states["no_key"] = m.tune_cache_state(path, key)
open(path + ".key", "w").write(json.dumps(dict(key, buckets=[3, 6, 12, 24])))
states["other_buckets"] = m.tune_cache_state(path, key)
open(path + ".key", "w").write(json.dumps(key))
states["no_sha256"] = m.tune_cache_state(path, key)  # a key of the old form names no cache
open(path + ".key", "w").write(m.tune_cache_key_text(path, key))
states["match"] = m.tune_cache_state(path, key)
out["key_text"] = json.loads(open(path + ".key").read())
open(path, "w").write('{"tuned": "for another workspace"}')  # a step killed between its renames
states["cache_replaced"] = m.tune_cache_state(path, key)
def hung(*_):
    raise TimeoutError("hung")
signal.signal(signal.SIGALRM, hung)
def state_of(make):  # the key as something else than a regular file: never hangs, never reads on
    (os.rmdir if os.path.isdir(path + ".key") else os.unlink)(path + ".key")
    make(path + ".key")
    signal.alarm(10)
    try:
        return m.tune_cache_state(path, key)
    except TimeoutError as e:
        return str(e)
    finally:
        signal.alarm(0)
states["key_fifo"] = state_of(os.mkfifo)
states["key_dev_zero"] = state_of(lambda p: os.symlink("/dev/zero", p))
states["key_folder"] = state_of(os.mkdir)
states["key_large"] = state_of(lambda p: open(p, "w").write(" " * 5000 + m.tune_cache_key_text(path, key)))
out["cache_state"] = states
out["tune_cmd"] = [m.tune_command(8, 7168, (3, 6, 24), 24 * 7168), m.tune_command(4, 7168, (3, 10), 10 * 7168 + 8)]

def tune_main(*argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = tune.main(list(argv))
        except SystemExit as e:
            code = e.code
    return [code, err.getvalue().strip().splitlines()[-1:] ]
common = ["--hidden", "7168", "--rows", "3,6"]
out["tune_main"] = {
    "tp3": tune_main("--tp", "3", *common, "--clocks-pinned"),
    "rows_bad": tune_main("--tp", "4", "--hidden", "7168", "--rows", "3,x", "--clocks-pinned"),
    "below_row": tune_main("--tp", "4", *common, "--max-numel", "100", "--clocks-pinned"),
    "devices": tune_main("--tp", "4", *common, "--devices", "0,1", "--clocks-pinned"),
    "clocks": tune_main("--tp", "4", *common),
}

class MC:
    hidden_size = 7168
def server(algo=None, tokens=None):
    return types.SimpleNamespace(speculative_algorithm=algo, speculative_num_draft_tokens=tokens,
        get_model_config=lambda: MC, enable_deterministic_inference=False, disable_cuda_graph=False,
        enable_flashinfer_allreduce_fusion=False)
G = sa.get_flashinfer_allreduce_fusion_blocker
out["p1"] = {"sm120_ipc": G(12, "0.7.2", True, True, pcie_ipc_on=True), "sm120": G(12, "0.7.2", True, True),
             "sm90_ipc": G(9, "0.6.3", True, True, pcie_ipc_on=True),
             "sm100_ipc": G(10, "0.6.3", True, True, pcie_ipc_on=True)}
N = types.SimpleNamespace
on, off = N(disabled=False, agreed=True), N(disabled=True, agreed=False)
paths = {}
for name, (fused, ca, ipc) in {"all": (True, on, on), "ca_ipc": (False, on, on), "ipc": (False, off, on),
                               "none": (False, None, off), "ca_off_ipc_none": (False, off, None),
                               "agreed_not_built": (False, None, N(disabled=True, agreed=True))}.items():
    sa._global_server_args = server(); sa._global_server_args.enable_flashinfer_allreduce_fusion = fused
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
ROWS = [3, 6, 12, 24]  # captured batches 1, 2, 4, 8 x 3 EAGLE-3 tokens
def child(rank, port, outdir, bad_rank, all_env, bad_env):
    for k in ("SGLANG_PCIE_IPC_MAX_NUMEL", "SGLANG_PCIE_IPC_TUNE"):
        os.environ.pop(k, None)
    os.environ.update(all_env)
    m._warn_once.cache_clear()  # a server's rank is a fresh process; these are forked
    if rank == bad_rank:
        os.environ.update(bad_env)
    FakeWorkspace.fail = rank == bad_rank and "FAIL" in bad_env
    sa._global_server_args = server("EAGLE3", 3)
    sa._global_server_args.disable_cuda_graph = rank == bad_rank and "NO_GRAPHS" in bad_env
    sa._global_server_args.enable_deterministic_inference = rank == bad_rank and "DETERMINISTIC" in bad_env
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WS,
                            timeout=datetime.timedelta(seconds=30))
    cap = Capture(); m.logger.addHandler(cap); m.logger.setLevel(logging.INFO)
    capturing = [False]; stream = [Stream(0)]
    torch.cuda.is_current_stream_capturing = lambda: capturing[0]
    torch.cuda.current_stream = lambda: stream[0]
    torch.cuda.can_device_access_peer = lambda a, b: True
    os.environ["SGLANG_SKIP_P2P_CHECK"] = "1"
    comm = m.PcieIpcAllReduce(group=dist.group.WORLD, device=torch.device("cuda", 3))
    res = {"agreed_at_start": comm.agreed}
    comm.serve(ROWS, 7168); comm.serve([99], 7168)  # once
    res.update({"agreed": comm.agreed, "disabled": comm.disabled, "max_numel": comm.max_numel, "buckets": list(comm.buckets),
                "tune_cache": comm.tune_cache})
    if not comm.disabled:
        bf = torch.bfloat16
        t = lambda rows, hidden=7168, dtype=bf: torch.empty(rows, hidden, dtype=dtype)
        nc = torch.empty(7168, 3, dtype=bf).t()
        res["eager"] = {k: comm.should_pcie_ipc_ar(v) for k, v in {
            "1": t(1), "24": t(24), "25": t(25), "fp16": t(3, dtype=torch.float16), "fp32": t(3, dtype=torch.float32),
            "hidden4096": t(3, 4096), "1d": torch.empty(7168, dtype=bf), "noncontig": nc}.items()}
        comm.prepare(); comm.prepare()
        capturing[0] = True
        res["capture"] = {str(r): comm.should_pcie_ipc_ar(t(r)) for r in (1, 3, 6, 12, 24, 25)}
        res["capture"]["noncontig"] = comm.should_pcie_ipc_ar(nc)
        capturing[0] = False
        res["result"] = comm.all_reduce(torch.zeros(3, 7168, dtype=bf))[0, 0].item()
        comm.all_reduce(t(3)); stream[0] = Stream(7); comm.all_reduce(t(1))
        comm.destroy()
        res["after_destroy"] = comm.should_pcie_ipc_ar(t(1))
    res["calls"] = FakeWorkspace.calls
    res["log"] = cap.records
    json.dump(res, open(os.path.join(outdir, f"{rank}.json"), "w"))
    dist.barrier()
    open(os.path.join(outdir, f"{rank}.done"), "w").write("ok")

def run_case(bad_rank=-1, all_env={}, **bad_env):
    return run_ranks(WS, child, 90, bad_rank, all_env, bad_env)

out["ok"] = run_case()
out["rank2_below_row"] = run_case(2, SGLANG_PCIE_IPC_MAX_NUMEL="7000")
out["rank1_other_width"] = run_case(1, SGLANG_PCIE_IPC_MAX_NUMEL=str(16 * 7168))
out["rank3_no_graphs"] = run_case(3, NO_GRAPHS="1")
out["rank1_deterministic"] = run_case(1, DETERMINISTIC="1")
out["server_fields"] = sorted({"enable_deterministic_inference", "disable_cuda_graph"}
                              - {f.name for f in dataclasses.fields(sa.ServerArgs)})  # the real ServerArgs' names
out["rank1_workspace_fails"] = run_case(1, FAIL="1")
out["rank2_tune_cache"] = run_case(2, SGLANG_PCIE_IPC_TUNE="cache")
out["cache_absent"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "cache"})
out["tune"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "tune"})
out["cache_match"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "cache"})
out["cache_other_width"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "cache", "SGLANG_PCIE_IPC_MAX_NUMEL": str(25 * 7168)})
served = m.tune_cache_path(WS)
open(served, "w").write('{"tuned": "by another step"}')  # the key still names the tuned cache's bytes
out["cache_replaced"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "cache"})
os.unlink(served + ".key"); os.mkfifo(served + ".key")
out["cache_key_fifo"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "cache"})
out["rank0_unknown_tune"] = run_case(0, SGLANG_PCIE_IPC_TUNE="auto")
# an older cache for another workspace (25 rows) at the path, with its own key; then tunes at start that
# fail, or that leave flashinfer's cache without every bucket: neither leaves a key that matches this one
os.unlink(served + ".key")
open(served, "w").write('{"tuned": "for 25 rows"}')
other = m.tune_cache_key(WS, 7168, 25 * 7168, (3, 6, 12, 24, 25))
this = m.tune_cache_key(WS, 7168, 24 * 7168, tuple(ROWS))
open(served + ".key", "w").write(m.tune_cache_key_text(served, other))
out["tune_fails"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "tune", "FAKE_TUNE": "fail"})
out["tune_fails_state"] = [m.tune_cache_state(served, this), m.tune_cache_state(served, other)]
out["tune_partial"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "tune", "FAKE_COVER": "3,6"})
out["tune_partial_state"] = m.tune_cache_state(served, this)
# a cache and a key that match, but flashinfer loads no entry for this workspace from it ("Saved 0 configs")
open(served, "w").write("{}")
open(served + ".key", "w").write(m.tune_cache_key_text(served, this))
out["cache_loads_nothing"] = run_case(-1, {"SGLANG_PCIE_IPC_TUNE": "cache"})
print("RESULT" + json.dumps(out))
"""

NUMEL = 24 * 7168


@pytest.fixture(scope="module")
def result(run_patched):
    proc = run_patched(RANK_RUNNER + CODE, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_off_by_default_and_seed(result):
    assert result["envs"] == [False, None, "seed"]


def test_width_rounds_up_to_a_whole_pack(result):
    assert result["numel"] == {"3x7168": 21504, "1x7": 8, "2x5": 16, "24x7168": 172032, "0x7168": 0}


def test_width_and_buckets_are_the_captured_rows(result):
    w = result["width"]
    assert w["eagle3"] == [NUMEL, [3, 6, 12, 18, 24], "widest captured reduction 24 rows"]
    assert w["dupes"] == [6 * 7168, [3, 6], "widest captured reduction 6 rows"]
    # a wider override admits its own row capacity as the top bucket
    assert w["override_wider"] == [10 * 7168, [3, 6, 10], "SGLANG_PCIE_IPC_MAX_NUMEL=71680"]
    # a narrower one drops the captured rows past it
    assert w["override_between"] == [7 * 7168, [3, 6], "SGLANG_PCIE_IPC_MAX_NUMEL=50176"]
    assert w["override_unaligned"] == [40, [3], "SGLANG_PCIE_IPC_MAX_NUMEL=37 rounded up to a 16-byte pack, 40"]
    assert w["override_one_row"] == [7168, [1], "SGLANG_PCIE_IPC_MAX_NUMEL=7168"]
    assert w["override_below_row"] == (
        "ValueError: SGLANG_PCIE_IPC_MAX_NUMEL=7167 is below one row of 7168; unset it or set it to at least 7168")
    assert w["no_rows"] == "ValueError: the decode/verify width is unknown (hidden 7168, rows [])"
    assert w["hidden0"] == "ValueError: the decode/verify width is unknown (hidden 0, rows [3])"


def test_blocker_rules(result):
    assert "flashinfer.comm.pcie_ipc_ar.PcieIpcAllReduceWorkspace does not import" in result["blocker_no_fi"]
    assert "flashinfer-python>=0.7.0" in result["blocker_no_fi"]
    for ws in ("2", "4", "8"):
        assert result["blocker"][ws] is None
    for ws in ("1", "3", "6", "16"):
        assert result["blocker"][ws] == f"it supports (2, 4, 8) ranks, not {ws}"
    assert result["blocker_cpu"] == "it needs CUDA"
    assert result["blocker_det"].startswith("--enable-deterministic-inference is on")
    assert result["blocker_no_graphs"].startswith("--disable-cuda-graph is on")


def test_tune_policy_seed_by_default_unknown_warns_once(result):
    p = result["policy"]
    for v, want in {"None": "seed", "''": "seed", "'0'": "seed", "'seed'": "seed", "' SEED '": "seed",
                    "'cache'": "cache", "'1'": "tune", "'tune'": "tune"}.items():
        assert p[v] == [want, ""], v
    for v in ("'auto'", "'yes'"):
        assert p[v][0] == "seed"
        assert p[v][1] == (f"SGLANG_PCIE_IPC_TUNE={v} is not one of 0|seed, cache, 1|tune; "
                           "using the seed launch configurations.\n")
    assert p["auto_again"] == ""


def test_tune_cache_is_keyed_by_the_workspace(result):
    assert result["cache_path"].endswith("/sglang_pcie_ipc_ws4.json")
    assert {k: v for k, v in result["key"].items() if k != "flashinfer"} == {
        "world_size": 4, "hidden": 7168, "max_numel": NUMEL, "buckets": [3, 6, 24]}
    s = result["cache_state"]
    assert s["absent"] == "absent" and s["match"] == "match"
    assert "has no readable" in s["no_key"] and s["no_key"].endswith(".key (FileNotFoundError)")
    assert "'buckets': [3, 6, 12, 24]" in s["other_buckets"] and "not {" in s["other_buckets"]
    assert "'buckets': [3, 6, 24]" in s["other_buckets"].split("not ", 1)[1]
    # the key names its cache's bytes: a key of the old form, or a cache replaced under its key, is no match
    assert result["key_text"] == dict(result["key"], cache_sha256=hashlib.sha256(b"{}").hexdigest())
    assert s["no_sha256"].endswith("c.json.key names no cache (no cache_sha256); tune again")
    assert s["cache_replaced"].endswith("c.json.key was written for another cache (sha256 differs: a tuning step was "
                                        "interrupted or two ran at once); tune again")


@pytest.mark.parametrize("case,why", [("key_fifo", "not a regular file"), ("key_dev_zero", "a symbolic link"),
                                      ("key_folder", "not a regular file"), ("key_large", "over 4096 bytes")])
def test_the_key_is_read_only_from_a_small_regular_file(result, case, why):
    state = result["cache_state"][case]
    assert state != "hung" and " has no readable " in state and state.endswith(f"c.json.key ({why})")


def test_tuning_command_is_the_workspace_s_own(result):
    mod = "python -m sglang.srt.pcie_ipc_tune"
    assert result["tune_cmd"] == [
        f"{mod} --tp 8 --hidden 7168 --rows 3,6,24 --pin-clocks MHZ",
        f"{mod} --tp 4 --hidden 7168 --rows 3,10 --max-numel 71688 --pin-clocks MHZ"]


def test_tuning_step_refuses_with_one_line_before_any_gpu(result):
    t = result["tune_main"]
    assert t["tp3"] == [2, ["error: --tp 3: the kernels support (2, 4, 8)"]]
    assert t["rows_bad"] == [2, ["error: --rows 3,x: the captured rows are positive integers, a,b,c"]]
    assert t["below_row"] == [2, ["error: --rows/--max-numel: SGLANG_PCIE_IPC_MAX_NUMEL=100 is below one "
                                   "row of 7168; unset it or set it to at least 7168"]]
    assert t["devices"] == [2, ["error: --devices names 2 GPUs for --tp 4"]]
    assert t["clocks"][0] == 2 and "--pin-clocks MHZ" in t["clocks"][1][0] and "--clocks-pinned" in t["clocks"][1][0]


def test_p1_yields_on_sm120_only(result):
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 hands the decode/verify reductions" in result["p1"]["sm120_ipc"]
    assert result["p1"]["sm120"] is None
    assert result["p1"]["sm90_ipc"] is None and result["p1"]["sm100_ipc"] is None


def test_startup_path_in_dispatch_order(result):
    assert result["paths"] == {"all": "trtllm fused", "ca_ipc": "custom allreduce", "ipc": "PCIe-IPC",
                               "none": "NCCL", "ca_off_ipc_none": "NCCL", "agreed_not_built": "NCCL"}  # not printed until built


def _ranks(result, case):
    c = result[case]
    assert c["blocked"] == 0
    for rank, r in c["ranks"].items():
        assert r["in_step"], (rank, r)
    return c["ranks"]


def _warnings(r):
    return [msg for lvl, msg in r["log"] if lvl == "WARNING"]


def test_every_rank_builds_and_serves_the_captured_rows(result):
    ranks = _ranks(result, "ok")
    for r in ranks.values():
        assert r["agreed"] and not r["disabled"] and r["max_numel"] == NUMEL and r["buckets"] == [3, 6, 12, 24]
        assert r["tune_cache"] == "/dev/null"  # seed: no cache is read
        assert r["calls"][0] == ["init", NUMEL, "torch.bfloat16", [3, 6, 12, 24], "/dev/null"]
        assert sum(c[0] == "init" for c in r["calls"]) == 1  # serve() is once
        assert ["prepare", [[rows, 7168] for rows in range(1, 25)]] in r["calls"]  # the draft's rows too
        assert sum(c[0] == "prepare" for c in r["calls"]) == 1
        assert not any(c[0] == "tune" for c in r["calls"])
        assert r["eager"] == {"1": True, "24": True, "25": False, "fp16": False, "fp32": False,
                              "hidden4096": False, "1d": False, "noncontig": False}
        # inside a capture only prepared rows (6 resolved to unsupported), never a non-contiguous one
        assert r["capture"] == {"1": True, "3": True, "6": False, "12": True, "24": True, "25": False,
                                "noncontig": False}
        assert r["result"] == 1.0  # the workspace's out-of-place result, not the input
        assert r["calls"][-6:] == [["rebind"], ["all_reduce", [3, 7168]], ["all_reduce", [3, 7168]], ["rebind"],
                                   ["all_reduce", [1, 7168]], ["destroy"]]
        assert r["after_destroy"] is False
        assert _warnings(r) == []
    infos = [msg for lvl, msg in ranks["0"]["log"] if lvl == "INFO"]
    size = (4 * NUMEL * 2 * 2 + 36 * 4096) / (1 << 20)
    assert infos == [
        f"PCIe-IPC allreduce on 4 GPUs: workspace {size:.1f} MiB per GPU, bf16 reductions up to {NUMEL} elements "
        "(24 rows of 7168, widest captured reduction 24 rows); buckets [3, 6, 12, 24]; seed launch configurations "
        "(SGLANG_PCIE_IPC_TUNE; the tuning step: python -m sglang.srt.pcie_ipc_tune"
        " --tp 4 --hidden 7168 --rows 3,6,12,24 --pin-clocks MHZ)."]
    assert ranks["1"]["log"] == []


@pytest.mark.parametrize("case,why,built", [
    ("rank2_below_row", "rank 2: SGLANG_PCIE_IPC_MAX_NUMEL=7000 is below one row of 7168", False),
    ("rank1_other_width", "the ranks disagree on the width: [", False),
    ("rank3_no_graphs", "rank 3: --disable-cuda-graph is on", False),
    ("rank1_deterministic", "rank 1: --enable-deterministic-inference is on (its kernels pick a tactic per shape)", False),
    ("rank1_workspace_fails", "rank 1: the workspace failed: RuntimeError: cudaIpcOpenMemHandle failed", True)])
def test_one_rank_off_turns_every_rank_off_without_a_hang(result, case, why, built):
    assert result["server_fields"] == []  # the blockers are read by the real ServerArgs' field names
    for r in _ranks(result, case).values():
        assert r["agreed_at_start"] != (case in ("rank3_no_graphs", "rank1_deterministic"))  # a blocker: at the start
        assert r["disabled"] and not r["agreed"] and r["max_numel"] == 0
        # nobody entered the workspace's collective alone: all or none
        assert sum(call[0] == "init" for call in r["calls"]) == (1 if built else 0)
        assert not any(call[0] in ("prepare", "all_reduce") for call in r["calls"])
        warnings = _warnings(r)
        assert len(warnings) == 1
        assert warnings[0].startswith(f"PCIe-IPC allreduce is off on all 4 ranks because {why}")
        assert "unset SGLANG_ENABLE_PCIE_IPC_ALLREDUCE" in warnings[0]


def test_a_tune_cache_one_rank_sees_is_used_by_none(result):
    for r in _ranks(result, "rank2_tune_cache").values():
        assert not r["disabled"] and r["tune_cache"] == "/dev/null"
        assert r["calls"][0][-1] == "/dev/null"
        w = _warnings(r)
        assert len(w) == 1 and w[0].startswith("PCIe-IPC allreduce: the ranks see different tune caches")
        assert w[0].endswith("every rank runs the seed configurations.")


def test_tune_cache_absent_tuned_matched_refused(result):
    mod = "python -m sglang.srt.pcie_ipc_tune"
    for r in _ranks(result, "cache_absent").values():
        assert r["tune_cache"] == "/dev/null" and not r["disabled"]
        w = _warnings(r)
        assert len(w) == 1 and w[0].startswith("PCIe-IPC allreduce: SGLANG_PCIE_IPC_TUNE=cache, but no tune cache "
                                               "exists at ") and w[0].endswith("sglang_pcie_ipc_ws4.json; running the "
                                               f"seed configurations. Tune for this server: {mod} --tp 4 --hidden "
                                               "7168 --rows 3,6,12,24 --pin-clocks MHZ")
    tuned = _ranks(result, "tune")
    for r in tuned.values():
        tunes = [c for c in r["calls"] if c[0] == "tune"]
        assert len(tunes) == 1 and tunes[0][1] == [7168] and tunes[0][2].endswith("/sglang_pcie_ipc_ws4.json")
        assert r["calls"][0][-1] == "/dev/null"  # built seed, then tuned into the cache
        assert r["tune_cache"] == tunes[0][2]
    for r in _ranks(result, "cache_match").values():
        assert r["tune_cache"].endswith("/sglang_pcie_ipc_ws4.json") and r["calls"][0][-1] == r["tune_cache"]
        assert _warnings(r) == []
    for r in _ranks(result, "cache_other_width").values():
        assert r["tune_cache"] == "/dev/null" and r["max_numel"] == 25 * 7168
        w = _warnings(r)
        assert len(w) == 1 and f"'max_numel': {NUMEL}" in w[0] and f"'max_numel': {25 * 7168}" in w[0]
        assert "--rows 3,6,12,24,25 --max-numel 179200" not in w[0] and "--rows 3,6,12,24,25 " in w[0]


@pytest.mark.parametrize("case,why", [
    ("cache_replaced", "sglang_pcie_ipc_ws4.json.key was written for another cache (sha256 differs: "),
    ("cache_key_fifo", "sglang_pcie_ipc_ws4.json.key (not a regular file)")])
def test_a_key_that_does_not_name_its_cache_is_seed_with_one_warning(result, case, why):
    for r in _ranks(result, case).values():  # a FIFO key: no rank hangs at start
        assert r["tune_cache"] == "/dev/null" and not r["disabled"] and r["calls"][0][-1] == "/dev/null"
        w = _warnings(r)
        assert len(w) == 1 and w[0].startswith("PCIe-IPC allreduce: SGLANG_PCIE_IPC_TUNE=cache, but ") and why in w[0]
        assert "running the seed configurations" in w[0]


def test_an_unknown_tune_value_warns_once_and_is_seed(result):
    ranks = _ranks(result, "rank0_unknown_tune")
    for r in ranks.values():
        assert not r["disabled"] and r["tune_cache"] == "/dev/null"
    assert _warnings(ranks["0"]) == ["SGLANG_PCIE_IPC_TUNE='auto' is not one of 0|seed, cache, 1|tune; using the "
                                     "seed launch configurations."]
    assert _warnings(ranks["1"]) == []


def test_a_tune_at_start_that_fails_or_misses_a_bucket_leaves_no_key_that_matches(result):
    """Issue 52: with an older cache for another workspace at the path, a tune at start that raises, or
    whose saved cache lacks a served bucket, writes no key: SGLANG_PCIE_IPC_TUNE=cache refuses it after."""
    assert result["tune_fails_state"][0] != "match" and "'max_numel': 179200" in result["tune_fails_state"][0]
    assert result["tune_fails_state"][1] == "match"  # the older cache is still its own workspace's
    for r in _ranks(result, "tune_fails").values():
        assert _warnings(r) == ["PCIe-IPC autotune failed (CUDA error: an illegal memory access was encountered); "
                                "keeping the seed policy."]
    assert result["tune_partial_state"] != "match"
    ranks = _ranks(result, "tune_partial")
    w = _warnings(ranks["0"])
    assert len(w) == 1 and w[0].startswith("PCIe-IPC autotune left ") and w[0].endswith(
        "sglang_pcie_ipc_ws4.json without every bucket (entries for [3, 6] of buckets [3, 6, 12, 24]); no key "
        "written, so SGLANG_PCIE_IPC_TUNE=cache will not use it.")
    assert not [m for lvl, m in ranks["0"]["log"] if "tuned" in m and "shapes into" in m]


def test_a_cache_flashinfer_loads_nothing_from_is_named_seed(result):
    """The hollow cache of 2026-12-06: its key matches, flashinfer loads no entry for this workspace,
    so every shape runs the seed; the start-up line says seed, with one warning and the step to run."""
    ranks = _ranks(result, "cache_loads_nothing")
    for r in ranks.values():
        assert not r["disabled"] and r["tune_cache"].endswith("/sglang_pcie_ipc_ws4.json")
        assert r["calls"][0][-1] == r["tune_cache"]  # the workspace was built with the cache
        w = _warnings(r)
        assert len(w) == 1 and w[0].startswith("PCIe-IPC allreduce: flashinfer loaded no entry for this workspace "
                                               "from ") and w[0].endswith(
            "sglang_pcie_ipc_ws4.json; running the seed configurations. Tune again: python -m "
            "sglang.srt.pcie_ipc_tune --tp 4 --hidden 7168 --rows 3,6,12,24 --pin-clocks MHZ")
    info = [m for lvl, m in ranks["0"]["log"] if lvl == "INFO" and m.startswith("PCIe-IPC allreduce on 4 GPUs")]
    assert len(info) == 1 and "; seed launch configurations (SGLANG_PCIE_IPC_TUNE;" in info[0]
    match = [m for lvl, m in _ranks(result, "cache_match")["0"]["log"] if m.startswith("PCIe-IPC allreduce on")]
    assert len(match) == 1 and "; cache launch configurations (SGLANG_PCIE_IPC_TUNE;" in match[0]
