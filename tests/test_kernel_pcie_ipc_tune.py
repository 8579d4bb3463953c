"""PCIe-IPC in the kernel tier as P5 serves it (issue 36): buckets = the served rows, seed by
default, with `pcie_ipc_tune = true` a tuned leg against seed per served shape and a verdict.  The
table and verdict from figures, the profile keys, the launch plan, the clocks (a fake nvidia-smi),
and the real tier on CPU: the worker under torchrun (gloo, 2 ranks) with a recording stand-in for
flashinfer's workspace (what needs CUDA), P5's own module from patches/0005, and tunes that hang,
raise or abort."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from sglpatch.errors import SglpatchError
from sglpatch.gpu import regress
from sglpatch.gpu.kernel import launch as kernel_launch
from sglpatch.gpu.kernel import pcie_tune
from sglpatch.gpu.kernel.bench import ALL_BACKENDS, build_arg_parser
from sglpatch.gpu.kernel.microbench.pcie_ipc import pcie_ipc_width
from sglpatch.gpu.kernel.tier import stress_launch
from sglpatch.gpu.shared import profile as profiles

ROOT = Path(__file__).resolve().parents[1]
SHIM_B = ROOT / "tests" / "shims" / "kb_install_b"
TOPO = ROOT / "tests" / "fixtures" / "topo"
P5 = next((ROOT / "patches").glob("0005-*.patch"))
SERVED = [3, 6, 12, 24]  # a power-of-two ladder up to 24 would be 1, 2, 4, 8, 16, 24
SEED = {3: 10.0, 6: 12.0, 12: 16.0, 24: 20.0}
STEP = "python -m sglang.srt.distributed.device_communicators.pcie_ipc_tune --tp 8 --hidden 7168 --rows 3,6,12,24"


def rows_of(seed: dict, tuned: dict, install: str = "A") -> list[dict]:
    out = [{"backend": "nccl", "install": install, "mode": "graph", "rows": 3, "status": "ok", "median_us": 1.0}]
    for b, figs in (("pcie_ipc", seed), ("pcie_ipc_tuned", tuned)):
        for n, us in figs.items():
            out.append({"backend": b, "install": install, "mode": "graph", "rows": n, "status": "ok", "median_us": us})
            out.append({"backend": b, "install": install, "mode": "eager", "rows": n, "status": "ok", "median_us": 0.5})
    return out


def kernel(**extra) -> dict:
    return {"backends": ["nccl", "pcie_ipc"], "hidden": 7168, "tolerance": 0.15, "pcie_ipc_rows": SERVED,
            "pcie_ipc_tune": True, **extra}


def one(rows: list[dict], k: dict) -> dict:
    inst = {"key": "A", "label": "A: sglang 0.5.9 + P5", "errors": {}, "absent": {},
            "backend_info": {"pcie_ipc": {"rows": SERVED, "buckets": SERVED, "how": "as P5 serves it"}}}
    return pcie_tune.compare(rows, [inst], k, 8)["installs"][0]


def test_table_and_verdict_keep_when_tuned_beats_seed_beyond_the_tolerance():
    x = one(rows_of(SEED, {3: 8.4, 6: 11.9, 12: 16.2, 24: 19.0}), kernel())
    assert x["table"] == [{"rows": 3, "seed_us": 10.0, "tuned_us": 8.4, "tuned_over_seed": 0.84},
                          {"rows": 6, "seed_us": 12.0, "tuned_us": 11.9, "tuned_over_seed": 0.992},
                          {"rows": 12, "seed_us": 16.0, "tuned_us": 16.2, "tuned_over_seed": 1.012},
                          {"rows": 24, "seed_us": 20.0, "tuned_us": 19.0, "tuned_over_seed": 0.95}]
    assert x["no_verdict"] is None and x["verdict"] == (
        f"keep: tuned is faster than seed by more than 15% at 3 rows (0.840): run the tuning step (`{STEP} --pin-clocks MHZ`) "
        "and serve with SGLANG_PCIE_IPC_TUNE=cache")
    md = "\n".join(pcie_tune.markdown(pcie_tune.compare(rows_of(SEED, {3: 8.4}), [{"key": "A", "label": "A: x"}],
                                                         kernel(pin_clocks_mhz=2100), 8)))
    assert "| 3 | 10.0 | 8.4 | 0.840 |" in md and "| 6 | 12.0 | — | — |" in md
    assert f"**Verdict: keep: tuned is faster than seed by more than 15% at 3 rows (0.840): run the tuning step (`{STEP} " \
           "--pin-clocks 2100`)" in md
    assert "Served rows [3, 6, 12, 24] (`[kernel] pcie_ipc_rows`, the server's buckets)" in md


def test_seed_within_the_tolerance_at_every_served_shape_needs_no_tuning():
    x = one(rows_of(SEED, {3: 8.6, 6: 10.3, 12: 16.0, 24: 25.0}), kernel())
    assert [r["tuned_over_seed"] for r in x["table"]] == [0.86, 0.858, 1.0, 1.25]
    assert x["verdict"] == "seed is within tolerance (15%) at every served shape: no tuning needed (SGLANG_PCIE_IPC_TUNE=seed, the default)"
    # the tolerance is the profile's: 0.10 turns the same figures into keep at 3 and 6 rows
    assert one(rows_of(SEED, {3: 8.6, 6: 10.3, 12: 16.0, 24: 25.0}), kernel(tolerance=0.10))["verdict"].startswith(
        "keep: tuned is faster than seed by more than 10% at 3 rows (0.860), 6 rows (0.858): ")


def test_no_verdict_when_a_side_has_no_data():
    none_tuned = one(rows_of(SEED, {}), kernel())
    assert none_tuned["verdict"] is None and none_tuned["no_verdict"] == "no verdict: the tuned leg has no data at the served rows"
    assert [r["tuned_us"] for r in none_tuned["table"]] == [None] * 4
    none_seed = one(rows_of({}, {3: 1.0, 6: 1.0, 12: 1.0, 24: 1.0}), kernel())
    assert none_seed["verdict"] is None and none_seed["no_verdict"] == "no verdict: the seed leg has no data at the served rows"
    # half the shapes, none of them beyond the tolerance: nothing decides it
    part = one(rows_of(SEED, {3: 9.9, 6: 12.0}), kernel())
    assert part["verdict"] is None
    assert part["no_verdict"] == "no verdict: no seed and tuned pair at rows [12, 24], and none of the others decides it"
    # not asked for (the default): says so; a wrong or declined tuned row is no data either
    assert one(rows_of(SEED, {}), kernel(pcie_ipc_tune=False))["no_verdict"] == \
        "no verdict: the tuned leg was not asked for ([kernel] pcie_ipc_tune = false, the default)"
    wrong = [dict(r, status="wrong") if r["backend"] == "pcie_ipc_tuned" else r for r in rows_of(SEED, {3: 1.0})]
    assert one(wrong, kernel())["verdict"] is None
    md = "\n".join(pcie_tune.markdown(pcie_tune.compare(rows_of(SEED, {}), [{"key": "A", "label": "A"}], kernel(), 8)))
    assert "Verdict" not in md and "keep:" not in md and "seed is within" not in md
    assert "no verdict: the tuned leg has no data at the served rows." in md and "| 24 | 20.0 | — | — |" in md
    assert "Clocks: clocks were not pinned (no tuned leg)" in md


def test_profile_keys():
    s = pcie_tune.settings(kernel())
    assert s == {"rows": SERVED, "rows_given": True, "tune": True, "asked": True, "pin_mhz": None}
    d = profiles.load_profile(None)["kernel"]
    assert (d["pcie_ipc_rows"], d["pcie_ipc_tune"], d["pin_clocks_mhz"]) == (None, False, None)
    assert pcie_tune.settings({**d, "backends": ["pcie_ipc"], "pcie_ipc_max_rows": 16})["rows"] == [16]
    assert pcie_tune.settings({**d, "backends": ["pcie_ipc"]})["tune"] is False  # the default does not tune
    assert pcie_tune.settings(kernel(backends=["nccl"]))["tune"] is False  # no seed leg, no tuned leg
    target = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")["kernel"]
    assert (target["pcie_ipc_rows"], target["pcie_ipc_tune"], target["pin_clocks_mhz"]) == (SERVED, False, None)
    for bad in ({"pcie_ipc_rows": []}, {"pcie_ipc_rows": [3, 0]}, {"pcie_ipc_rows": "3,6"}, {"pcie_ipc_tune": "yes"},
                {"pin_clocks_mhz": -1}, {"backends": ["pcie_ipc", "pcie_ipc_tuned"]}):
        with pytest.raises(SglpatchError) as e:
            pcie_tune.settings(kernel(**bad))
        assert e.value.exit_code == 2


def test_launch_plan(tmp_path):
    prof = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    a, b = {"key": "A", "python": "/a"}, {"key": "B", "python": "/b"}
    ls = kernel_launch.kernel_launches(prof, 8, tmp_path, a, True)
    assert [L["name"] for L in ls] == ["main", "p2p_off", "default_env"] and "pcie_ipc" in ls[0]["backends"]
    cmd = ls[0]["cmd"]
    assert cmd[cmd.index("--pcie-ipc-rows") + 1] == "3,6,12,24" and "--pcie-ipc-max-rows" not in cmd
    prof["kernel"]["pcie_ipc_tune"] = True
    for interp, name in ((a, "pcie_ipc"), (b, "pcie_ipc-B")):
        ls = kernel_launch.kernel_launches(prof, 8, tmp_path, interp, interp is a)
        assert "pcie_ipc" not in ls[0]["backends"] and "nccl" in ls[0]["backends"]
        tuned = ls[-1]
        assert (tuned["name"], tuned["backends"], tuned["soft"], tuned["pin"]) == \
            (name, ["pcie_ipc", "pcie_ipc_tuned"], "pcie_ipc_tuned", True)
    stress = stress_launch(prof, 8, tmp_path, "py", 10)["cmd"]
    assert stress[stress.index("--pcie-ipc-rows") + 1] == "3,6,12,24"  # the stress run builds the served workspace too
    prof["kernel"]["pcie_ipc_rows"] = None
    cmd = kernel_launch.kernel_launches(prof, 8, tmp_path, a, True)[0]["cmd"]
    assert cmd[cmd.index("--pcie-ipc-max-rows") + 1] == "24" and "--pcie-ipc-rows" not in cmd
    assert "pcie_ipc" in ALL_BACKENDS and "pcie_ipc_tuned" not in ALL_BACKENDS  # by hand, the worker tunes nothing
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--out", "x", "--pcie-ipc-tune"])


def p5_source(name: str = "pcie_ipc_allreduce.py") -> str:
    """A file P5 creates, as the patch has it."""
    text = P5.read_text()
    start = text.index(f"+++ b/python/sglang/srt/distributed/device_communicators/{name}\n")
    body = text.index("\n", text.index("\n@@ ", start) + 1) + 1
    return "".join(line[1:] + "\n" for line in text[body:text.index("\ndiff --git", body)].split("\n"))


def test_the_inline_width_rule_is_p5s():
    tree = ast.parse(p5_source())
    ns: dict = {"Optional": typing.Optional, "Sequence": typing.Sequence, "Tuple": typing.Tuple}  # P5's names
    exec(compile(ast.Module([n for n in tree.body if isinstance(n, (ast.Assign, ast.FunctionDef)) and (
        getattr(n, "name", "") in ("pcie_ipc_max_numel", "pcie_ipc_width")
        or any(getattr(t, "id", "") == "PCIE_IPC_PACK_ELEMS" for t in getattr(n, "targets", [])))], []), str(P5), "exec"), ns)
    for args in ((SERVED, 7168, None), ([24, 3, 12, 6, 6], 7168, None), ([1, 2, 4, 8], 64, None), ([3], 7, None),
                 (SERVED, 7168, 57344), (SERVED, 7168, 100001), (SERVED, 7168, 3 * 7168), ([8], 7168, 7168),
                 ([3, 6], 7168, 24 * 7168)):  # an override wider than the rows: its own rows are a bucket too
        assert pcie_ipc_width(*args) == ns["pcie_ipc_width"](*args), args
    assert pcie_ipc_width(SERVED, 7168, None) == (24 * 7168, (3, 6, 12, 24), "widest captured reduction 24 rows")
    for args in (([], 7168, None), ([0, -3], 7168, None), (SERVED, 7168, 100)):
        with pytest.raises(ValueError) as mine:
            pcie_ipc_width(*args)
        with pytest.raises(ValueError) as theirs:
            ns["pcie_ipc_width"](*args)
        assert str(mine.value) == str(theirs.value)


def test_a_seed_leg_after_a_tune_in_one_process_is_refused(tmp_path):
    """The autotuner keeps a tune's winners in memory: by hand, in that order, the worker says so."""
    out = tmp_path / "kb.json"
    cmd = [interpreter(tmp_path, with_p5=False), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sglpatch.gpu.kernel.bench", "--device", "cpu", "--hidden", "64", "--sizes", "3", "--samples", "2",
           "--inner", "2", "--pcie-ipc-rows", "3", "--backends", "pcie_ipc_tuned,pcie_ipc", "--out", str(out),
           "--scratch-dir", str(tmp_path)]
    env = kernel_launch.worker_env(dict(os.environ, OMP_NUM_THREADS="1", SGLPATCH_RECORD_WS=str(tmp_path / "ws.jsonl")))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["absent"] == {"pcie_ipc": "a tuned leg ran earlier in this process and flashinfer's autotuner keeps its "
                                         "winners in memory: this would not be the seed leg (run pcie_ipc first)"}
    assert {x["backend"] for x in doc["results"]} == {"pcie_ipc_tuned"}


def fake_smi(tmp_path: Path, lgc_rc: int = 0) -> tuple[str, Path]:
    log = tmp_path / "smi.log"
    p = tmp_path / "nvidia-smi"
    p.write_text(f"#!/bin/sh\ncase \"$1\" in topo) case \"$2\" in -m) cat '{TOPO}/two-sockets-no-switch.txt';; "
                 f"-p2p) cat '{TOPO}/p2p-two-sockets-cns.txt';; esac;;\n"
                 f"-i) echo \"$(date +%s.%N) $*\" >> '{log}'; case \"$3\" in -lgc) [ {lgc_rc} = 0 ] || "
                 f"{{ echo 'Setting locked GPU clocks is not supported' >&2; exit {lgc_rc}; }};; esac;; esac\n")
    p.chmod(0o755)
    return str(p), log


def smi_calls(log: Path) -> list[tuple[float, str]]:
    return [(float(t), rest) for t, _, rest in (ln.partition(" ") for ln in log.read_text().splitlines())] \
        if log.exists() else []


def test_clocks_pinned_only_when_asked_and_always_reset(tmp_path):
    smi, log = fake_smi(tmp_path)
    with pcie_tune.clocks({"nvidia_smi": smi}, 2, {}) as c:
        assert c == {"pinned": False, "line": "clocks were not pinned (no [kernel] pin_clocks_mhz): the tune ranked "
                     "its candidates and both legs ran at the GPUs' own clocks"}
    assert smi_calls(log) == []
    with pytest.raises(RuntimeError), pcie_tune.clocks({"nvidia_smi": smi, "pin_clocks_mhz": 1500}, 2,
                                                       {"CUDA_VISIBLE_DEVICES": "4,5,6"}) as c:
        assert c["pinned"] and "error" not in c
        assert [r for _, r in smi_calls(log)] == ["-i 4,5 -lgc 1500,1500"]
        raise RuntimeError("the launch died")
    assert [r for _, r in smi_calls(log)] == ["-i 4,5 -lgc 1500,1500", "-i 4,5 -rgc"]
    assert "reset_error" not in c
    (tmp_path / "x").mkdir()
    smi, log = fake_smi(tmp_path / "x", lgc_rc=9)
    with pcie_tune.clocks({"nvidia_smi": smi, "pin_clocks_mhz": 1500}, 2, {}) as c:
        pass
    assert c["error"] == (f"not run: `{smi} -i 0,1 -lgc 1500,1500` failed (exit 9: Setting locked GPU clocks is not "
                          "supported); clocks were not pinned") and not c["pinned"]
    assert [r for _, r in smi_calls(log)] == ["-i 0,1 -lgc 1500,1500", "-i 0,1 -rgc"]  # reset whatever was set
    with pcie_tune.clocks({"nvidia_smi": str(tmp_path / "none"), "pin_clocks_mhz": 1500}, 2, {}) as c:
        pass
    assert c["error"].startswith("not run: ") and c["reset_error"].endswith("the clocks may still be pinned")


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


def run_tier(tmp_path: Path, monkeypatch, extra: str = "", with_p5: bool = False, lgc_rc: int = 0, step: int = 60):
    monkeypatch.setenv("SGLPATCH_RECORD_WS", str(tmp_path / "ws.jsonl"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # whatever writes to ~/.cache shows there
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
        backends = ["nccl", "pcie_ipc"]
        required_backends = ["nccl"]
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
            "sglang.srt.distributed.device_communicators.pcie_ipc_tune --tp 2 --hidden 64 --rows 3,6,12,24 --pin-clocks "
            "1500`) and serve with SGLANG_PCIE_IPC_TUNE=cache")
    assert x["verdict"] == want and f"**Verdict: {want}**" in md
    assert x["clocks"]["line"].startswith("clocks pinned at 1500 MHz") and "Clocks: clocks pinned at 1500 MHz" in md
    for n in SERVED:
        assert f"| {n} | {seed[n]:.1f} | {tuned[n]:.1f} | {tuned[n] / seed[n]:.3f} |" in md
    assert {c["backend"] for c in k.get("decision", {}).get("candidates", [])} <= {"nccl", "pcie_ipc", "pcie_ipc_tuned"}


@pytest.mark.parametrize("how", ["hang", "raise", "raise_abort_at_exit", "abort"])
def test_a_tune_that_fails_or_hangs_is_one_line_and_never_the_tier(tmp_path, monkeypatch, how):
    monkeypatch.setenv("SGLPATCH_STANDIN_TUNE", how)
    res, k, rec, smi, md = run_tier(tmp_path, monkeypatch, "pcie_ipc_rows = [3, 6, 12, 24]\npcie_ipc_tune = true\n"
                                    "pin_clocks_mhz = 1500\n", step=4 if how == "hang" else 60)
    assert res["exit_code"] == 0 and k["failures"] == []
    line = k["errors"]["pcie_ipc_tuned"]
    if how == "hang":
        assert line.startswith("launch exited 1 in this backend (log kernel-pcie_ipc.log): [kernel_bench] HANG rank ")
        assert line.endswith("(step timeout 4 s) in pcie_ipc_tuned: set-up") and k["installs"][0]["hung"] == ["pcie_ipc_tuned"]
    elif how.startswith("raise"):  # the first line stays the one: the launch's own exit 1 after its result is not
        assert line == "RuntimeError: CUDA error: an illegal memory access was encountered (stand-in)"
        assert k["launches"][1]["rc"] == (1 if how == "raise_abort_at_exit" else 0)
    else:  # torchrun's last word, not its closing rule
        assert line.startswith("launch exited 1 in this backend (log kernel-pcie_ipc.log): traceback : Signal 6 (SIGABRT)")
    assert "\n" not in line and [L["backends"] for L in k["launches"]] == [["nccl"], ["pcie_ipc", "pcie_ipc_tuned"]]
    assert all(L["survivors"] == [] for L in k["launches"])
    assert {r["status"] for r in k["results"] if r["backend"] == "pcie_ipc"} == {"ok"}
    assert not any(r["backend"] == "pcie_ipc_tuned" for r in k["results"])
    x = k["pcie_ipc_tune"]["installs"][0]
    assert x["verdict"] is None and x["no_verdict"] == f"no verdict: the tuned leg has no data at the served rows; pcie_ipc_tuned: {line}"
    assert [r for _, r in smi] == ["-i 0,1 -lgc 1500,1500", "-i 0,1 -rgc"]  # reset also after a hang or a crash
    assert f"- pcie_ipc_tuned: {line}" in md and "Verdict" not in md


def test_clocks_that_cannot_be_pinned_leave_the_tuned_leg_out(tmp_path, monkeypatch):
    res, k, rec, smi, md = run_tier(tmp_path, monkeypatch, "pcie_ipc_tune = true\npin_clocks_mhz = 1500\n", lgc_rc=9)
    assert res["exit_code"] == 0 and k["failures"] == []
    assert k["errors"]["pcie_ipc_tuned"] == (f"not run: `{tmp_path / 'nvidia-smi'} -i 0,1 -lgc 1500,1500` failed (exit 9: "
                                             "Setting locked GPU clocks is not supported); clocks were not pinned")
    assert [L["backends"] for L in k["launches"]] == [["nccl"], ["pcie_ipc"]] and not any(e["event"] == "tune" for e in rec)
    assert [r for _, r in smi] == ["-i 0,1 -lgc 1500,1500", "-i 0,1 -rgc"]
    # no rows given: one bucket at pcie_ipc_max_rows, the width
    init = next(e for e in rec if e["event"] == "init")
    assert (init["tune_batches"], init["max_numel"]) == ([4], 256) and k["pcie_ipc_tune"]["served_rows"] == [4]
    assert k["pcie_ipc_tune"]["installs"][0]["verdict"] is None
    assert "(no `[kernel] pcie_ipc_rows`: one row count, `pcie_ipc_max_rows`" in md
