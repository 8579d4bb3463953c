"""PCIe-IPC in the kernel tier as P5 serves it (issue 36), the real tier on CPU: the worker under
torchrun (gloo, 2 ranks) with a recording stand-in for flashinfer's workspace (what needs CUDA),
P5's own module from patches/0005, and tunes that hang, raise or abort. The table, verdict, keys
and clocks without a world: tests/test_kernel_pcie_ipc_tune.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglpatch.gpu import regress
from sglpatch.gpu.kernel import launch as kernel_launch
from test_kernel_pcie_ipc_tune import SERVED, fake_smi, p5_source, smi_calls

ROOT = Path(__file__).resolve().parents[1]
SHIM_B = ROOT / "tests" / "shims" / "kb_install_b"


def test_a_seed_leg_after_a_tune_in_one_process_is_refused(tmp_path):
    """The autotuner keeps a tune's winners in memory: by hand, in that order, the worker says so."""
    out = tmp_path / "kb.json"
    cmd = [interpreter(tmp_path, with_p5=False), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(tmp_path / "torchelastic"), "-m", "sglpatch.gpu.kernel.bench",
           "--device", "cpu", "--hidden", "64", "--sizes", "3", "--samples", "2",
           "--inner", "2", "--pcie-ipc-rows", "3", "--backends", "pcie_ipc_tuned,pcie_ipc", "--out", str(out),
           "--scratch-dir", str(tmp_path)]
    env = kernel_launch.worker_env(dict(os.environ, OMP_NUM_THREADS="1", SGLPATCH_RECORD_WS=str(tmp_path / "ws.jsonl")))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["absent"] == {"pcie_ipc": "a tuned leg ran earlier in this process and flashinfer's autotuner keeps its "
                                         "winners in memory: this would not be the seed leg (run pcie_ipc first)"}
    assert {x["backend"] for x in doc["results"]} == {"pcie_ipc_tuned"}



RECORDER = '''
import itertools as _it, json as _json, os as _os, time as _time
_Base, _ids = PcieIpcAllReduceWorkspace, _it.count()
def _record(event, **kw):
    with open(_os.environ["SGLPATCH_RECORD_WS"], "a") as f:
        f.write(_json.dumps({"event": event, "rank": dist.get_rank(), "t": _time.time(), **kw}) + "\\n")
class PcieIpcAllReduceWorkspace(_Base):
    """Records what it is handed; SGLPATCH_STANDIN_TUNE=hang|raise|abort misbehaves in tune();
    SGLPATCH_STANDIN_SEED_SLEEP_S slows every reduction of a workspace that was not tuned."""
    def __init__(self, group, max_numel, dtype=torch.bfloat16, max_blocks=36, profile=None, tune_batches=None,
                 tune_cache=None):
        self._id, self._tuned_here = next(_ids), False
        _record("init", ws=self._id, max_numel=max_numel, tune_batches=list(tune_batches), tune_cache=tune_cache,
                group_size=dist.get_world_size(group), autotune_dir=_os.environ.get("FLASHINFER_AUTOTUNE_DIR"))
        super().__init__(group, max_numel, dtype, max_blocks, profile, tune_batches, tune_cache)
    def tune(self, hiddens, *, dtype=torch.bfloat16, cache=None, tune_group=None, **kw):
        _record("tune", ws=self._id, hiddens=list(hiddens), cache=cache, tune_group_size=dist.get_world_size(tune_group))
        how = _os.environ.get("SGLPATCH_STANDIN_TUNE", "")
        while how == "hang":
            _time.sleep(1)
        if how == "raise_abort_at_exit":  # a CUDA error: the interpreter's teardown aborts too
            __import__("atexit").register(_os.abort)
        if how.startswith("raise"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in)")
        if how == "abort":
            _os.abort()
        out = super().tune(hiddens, dtype=dtype, cache=cache, tune_group=tune_group, **kw)
        self._tuned_here = True
        return out
    def prepare(self, shapes, *, dtype=torch.bfloat16):
        _record("prepare", ws=self._id, shapes=[list(s) for s in shapes])
        return super().prepare(shapes, dtype=dtype)
    def all_reduce(self, inp, **kw):
        if _os.environ.get("SGLPATCH_STANDIN_SEED_SLEEP_S") and not self._tuned_here:
            _time.sleep(float(_os.environ["SGLPATCH_STANDIN_SEED_SLEEP_S"]))
        return super().all_reduce(inp, **kw)
'''

P5_RECORDER = '''
_p5_width = pcie_ipc_width
def pcie_ipc_width(rows, hidden, override):
    out = _p5_width(rows, hidden, override)
    with open(os.environ["SGLPATCH_RECORD_WS"], "a") as f:
        f.write(json.dumps({"event": "p5_width", "rank": int(os.environ["RANK"]), "args": [list(rows), hidden, override],
                            "out": [out[0], list(out[1]), out[2]]}) + "\\n")
    return out
'''


def interpreter(tmp_path: Path, with_p5: bool) -> str:
    """This Python with the recording stand-in of flashinfer (and P5's real module in a bare
    sglang tree, when with_p5) in front of its path."""
    rec = tmp_path / "rec"
    shutil.copytree(SHIM_B, rec)
    with open(rec / "flashinfer" / "comm" / "pcie_ipc_ar.py", "a") as f:
        f.write(RECORDER)
    path = str(rec)
    if with_p5:
        comm = tmp_path / "p5" / "sglang" / "srt" / "distributed" / "device_communicators"
        comm.mkdir(parents=True)
        for d in (comm, comm.parent, comm.parent.parent, comm.parent.parent.parent):
            (d / "__init__.py").touch()
        (comm.parent.parent / "environ.py").write_text("envs = None  # P5's module reads it only when serving\n")
        (comm / "pcie_ipc_allreduce.py").write_text(p5_source() + P5_RECORDER)
        path += f":{tmp_path / 'p5'}"
    py = tmp_path / "venv" / "bin" / "python3"
    py.parent.mkdir(parents=True)
    py.write_text(f"#!/bin/sh\nPYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return str(py)


def run_tier(tmp_path: Path, monkeypatch, extra: str = "", with_p5: bool = False, lgc_rc: int = 0, step: int = 60,
             nccl: bool = True):
    """The kernel tier on CPU with this profile; nccl=False: PCIe-IPC's legs alone (the NCCL launch is
    one torchrun world more, 6 CPU-s, and nothing a tuned leg does reaches it: the tests with it show that)."""
    monkeypatch.setenv("SGLPATCH_RECORD_WS", str(tmp_path / "ws.jsonl"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # whatever writes to ~/.cache shows there
    (tmp_path / "tmpdir").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))  # what the tier's processes leave in TMPDIR shows there
    smi, smi_log = fake_smi(tmp_path, lgc_rc)
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "targets" / "t.toml").write_text(textwrap.dedent(f"""
        [kernel]
        python = "{interpreter(tmp_path, with_p5)}"
        device = "cpu"
        world_size = 2
        hidden = 64
        sizes = [1, 3, 8]
        backends = {'["nccl", "pcie_ipc"]' if nccl else '["pcie_ipc"]'}
        required_backends = {'["nccl"]' if nccl else '[]'}
        p2p_disabled_run = false
        samples = 3
        inner = 2
        timeout_s = 240
        step_timeout_s = {step}
        pcie_ipc_max_rows = 4
        nvidia_smi = "{smi}"
        """) + textwrap.dedent(extra))
    res = regress.run_regress("kernel", "t", str(tmp_path / "r"), str(proj))
    k = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]
    rec = [json.loads(ln) for ln in (tmp_path / "ws.jsonl").read_text().splitlines()] if (tmp_path / "ws.jsonl").exists() else []
    return res, k, rec, smi_calls(smi_log), (tmp_path / "r" / "report.md").read_text()


def graph(k: dict, backend: str) -> dict[int, float]:
    return {r["rows"]: r["median_us"] for r in k["results"] if r["backend"] == backend and r["mode"] == "graph"}


def test_default_serves_p5s_buckets_with_seed_configurations_and_tunes_nothing(tmp_path, monkeypatch):
    res, k, rec, smi, md = run_tier(tmp_path, monkeypatch, "pcie_ipc_rows = [3, 6, 12, 24]\n", with_p5=True)
    assert res["exit_code"] == 0, k["failures"]
    r0 = [e for e in rec if e["rank"] == 0]
    # P5's own pcie_ipc_width, handed the served rows; the workspace gets exactly its answer
    assert [e["event"] for e in r0] == ["p5_width", "init", "prepare"]
    assert r0[0]["args"] == [SERVED, 64, None] and r0[0]["out"] == [1536, SERVED, "widest captured reduction 24 rows"]
    init = r0[1]
    assert (init["tune_batches"], init["max_numel"], init["tune_cache"], init["group_size"]) == (SERVED, 24 * 64, os.devnull, 2)
    assert init["autotune_dir"] == str(tmp_path / "r" / "scratch" / "flashinfer-autotune")
    assert r0[2]["shapes"] == [[n, 64] for n in range(1, 25)]  # every admitted row count, as P5 prepares
    assert {e["rank"] for e in rec if e["event"] == "init"} == {0, 1} and not any(e["event"] == "tune" for e in rec)
    info = k["installs"][0]["backend_info"]["pcie_ipc"]
    p5_file = tmp_path / "p5" / "sglang" / "srt" / "distributed" / "device_communicators" / "pcie_ipc_allreduce.py"
    assert info["how"] == (f"as P5 serves it: P5's own pcie_ipc_width ({p5_file}); widest captured reduction 24 rows; "
                           "buckets [3, 6, 12, 24]; workspace over the CPU group; seed launch configurations "
                           "(SGLANG_PCIE_IPC_TUNE=seed)")
    assert "+ P5" in k["installs"][0]["label"]
    # every served shape measured (6, 12, 24 besides the sizes), nothing tuned, no cache anywhere
    assert {(r["rows"], r["status"]) for r in k["results"] if r["backend"] == "pcie_ipc"} == \
        {(n, "ok") for n in (1, 3, 6, 8, 12, 24)}
    assert "pcie_ipc_tuned" not in {r["backend"] for r in k["results"]} and smi == []
    assert [L["backends"] for L in k["launches"]] == [["nccl", "pcie_ipc"]]
    assert not (tmp_path / "r" / "scratch" / "flashinfer-autotune").exists() and not (tmp_path / "home").exists()
    assert sorted(os.listdir(tmp_path / "tmpdir")) == []  # torchrun's logs went to the report's scratch
    assert (tmp_path / "r" / "scratch" / "torchelastic").is_dir()
    t = k["pcie_ipc_tune"]
    seed = graph(k, "pcie_ipc")
    x = t["installs"][0]
    assert (t["asked"], t["served_rows"], x["buckets"], x["max_numel"]) == (False, SERVED, SERVED, 1536)
    assert x["table"] == [{"rows": n, "seed_us": seed[n], "tuned_us": None, "tuned_over_seed": None} for n in SERVED]
    assert x["verdict"] is None and "pcie_ipc_tune = false, the default" in x["no_verdict"]
    assert x["clocks"]["line"] == "clocks were not pinned (no tuned leg)"
    for n in SERVED:
        assert f"| {n} | {seed[n]:.1f} | — | — |" in md
    assert "Verdict" not in md and "Clocks: clocks were not pinned" in md


def test_tuned_leg_on_the_same_buckets_seed_first_clocks_pinned_around_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLPATCH_STANDIN_SEED_SLEEP_S", "0.01")  # the seed configurations are the slow ones here
    res, k, rec, smi, md = run_tier(tmp_path, monkeypatch, "pcie_ipc_rows = [3, 6, 12, 24]\npcie_ipc_tune = true\n"
                                    "pin_clocks_mhz = 1500\n")
    assert res["exit_code"] == 0, k["failures"]
    assert [(L["backends"]) for L in k["launches"]] == [["nccl"], ["pcie_ipc", "pcie_ipc_tuned"]]
    r0 = [e for e in rec if e["rank"] == 0]
    assert [(e["event"], e["ws"]) for e in r0] == [("init", 0), ("prepare", 0), ("init", 1), ("tune", 1), ("prepare", 1)]
    folder = tmp_path / "r" / "scratch" / "flashinfer-autotune"
    for init in (r0[0], r0[2]):  # both legs: the same width and buckets, a seed start reading no cache
        assert (init["tune_batches"], init["max_numel"], init["tune_cache"]) == (SERVED, 1536, os.devnull)
    tune = [e for e in rec if e["event"] == "tune"]
    assert [(e["rank"], e["hiddens"], e["cache"], e["tune_group_size"]) for e in sorted(tune, key=lambda e: e["rank"])] == \
        [(r, [64], str(folder / "pcie_ipc_tuned_ws2.json"), 2) for r in (0, 1)]
    assert json.loads((folder / "pcie_ipc_tuned_ws2.json").read_text())["batches"] == SERVED
    info = k["installs"][0]["backend_info"]
    assert info["pcie_ipc_tuned"]["tuned"] is True and info["pcie_ipc"]["tuned"] is False
    assert info["pcie_ipc"]["how"].startswith("as P5 serves it: P5's width rule inline (sglang's pcie_ipc_allreduce "
                                              "does not import here: ModuleNotFoundError: No module named 'sglang')")
    # clocks: pinned before the launch's first workspace, reset after its last event
    assert [r for _, r in smi] == ["-i 0,1 -lgc 1500,1500", "-i 0,1 -rgc"]
    assert smi[0][0] < min(e["t"] for e in rec) and smi[1][0] > max(e["t"] for e in rec)
    # the table: the measured graph medians, handed on; the verdict by the rule, worked here
    seed, tuned = graph(k, "pcie_ipc"), graph(k, "pcie_ipc_tuned")
    x = k["pcie_ipc_tune"]["installs"][0]
    assert x["table"] == [{"rows": n, "seed_us": seed[n], "tuned_us": tuned[n], "tuned_over_seed": round(tuned[n] / seed[n], 3)}
                          for n in SERVED]
    faster = [n for n in SERVED if seed[n] - tuned[n] > 0.15 * seed[n]]
    assert faster == SERVED  # 10 ms of sleep per seed op
    at = ", ".join(f"{n} rows ({tuned[n] / seed[n]:.3f})" for n in SERVED)
    want = (f"keep: tuned is faster than seed by more than 15% at {at}: run the tuning step (`python -m "
            "sglang.srt.pcie_ipc_tune --tp 2 --hidden 64 --rows 3,6,12,24 --pin-clocks "
            "1500`) and serve with SGLANG_PCIE_IPC_TUNE=cache")
    assert x["verdict"] == want and f"**Verdict: {want}**" in md
    assert x["clocks"]["line"].startswith("clocks pinned at 1500 MHz") and "Clocks: clocks pinned at 1500 MHz" in md
    for n in SERVED:
        assert f"| {n} | {seed[n]:.1f} | {tuned[n]:.1f} | {tuned[n] / seed[n]:.3f} |" in md
    assert {c["backend"] for c in k.get("decision", {}).get("candidates", [])} <= {"nccl", "pcie_ipc", "pcie_ipc_tuned"}


@pytest.mark.parametrize("how", ["hang", "raise", "raise_abort_at_exit", "abort"])
def test_a_tune_that_fails_or_hangs_is_one_line_and_never_the_tier(tmp_path, monkeypatch, how):
    """A hang (the worst) beside the NCCL launch; the other three in PCIe-IPC's launch alone."""
    monkeypatch.setenv("SGLPATCH_STANDIN_TUNE", how)
    nccl = how == "hang"
    res, k, rec, smi, md = run_tier(tmp_path, monkeypatch, "pcie_ipc_rows = [3, 6, 12, 24]\npcie_ipc_tune = true\n"
                                    "pin_clocks_mhz = 1500\n", step=4 if how == "hang" else 60, nccl=nccl)
    assert res["exit_code"] == 0 and k["failures"] == []
    line = k["errors"]["pcie_ipc_tuned"]
    if how == "hang":
        assert line.startswith("launch exited 1 in this backend (log kernel-pcie_ipc.log): [kernel_bench] HANG rank ")
        assert line.endswith("(step timeout 4 s) in pcie_ipc_tuned: set-up") and k["installs"][0]["hung"] == ["pcie_ipc_tuned"]
    elif how.startswith("raise"):  # the first line stays the one: the launch's own exit 1 after its result is not
        assert line == "RuntimeError: CUDA error: an illegal memory access was encountered (stand-in)"
        assert k["launches"][-1]["rc"] == (1 if how == "raise_abort_at_exit" else 0)
    else:  # torchrun's last word, not its closing rule
        assert line.startswith("launch exited 1 in this backend (log kernel-pcie_ipc.log): traceback : Signal 6 (SIGABRT)")
    assert "\n" not in line and [L["backends"] for L in k["launches"]] == [["nccl"]] * nccl + [["pcie_ipc", "pcie_ipc_tuned"]]
    assert all(L["survivors"] == [] for L in k["launches"])
    assert {r["status"] for r in k["results"] if r["backend"] == "pcie_ipc"} == {"ok"}
    assert not any(r["backend"] == "pcie_ipc_tuned" for r in k["results"])
    x = k["pcie_ipc_tune"]["installs"][0]
    assert x["verdict"] is None and x["no_verdict"] == f"no verdict: the tuned leg has no data at the served rows; pcie_ipc_tuned: {line}"
    assert [r for _, r in smi] == ["-i 0,1 -lgc 1500,1500", "-i 0,1 -rgc"]  # reset also after a hang or a crash
    assert f"- pcie_ipc_tuned: {line}" in md and "Verdict" not in md


def test_clocks_that_cannot_be_pinned_leave_the_tuned_leg_out(tmp_path, monkeypatch):
    res, k, rec, smi, md = run_tier(tmp_path, monkeypatch, "pcie_ipc_tune = true\npin_clocks_mhz = 1500\n", lgc_rc=9, nccl=False)
    assert res["exit_code"] == 0 and k["failures"] == []
    assert k["errors"]["pcie_ipc_tuned"] == (f"not run: `{tmp_path / 'nvidia-smi'} -i 0,1 -lgc 1500,1500` failed (exit 9: "
                                             "Setting locked GPU clocks is not supported); clocks were not pinned")
    assert [L["backends"] for L in k["launches"]] == [["pcie_ipc"]] and not any(e["event"] == "tune" for e in rec)
    assert [r for _, r in smi] == ["-i 0,1 -lgc 1500,1500", "-i 0,1 -rgc"]
    # no rows given: one bucket at pcie_ipc_max_rows, the width
    init = next(e for e in rec if e["event"] == "init")
    assert (init["tune_batches"], init["max_numel"]) == ([4], 256) and k["pcie_ipc_tune"]["served_rows"] == [4]
    assert k["pcie_ipc_tune"]["installs"][0]["verdict"] is None
    assert "(no `[kernel] pcie_ipc_rows`: one row count, `pcie_ipc_max_rows`" in md
