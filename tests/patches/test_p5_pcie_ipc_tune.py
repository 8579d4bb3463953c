"""P5's tuning step (``python -m sglang.srt.pcie_ipc_tune``):
one line and the right exit code, and a failure writes nothing.

Its real ``main`` runs in the patched venv and starts its real ranks (spawned processes on a
real gloo group), which build the workspace through the server's own ``build_workspace`` and check
the saved cache with its ``tuned_buckets``. Stand-ins only for what needs a GPU or root, from a
folder put first on PYTHONPATH and PATH: flashinfer's ``PcieIpcAllReduceWorkspace`` (records its
arguments; a gloo barrier for its collectives; told by STANDIN_TUNE to fail, die or hang in
``tune()`` on one rank, while the others spin as a rank does in an IPC kernel whose peer is gone,
with no timeout; STANDIN_COVER: which buckets its saved cache holds an entry for), the names of its
autotuner and tuning module that ``tuned_buckets`` keys entries with (their key format: the real
one is checked against flashinfer 0.7.2 in test_p5_flashinfer_real.py) and its cache folder;
torch.cuda's device queries (set by the test in the parent), ``set_device``, ``Event`` and a CUDA
``randn`` (sitecustomize.py, in the ranks); and ``nvidia-smi``, a script that logs its calls. The
read-only cache folder is read-only for an unprivileged user (the test drops to nobody when it
runs as root, for whom no mode bit is read-only).

Without torch: the step is ``sglang.srt.pcie_ipc_tune``, outside ``sglang.srt.distributed`` (whose
``__init__`` imports torch): ``python -m`` of it runs in a fresh process where torch does not
import (``--help``, the usage errors, its torch check).
"""

from __future__ import annotations

import hashlib
import json

import pytest

STANDIN = {
    "sitecustomize.py": r'''
import os
if os.environ.get("STANDIN_CUDA") == "1":  # a rank: what needs a GPU, on the CPU
    import time
    import torch

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None
        def record(self, stream=None):
            self.t = time.perf_counter()
        def synchronize(self):
            pass
        def elapsed_time(self, end):
            return (end.t - self.t) * 1000.0

    _randn = torch.randn
    torch.randn = lambda *shape, device=None, **kw: _randn(*shape, **kw)
    torch.cuda.Event = Event
    torch.cuda.set_device = lambda device: None
''',
    "flashinfer/__init__.py": "",
    "flashinfer/comm/__init__.py": "",
    "flashinfer/comm/pcie_ipc_tuning.py": r'''
import os
PCIE_IPC_CUSTOM_OP = "flashinfer::pcie_ipc_all_reduce"
def default_cache_path(world_size):
    return os.path.join(os.environ["STANDIN_CACHE_DIR"], f"pcie_ipc_all_reduce_ws{world_size}.json")
class PcieIpcAllReduceRunner:
    def __init__(self, workspace):
        self._ws = workspace
def cache_key_extras(world_size, profile, max_blocks, max_numel, dtype, memop_supported=False):
    return (3, world_size, profile, max_blocks, max_numel, str(dtype))
def pcie_ipc_tuning_config(batches):
    return batches
''',
    "flashinfer/autotuner.py": r'''
import types
class AutoTuner:
    @classmethod
    def _get_cache_key(cls, op, runner, shapes, config, extras):
        return types.SimpleNamespace(file_key=str((op, type(runner).__name__, shapes, extras)))
''',
    "flashinfer/comm/pcie_ipc_ar.py": r'''
import json, os, signal, time
import torch.distributed as dist

class PcieIpcAllReduceWorkspace:
    def __init__(self, group, max_numel, dtype, tune_batches, tune_cache):
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.max_numel, self.max_blocks, self.profile, self.memop_supported = max_numel, 36, "rootcplx", False
        self.dtype, self.tune_batches = dtype, tune_batches
        log = os.environ["STANDIN_LOG"]
        with open(os.path.join(log, f"{self.rank}.init.json"), "w") as f:
            json.dump({"max_numel": max_numel, "dtype": str(dtype), "tune_batches": list(tune_batches),
                       "tune_cache": tune_cache}, f)
        with open(os.path.join(log, f"{self.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        dist.barrier(group)
    def launch_config(self, inp):
        return ("seed", inp.shape[0])
    def tuned_launch_config(self, inp):
        return ("tuned", inp.shape[0])
    def all_reduce(self, inp, config=None):
        return inp
    def tune(self, hiddens, cache, tune_group):
        how = os.environ.get("STANDIN_TUNE", "")
        if how == f"fail{self.rank}":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if how == f"die{self.rank}":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang" or how[:4] in ("fail", "die"):
            time.sleep(90)  # in a kernel that waits for a peer: no timeout, no error
        dist.barrier(tune_group)
        if self.rank == 0:  # flashinfer: rank 0 saves the configs, an entry per bucket it measured
            from flashinfer.autotuner import AutoTuner
            from flashinfer.comm.pcie_ipc_tuning import (PCIE_IPC_CUSTOM_OP, PcieIpcAllReduceRunner,
                                                         cache_key_extras)
            cover = os.environ.get("STANDIN_COVER", "all")
            rows = self.tune_batches if cover == "all" else [int(r) for r in cover.split(",") if r]
            extras = cache_key_extras(self.world_size, self.profile, self.max_blocks, self.max_numel, self.dtype)
            saved = {AutoTuner._get_cache_key(PCIE_IPC_CUSTOM_OP, PcieIpcAllReduceRunner(self),
                                              ((r, hiddens[0]),), None, extras).file_key: [0, [1, 8, 512]]
                     for r in rows}
            with open(cache, "w") as f:
                json.dump(dict(saved, tag=os.environ.get("STANDIN_TAG", "")), f)
        return {}
    def destroy(self):
        pass
''',
    "bin/nvidia-smi": '#!/bin/sh\necho "$*" >> "$STANDIN_SMI_LOG"\n'
                      'case "$*" in *-lgc*) echo "Setting locked GPU clocks is not supported"; exit ${STANDIN_LGC_RC:-0};; esac\n',
}

CODE = r"""
import argparse, contextlib, glob, io, json, os, signal, sys, tempfile, threading, time
import torch
import sglang.srt.distributed.device_communicators.pcie_ipc_allreduce as m
import sglang.srt.pcie_ipc_tune as tune

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, also when started ignoring it
STANDIN = os.environ["STANDIN_DIR"]
WORK = tempfile.mkdtemp()
CACHE = os.path.join(WORK, "cache")  # flashinfer's folder, made by the step when it runs
LOG = os.path.join(WORK, "log")
NOBIN = os.path.join(WORK, "nobin")
os.makedirs(LOG); os.makedirs(NOBIN)
R, gpus = {}, [0]
torch.cuda.is_available = lambda: gpus[0] > 0  # what the parent asks of CUDA
torch.cuda.device_count = lambda: gpus[0]

def listing(folder):
    found = []
    for root, dirs, files in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, f), folder) for f in dirs + files]
    return sorted(found)

def prepare(name):
    for d in (os.path.join(WORK, "tmp-" + name), os.path.join(LOG, name)):
        os.makedirs(d, exist_ok=True)

def call(argv):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = tune.main(list(argv))
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # a traceback: recorded, as the other cases still run
            code = f"raised {type(e).__name__}: {e}"
    return code, err.getvalue(), out.getvalue()

def as_nobody(argv):  # root writes in any folder: the step's own call as a user who may not
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if os.geteuid() == 0:
                os.setuid(65534)
            res = call(argv)
        except BaseException as e:
            res = ["skip: " + repr(e), "", ""]
        os.write(writer, json.dumps(res).encode())
        os._exit(0)
    os.close(writer)
    res = json.loads(os.read(reader, 1 << 20).decode())
    os.waitpid(pid, 0)
    return res

def run(name, *argv, n_gpus=2, smi=True, env=None, interrupt=None, ranks=2, nobody=False):
    prepare(name)
    gpus[0] = n_gpus
    tmp = os.path.join(WORK, "tmp-" + name)
    saved = dict(os.environ)
    os.environ.update(TMPDIR=tmp, STANDIN_CUDA="1", STANDIN_CACHE_DIR=CACHE, STANDIN_LOG=os.path.join(LOG, name),
                      STANDIN_SMI_LOG=os.path.join(LOG, name + ".smi"),
                      PATH=os.path.join(STANDIN, "bin") if smi else NOBIN)
    os.environ.update(env or {})
    tempfile.tempdir = None
    if interrupt:
        def send():
            while len(glob.glob(os.path.join(LOG, name, "*.pid"))) < ranks:
                time.sleep(0.1)
            time.sleep(0.5)
            os.kill(os.getpid(), interrupt)
        threading.Thread(target=send, daemon=True).start()
    start = time.monotonic()
    code, err, out = (as_nobody if nobody else call)(argv)
    elapsed = time.monotonic() - start
    os.environ.clear(); os.environ.update(saved); tempfile.tempdir = None
    pids = [int(open(p).read()) for p in glob.glob(os.path.join(LOG, name, "*.pid"))]
    smi_log = os.path.join(LOG, name + ".smi")
    R[name] = {"code": code, "err": err.splitlines(), "out": out.splitlines(),
            "elapsed": elapsed, "tmp": listing(tmp), "cache": listing(CACHE) if os.path.isdir(CACHE) else None,
            "ranks": len(pids), "alive": [p for p in pids if os.path.exists(f"/proc/{p}")],
            "smi": open(smi_log).read().splitlines() if os.path.exists(smi_log) else []}
    save()
    return R[name]

def save():  # after each case: a step that kills this process leaves the cases before it
    with open(os.environ["RESULT_FILE"], "w") as f:
        json.dump(R, f)

def cache_files():
    return {f: open(os.path.join(CACHE, f)).read() for f in listing(CACHE)} if os.path.isdir(CACHE) else None

rows = ["--hidden", "7168", "--rows", "3,6"]
R["no_gpu"] = run("no_gpu", "--tp", "8", *rows, "--pin-clocks", "2100", n_gpus=0, smi=False)
R["few_gpus"] = run("few_gpus", "--tp", "8", *rows, "--clocks-pinned", n_gpus=2)
R["no_smi"] = run("no_smi", "--tp", "2", *rows, "--pin-clocks", "2100", smi=False)
saved = sys.modules.get("flashinfer.comm.pcie_ipc_ar")
sys.modules["flashinfer.comm.pcie_ipc_ar"] = None
R["no_flashinfer"] = run("no_flashinfer", "--tp", "2", *rows, "--clocks-pinned")
sys.modules.pop("flashinfer.comm.pcie_ipc_ar")
for name, argv in {"rows_zero_negative": ["--rows", "0,-3"], "rows_empty": ["--rows", "3,,6"],
                   "rows_text": ["--rows", "3,x"], "iters0": [*rows, "--iters", "0"],
                   "timeout0": [*rows, "--timeout", "0"], "hidden0": ["--hidden", "0", "--rows", "3"],
                   "devices_negative": [*rows, "--devices", "0,-1"], "pin0": [*rows, "--pin-clocks", "0"]}.items():
    argv = argv if "--hidden" in argv else ["--hidden", "7168", *argv]
    R[name] = run(name, "--tp", "2", *argv, *([] if "--pin-clocks" in argv else ["--clocks-pinned"]))
added, add_argument = [], argparse.ArgumentParser.add_argument
def recording(self, *names, **kw):
    added.append([names, kw.get("help")])
    return add_argument(self, *names, **kw)
argparse.ArgumentParser.add_argument = recording
code, _, out = call(["--help"])
argparse.ArgumentParser.add_argument = add_argument
R["help"] = {"code": code, "out": out, "undocumented": [names for names, text in added if not text]}
save()

open(os.path.join(WORK, "a-file"), "w").close()
R["cache_uncreatable"] = run("cache_uncreatable", "--tp", "2", *rows, "--pin-clocks", "2100",
                             env={"STANDIN_CACHE_DIR": os.path.join(WORK, "a-file", "cache")})
ro = tempfile.mkdtemp(dir="/tmp")  # a folder nobody may write, in one nobody reaches
os.chmod(ro, 0o755 if os.geteuid() == 0 else 0o555)
R["cache_readonly"] = run("cache_readonly", "--tp", "2", *rows, "--clocks-pinned", env={"STANDIN_CACHE_DIR": ro},
                          nobody=True)
R["cache_readonly"]["cache"] = listing(ro)
save()
os.chmod(ro, 0o755); os.rmdir(ro)
R["report_no_folder"] = run("report_no_folder", "--tp", "2", *rows, "--pin-clocks", "2100",
                            "--report", os.path.join(WORK, "no-folder", "report.json"))
R["report_folder"] = run("report_folder", "--tp", "2", *rows, "--clocks-pinned", "--report", WORK)
R["pin_fails"] = run("pin_fails", "--tp", "2", *rows, "--pin-clocks", "2100", env={"STANDIN_LGC_RC": "3"})

# with the ranks: a failing run first (nothing is there), then one that tunes, then failures after it
R["rank_dies"] = run("rank_dies", "--tp", "2", *rows, "--clocks-pinned", "--timeout", "300",
                     env={"STANDIN_TUNE": "die1"})
report = os.path.join(WORK, "report.json")
R["ok"] = run("ok", "--tp", "2", *rows, "--pin-clocks", "2100", "--iters", "3", "--report", report,
              env={"STANDIN_TAG": "first"})
R["ok"]["files"] = cache_files()
R["ok"]["report"] = json.load(open(report)) if os.path.exists(report) else None
path = os.path.join(CACHE, "sglang_pcie_ipc_ws2.json")
R["ok"]["state"] = m.tune_cache_state(path, m.tune_cache_key(2, 7168, 6 * 7168, (3, 6)))
R["ok"]["init"] = [json.load(open(os.path.join(LOG, "ok", f"{r}.init.json"))) for r in range(2)]
for name, cover in (("hollow", ""), ("partial", "3")):  # flashinfer saved no entry for every bucket
    R[name] = run(name, "--tp", "2", *rows, "--pin-clocks", "2100", "--iters", "3", "--report", report + name,
                  env={"STANDIN_COVER": cover, "STANDIN_TAG": name})
    R[name]["files"] = cache_files()
    R[name]["report"] = json.load(open(report + name)) if os.path.exists(report + name) else None
for name, n, env, sig in (("rank_fails", 4, {"STANDIN_TUNE": "fail1"}, None),
                          ("sigint", 2, {"STANDIN_TUNE": "hang"}, signal.SIGINT),
                          ("sigterm", 2, {"STANDIN_TUNE": "hang"}, signal.SIGTERM)):
    R[name] = run(name, "--tp", str(n), *rows, "--pin-clocks", "2100", "--iters", "3", "--timeout", "300",
                  n_gpus=n, env=dict(env, STANDIN_TAG=name), interrupt=sig, ranks=n)
    R[name]["files"] = cache_files()
    save()
"""

NO_TORCH = r"""
import sys
assert not [n for n in sys.modules if n == "torch" or n.startswith("torch.")]  # a fresh process
sys.modules["torch"] = None  # a venv without torch: import torch raises ImportError
import contextlib, io, json, runpy
R = {}
for name, argv in {"help": ["--help"], "rows": ["--tp", "2", "--hidden", "7168", "--rows", "0,-3", "--clocks-pinned"],
                   "run": ["--tp", "2", "--hidden", "7168", "--rows", "3,6", "--clocks-pinned"]}.items():
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["pcie_ipc_tune", *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("sglang.srt.pcie_ipc_tune", run_name="__main__")
        except SystemExit as e:
            code = e.code
    R[name] = {"code": code, "out": out.getvalue(), "err": err.getvalue().splitlines()}
R["torch_imported"] = sys.modules.get("torch") is not None
print("RESULT" + json.dumps(R))
"""


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.fixture(scope="module")
def result(run_patched, tmp_path_factory):
    standin = tmp_path_factory.mktemp("standin")
    for name, text in STANDIN.items():
        (standin / name).parent.mkdir(parents=True, exist_ok=True)
        (standin / name).write_text(text)
    (standin / "bin" / "nvidia-smi").chmod(0o755)
    saved = standin / "result.json"
    env = {"PYTHONPATH": str(standin), "STANDIN_DIR": str(standin), "RESULT_FILE": str(saved)}
    proc = run_patched(CODE, env=env, timeout=400)
    assert saved.is_file(), proc.stderr[-4000:]
    r = json.loads(saved.read_text())
    r["process"] = [proc.returncode, proc.stderr[-4000:]]  # SIGTERM unhandled: the cases after it are missing
    return r


@pytest.fixture(scope="module")
def no_torch(run_patched):
    # a PYTHON* variable of its own: a fresh interpreter, not a child of the zygote that imported torch
    return _result(run_patched(NO_TORCH, env={"PYTHONNOUSERSITE": "1"}, timeout=120))


def _one_line(r: dict, code: int, *parts: str) -> None:
    assert r["code"] == code, r
    assert len(r["err"]) == 1 and r["err"][0].startswith("error: "), r["err"]
    for part in parts:
        assert part in r["err"][0], (part, r["err"][0])


def _made_nothing(r: dict) -> None:
    """Nothing made, started or pinned: no cache folder, no temporary folder, no rank, no nvidia-smi."""
    assert r["cache"] is None and r["tmp"] == [] and r["ranks"] == 0 and r["smi"] == [], r


@pytest.mark.parametrize("case,why", [
    ("no_gpu", "cannot run here: --tp 8 runs on GPUs [0, 1, 2, 3, 4, 5, 6, 7], but torch sees 0 "),
    ("few_gpus", "cannot run here: --tp 8 runs on GPUs [0, 1, 2, 3, 4, 5, 6, 7], but torch sees 2 "),
    ("no_smi", "cannot run here: --pin-clocks runs nvidia-smi, which is not on PATH"),
    ("no_flashinfer", "cannot run here: flashinfer's PCIe-IPC allreduce does not import (ModuleNotFoundError: ")])
def test_cannot_run_here_is_one_line_and_125_before_anything_is_made(result, case, why):
    r = result[case]
    _one_line(r, 125, why, "nothing was tuned")
    _made_nothing(r)
    assert r["elapsed"] < 10  # not a deadline later


@pytest.mark.parametrize("case,why", [
    ("rows_zero_negative", "--rows 0,-3: the captured rows are positive integers, a,b,c"),
    ("rows_empty", "--rows 3,,6: the captured rows are positive integers"),
    ("rows_text", "--rows 3,x: the captured rows are positive integers"),
    ("iters0", "--iters 0: a positive integer is needed"),
    ("timeout0", "--timeout 0: a positive integer is needed"),
    ("hidden0", "--hidden 0: a positive integer is needed"),
    ("pin0", "--pin-clocks 0: a positive integer is needed"),
    ("devices_negative", "--devices 0,-1: CUDA device numbers, one a rank")])
def test_bad_arguments_are_one_line_and_2(result, case, why):
    _one_line(result[case], 2, why)
    _made_nothing(result[case])


def test_every_option_has_a_help_and_the_help_asks_for_pinned_clocks(result):
    h = result["help"]
    assert h["code"] == 0 and h["undocumented"] == []
    text = " ".join(h["out"].split())
    assert "Pinned clocks are required for a meaningful tune (--pin-clocks or --clocks-pinned)" in text
    assert "125 cannot run here" in text


def test_the_step_itself_needs_no_torch_for_help_or_usage(no_torch):
    assert no_torch["help"]["code"] == 0 and "--pin-clocks MHZ" in no_torch["help"]["out"]
    assert no_torch["rows"]["code"] == 2 and no_torch["rows"]["err"][0].startswith("error: --rows 0,-3: ")
    assert no_torch["run"]["code"] == 125 and len(no_torch["run"]["err"]) == 1
    assert no_torch["run"]["err"][0].startswith("error: cannot run here: torch does not import (")
    assert not no_torch["torch_imported"]


@pytest.mark.parametrize("case,why", [
    ("cache_uncreatable", "/a-file/cache: Not a directory; nothing was tuned"),
    ("cache_readonly", ": Permission denied; nothing was tuned"),
    ("report_no_folder", "/no-folder/report.json: its folder cannot be written (No such file or directory); "),
    ("report_folder", ": not a writable file; nothing was tuned")])
def test_an_unwritable_cache_folder_or_report_is_one_line_before_the_gpu_work(result, case, why):
    r = result[case]
    if str(r["code"]).startswith("skip: "):
        pytest.skip(f"cannot drop to an unprivileged user here: {r['code']}")
    _one_line(r, 1, why)
    assert r["tmp"] == [] and r["ranks"] == 0 and r["smi"] == [], r  # no rank started, no clock pinned
    assert r["cache"] in (None, [])


def test_a_failed_pin_is_one_line_and_reset(result):
    r = result["pin_fails"]
    _one_line(r, 1, "nvidia-smi -lgc failed: Setting locked GPU clocks is not supported; nothing was tuned")
    assert r["smi"] == ["-i 0,1 -lgc 2100,2100", "-i 0,1 -rgc"] and r["ranks"] == 0 and r["tmp"] == []
    assert r["cache"] == []  # the staging folder went too


def test_a_tuned_run_writes_the_cache_with_a_key_naming_its_bytes_and_cleans_up(result):
    r = result["ok"]
    assert r["code"] == 0, r
    assert r["err"] == ["tuning 2 buckets at TP 2 (deadline 1800 s)..."]
    assert r["out"][0].split() == ["rows", "seed", "us", "tuned", "us", "tuned/seed"]
    assert [line.split()[0] for line in r["out"][1:3]] == ["3", "6"]
    assert r["out"][-1].endswith("sglang_pcie_ipc_ws2.json (+ .key); serve with SGLANG_PCIE_IPC_TUNE=cache")
    assert sorted(r["files"]) == ["sglang_pcie_ipc_ws2.json", "sglang_pcie_ipc_ws2.json.key"]  # no staging left
    cache, key = r["files"]["sglang_pcie_ipc_ws2.json"], json.loads(r["files"]["sglang_pcie_ipc_ws2.json.key"])
    saved = json.loads(cache)
    assert saved.pop("tag") == "first" and len(saved) == 2  # an entry per bucket, as flashinfer saves them
    assert key["cache_sha256"] == hashlib.sha256(cache.encode()).hexdigest()
    assert {k: key[k] for k in ("world_size", "hidden", "max_numel", "buckets")} == {
        "world_size": 2, "hidden": 7168, "max_numel": 6 * 7168, "buckets": [3, 6]}
    assert r["state"] == "match"  # the server's check takes it
    assert r["report"]["rank0"][0]["rows"] == 3 and r["report"]["cache"].endswith("sglang_pcie_ipc_ws2.json")
    assert r["tmp"] == [] and r["alive"] == [] and r["ranks"] == 2
    assert r["smi"] == ["-i 0,1 -lgc 2100,2100", "-i 0,1 -rgc"]


def test_the_step_builds_the_servers_workspace(result):
    """The arguments the server's serve() builds with (test_p5_pcie_ipc_allreduce.py pins the same):
    a workspace built otherwise (another max_numel, dtype, max_blocks or buckets) tunes entries the
    server never looks up."""
    for init in result["ok"]["init"]:
        assert init == {"max_numel": 6 * 7168, "dtype": "torch.bfloat16", "tune_batches": [3, 6],
                        "tune_cache": "/dev/null"}


@pytest.mark.parametrize("case,missing", [("hollow", [3, 6]), ("partial", [6])])
def test_a_cache_without_every_served_bucket_is_one_line_and_writes_nothing(result, case, missing):
    """flashinfer's tune() returns and saves its cache, but with no entry for a bucket whose every
    candidate failed to profile ("Saved 0 configs" under MPS on 2026-12-06): the server would run
    the seed there while its line said "cache"."""
    r = result[case]
    assert r["code"] == 1, r
    assert r["err"][1:] == [
        f"error: flashinfer's tune() saved no entry for rows {missing} of buckets [3, 6] (every candidate "
        "failed to profile; FLASHINFER_LOGGING_LEVEL=DEBUG names why), so the server would run their seed "
        "configurations; nothing was written"], r["err"]
    assert r["files"] == result["ok"]["files"]  # the tuned cache and its key as they were
    assert r["report"]["error"].startswith("flashinfer's tune() saved no entry") and r["out"] == []
    assert r["tmp"] == [] and r["alive"] == [] and r["smi"] == ["-i 0,1 -lgc 2100,2100", "-i 0,1 -rgc"]


@pytest.mark.parametrize("case,code,why", [
    ("rank_dies", 1, "error: rank 1 died (SIGKILL); nothing was written"),
    ("rank_fails", 1, "error: rank 1 failed: RuntimeError: CUDA error: an illegal memory access was encountered; "
                      "nothing was written"),
    ("sigint", 130, "error: interrupted: the ranks were stopped; nothing was written"),
    ("sigterm", 130, "error: interrupted: the ranks were stopped; nothing was written")])
def test_a_failed_run_stops_every_rank_at_once_resets_the_clocks_and_writes_nothing(result, case, code, why):
    assert case in result, f"the tuning step's process ended: {result['process']}"
    r = result[case]
    assert r["code"] == code, r
    assert r["err"][1:] == [why], r["err"]  # after the progress line
    assert r["elapsed"] < 60  # at once, not at the deadline (300 s): the other ranks were waiting on it
    assert r["alive"] == [] and r["ranks"] == (4 if case == "rank_fails" else 2)
    assert r["tmp"] == []
    if case == "rank_dies":  # before any tuned run: the cache folder holds nothing, not even a staging folder
        assert r["cache"] == []
    else:  # after one: the tuned cache and its key as they were
        assert r["files"] == result["ok"]["files"]
        assert r["smi"][0].endswith("-lgc 2100,2100") and r["smi"][1:] == [r["smi"][0].split(" -lgc")[0] + " -rgc"]
