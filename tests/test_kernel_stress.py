"""`regress --tier kernel --stress N` on CPU: the stress worker (kernel_bench --stress under
torchrun with gloo on CPU tensors, 2 ranks, when torch is installed), its merge and failure
lines, and the regress wiring (a hang fails the tier with a clear line, a mismatch names
iteration and rank) against real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglpatch.gpu.kernel import bench as kb
from sglpatch.gpu import regress
from sglpatch.gpu.kernel import tier as kernel
from sglpatch.gpu.shared import profile as profiles
from sglpatch.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin_kernel_bench.py"


def cpu_project(tmp_path: Path, extra: str, python: str = sys.executable) -> Path:
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "targets" / "c.toml").write_text(textwrap.dedent(f"""
        [kernel]
        python = "{python}"
        device = "cpu"
        world_size = 2
        hidden = 64
        stress_sizes = [1, 3, 16]
        """) + textwrap.dedent(extra))
    return proj


def fake_python(tmp_path: Path) -> str:
    """An interpreter path whose every run is the stand-in worker (tests/standin_kernel_bench.py)."""
    p = tmp_path / "fakepy"
    p.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    p.chmod(0o755)
    return str(p)


# ----------------------------------------------------------------------------- pure pieces


def _rank(i, done=100, bad=0, first=None, stopped=False):
    return {"iterations_requested": 100, "iterations_done": done, "mismatched_iterations": bad,
            "mismatched_elements": bad * 2, "first_mismatch": first, "stopped_early": stopped, "elapsed_s": 1.0 + i}


def _first(it, rank):
    return {"iteration": it, "rank": rank, "rows": 3, "hidden": 64, "element": [1, 6], "flat_index": 70,
            "got": 5.0, "nccl": 4.0, "elements_wrong": 2}


def test_merge_takes_the_earliest_mismatch_over_ranks():
    m = kb.merge_stress_ranks([_rank(0), _rank(1, 64, 2, _first(40, 1), True), _rank(2, 64, 1, _first(33, 2), True)])
    assert m["status"] == "mismatch" and m["first_mismatch"]["iteration"] == 33 and m["first_mismatch"]["rank"] == 2
    assert m["mismatch_ranks"] == {"1": 2, "2": 1} and m["iterations_done"] == 64 and m["stopped_early"]
    ok = kb.merge_stress_ranks([_rank(0), _rank(1)])
    assert ok["status"] == "ok" and ok["first_mismatch"] is None and ok["elapsed_s"] == 2.0
    assert kb.merge_stress_ranks([_rank(0, 50), _rank(1, 50)])["status"] == "incomplete"


def test_stress_failures_name_iteration_rank_and_missing_backends():
    row = {"backend": "custom_ar", "mode": "graph", "iterations_done": 2048, "iterations_requested": 10 ** 6,
           "status": "mismatch", "mismatched_iterations": 1, "first_mismatch": _first(1777, 5)}
    lines = kernel.stress_failures({"stress": [row], "absent": {"symm_mem": "x"}, "errors": {}}, ["custom_ar"])
    assert lines == ["STRESS MISMATCH custom_ar graph: iteration 1777, rank 5, [3,64] element [1,6]: got 5, "
                     "NCCL 4 (1 of 2048 iterations wrong before the stop)"]
    lines = kernel.stress_failures({"stress": [], "absent": {"custom_ar": "sgl_kernel does not import"}}, ["custom_ar"])
    assert lines == ["required stress backend custom_ar did not run: sgl_kernel does not import"]
    assert kernel.stress_failures({"stress": [], "absent": {}}, [])[0].startswith("stress: no backend")
    err = dict(row, status="error", first_mismatch=None, detail="RuntimeError: boom")
    assert "raised after 2048 iterations: RuntimeError: boom" in kernel.stress_failures({"stress": [err]}, [])[0]


def test_fault_and_value_bound():
    assert kb.parse_fault("", 1000, 8) == {"iteration": 500, "rank": 7, "element": 7}
    assert kb.parse_fault("12:1:70", 1000, 8) == {"iteration": 12, "rank": 1, "element": 70}
    assert kb.value_bound(2) == 8 and kb.value_bound(8) == 8 and kb.value_bound(64) == 4
    with pytest.raises(SystemExit):
        kb.main(["--device", "cpu", "--out", "x.json", "--samples", "0"])


def test_stress_launch_from_profile(tmp_path):
    prof = profiles.load_profile(profiles.resolve_profile_path("rtx6000x8-kimi-k25", ROOT))
    k = prof["kernel"]
    assert k["stress_iterations"] == 1_000_000 and k["stress_required"] == ["custom_ar"]
    L = kernel.stress_launch(prof, 8, tmp_path, "py", 1_000_000)
    cmd = L["cmd"]
    assert cmd[cmd.index("--stress") + 1] == "1000000" and cmd[cmd.index("--backends") + 1] == "custom_ar,symm_mem"
    assert cmd[cmd.index("--modes") + 1] == "eager,graph" and "--device" not in cmd
    # torchrun's log folder in the report's scratch (a torchrun option: before the module), not TMPDIR's
    assert cmd[cmd.index("--log-dir") + 1] == str(tmp_path / "scratch" / "torchelastic")
    assert cmd.index("--log-dir") < cmd.index("sglpatch.gpu.kernel.bench")
    assert L["stall_s"] == k["stress_step_timeout_s"] + 60 and L["timeout_s"] > 3600
    h = profiles.load_profile(profiles.resolve_profile_path("h200x2", ROOT))["kernel"]
    assert 0 < h["stress_iterations"] <= 100_000 and h["stress_required"] == ["symm_mem"]


# ----------------------------------------------------------------------------- regress wiring, stand-in worker


def test_silent_hang_fails_the_tier_and_ends_the_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLPATCH_STANDIN_KB", "silent")
    proj = cpu_project(tmp_path, "stress_step_timeout_s = 1\n", python=fake_python(tmp_path))
    monkeypatch.setattr(kernel, "stress_launch", _short_stall(kernel.stress_launch, 2.0))
    t0 = time.monotonic()
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), stress=10)
    assert time.monotonic() - t0 < 40
    k = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]
    assert res["exit_code"] == 1
    assert k["failures"][0].startswith("stress HUNG (no output for 2 s; killed; log kernel-stress.log)")
    assert k["stress"]["launch"]["survivors"] == []
    assert "**Hang:**" not in (tmp_path / "r" / "report.md").read_text()  # the worker never spoke: no HANG line


def _short_stall(orig, stall_s):
    def wrapped(*a, **kw):
        L = orig(*a, **kw)
        L["stall_s"] = stall_s
        return L
    return wrapped


def test_cli_stress_without_n_takes_the_profile_default(tmp_path, monkeypatch, capsys):
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("SGLPATCH_STANDIN_KB", "record")
    monkeypatch.setenv("SGLPATCH_STANDIN_ARGV", str(argv_file))
    proj = cpu_project(tmp_path, "stress_iterations = 777\n", python=fake_python(tmp_path))
    rc = cli_main(["regress", "--tier", "kernel", "--profile", "c", "--project", str(proj),
                   "--report-dir", str(tmp_path / "r"), "--stress"])
    argv = json.loads(argv_file.read_text())
    assert rc == 0, capsys.readouterr().out
    assert argv[argv.index("--stress") + 1] == "777" and argv[argv.index("--device") + 1] == "cpu"
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["command"].endswith("--stress") and doc["tiers"]["kernel"]["stress"]["iterations"] == 777
    assert "| symm_mem | graph (cuda_graph) | 777 / 777 | 0 | — |" in (tmp_path / "r" / "report.md").read_text()
    rc = cli_main(["regress", "--tier", "kernel", "--profile", "c", "--project", str(proj),
                   "--report-dir", str(tmp_path / "r2"), "--stress", "5"])
    argv = json.loads(argv_file.read_text())
    assert rc == 0 and argv[argv.index("--stress") + 1] == "5"
    with pytest.raises(SystemExit):
        cli_main(["regress", "--tier", "kernel", "--stress", "0"])


def test_regress_sh_passes_stress_through(tmp_path):
    argv_file = tmp_path / "argv.json"
    proj = cpu_project(tmp_path, "", python=fake_python(tmp_path))
    env = dict(os.environ, SGLPATCH_STANDIN_KB="record", SGLPATCH_STANDIN_ARGV=str(argv_file))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "regress.sh"), "--tier", "kernel", "--profile", "c",
                        "--project", str(proj), "--report-dir", str(tmp_path / "r"), "--stress", "42"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    argv = json.loads(argv_file.read_text())
    assert argv[argv.index("--stress") + 1] == "42"


# ----------------------------------------------------------------------------- the real worker on CPU (torch)


def _torch():
    return pytest.importorskip("torch")


def test_mismatch_ring_finds_first_difference_without_host_sync():
    torch = _torch()
    plan = kb.group_plan([1, 3], 1)
    ring = kb.MismatchRing(torch, 4, plan, 4, torch.device("cpu"), torch.bfloat16)
    ref = torch.arange(16, dtype=torch.bfloat16)  # op 0: [1,4], op 1: [3,4]
    ring.record(0, ref.clone(), ref)
    bad = ref.clone()
    bad[4 + 6] += 1  # op 1, element [1,2]
    bad[4 + 11] = float("nan")
    ring.record(1, bad, ref)
    ring.record(2, ref.clone(), ref)
    n_bad, n_el, first = ring.read(3, 100, rank=5)
    assert (n_bad, n_el) == (1, 2)
    # group 1, op 1 -> iteration 100 + 1 * 2 + 1
    assert first == {"iteration": 103, "rank": 5, "rows": 3, "hidden": 4, "element": [1, 2], "flat_index": 6,
                     "got": 11.0, "nccl": 10.0, "elements_wrong": 2}
    assert ring.read(1, 0, 0) == (0, 0, None)
    assert kb.group_plan([1, 3], 2) == [1, 1, 3, 3]


def _torchrun(tmp_path, *args, timeout=180):
    _torch()
    out = tmp_path / "kb.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(tmp_path / "torchelastic"), str(ROOT / "src" / "sglpatch" / "gpu" / "kernel" / "bench.py"),
           "--device", "cpu", "--hidden", "64",
           "--stress-sizes", "1,3,16", "--stress-batch", "128", "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_worker_on_cpu_finds_the_planted_fault_in_eager_and_replay(tmp_path):
    r, doc = _torchrun(tmp_path, "--stress", "1000", "--backends", "nccl,selftest_wrong,symm_mem",
                       "--selftest-fault", "710:1:70")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {(x["backend"], x["mode"]): x for x in doc["stress"]}
    assert set(rows) == {("selftest_wrong", "eager"), ("selftest_wrong", "graph")}
    for row in rows.values():
        f = row["first_mismatch"]
        assert row["status"] == "mismatch" and row["mismatched_iterations"] == 1 and row["mismatch_ranks"] == {"1": 1}
        # groups of 24 ops (rows 1, 3, 16, 8 times each): 710 % 24 = 14 -> rows 3; element 70 = [1, 6]
        assert (f["iteration"], f["rank"], f["rows"], f["element"]) == (710, 1, 3, [1, 6])
        assert f["got"] - f["nccl"] == 1.0 and f["elements_wrong"] == 1
        # 5 groups (120 iterations) per host sync: stopped at the end of the batch holding 710
        assert row["iterations_done"] == 720 and row["stopped_early"] and row["group"] == 24
    assert "first mismatch at iteration 710 on rank 1" in r.stdout
    assert doc["absent"]["symm_mem"] and doc["absent"]["nccl"] == "the reference, not stressed"


def test_worker_on_cpu_passes_when_nothing_is_wrong(tmp_path):
    r, doc = _torchrun(tmp_path, "--stress", "600", "--backends", "selftest_wrong", "--selftest-fault", "99999",
                       "--stress-progress-s", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    for row in doc["stress"]:
        assert row["status"] == "ok" and row["iterations_done"] == 600 and row["first_mismatch"] is None
    assert "600/600 iterations, 0 mismatches" in r.stdout


def test_regress_on_cpu_mismatch_and_hang_fail_the_tier(tmp_path):
    _torch()
    proj = cpu_project(tmp_path, 'stress_backends = ["selftest_wrong"]\nstress_step_timeout_s = 4\n')
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), stress=500)
    k = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]
    assert res["exit_code"] == 1
    assert [f.split(":")[0] for f in k["failures"]] == ["STRESS MISMATCH selftest_wrong eager",
                                                         "STRESS MISMATCH selftest_wrong graph"]
    assert all(": iteration 250, rank 1, [3,64] element [0,7]: got " in f for f in k["failures"])

    (proj / "targets" / "c.toml").write_text((proj / "targets" / "c.toml").read_text().replace(
        '"selftest_wrong"', '"selftest_hang"'))
    t0 = time.monotonic()
    res = regress.run_regress("kernel", "c", str(tmp_path / "h"), str(proj), stress=500)
    k = json.loads((tmp_path / "h" / "report.json").read_text())["tiers"]["kernel"]
    assert res["exit_code"] == 1 and time.monotonic() - t0 < 90
    assert k["failures"][0].startswith("stress HUNG (per-step timeout 4 s; log kernel-stress.log): "
                                       "[kernel_bench] HANG rank ")
    assert "in stress selftest_hang eager: iterations 0..503" in k["failures"][0]
    assert k["stress"]["launch"]["survivors"] == []


def test_kernel_report_says_what_a_latency_sample_is():
    prof = profiles.load_profile(None)
    rows = [{"backend": "nccl", "mode": "graph", "rows": 3, "hidden": 7168, "status": "ok", "median_us": 9.0,
             "p90_us": 9.5}]
    md = "\n".join(kernel.kernel_markdown({"hardware": {}, "results": rows, "sizes": [3], "hidden": 7168}, prof))
    assert "slowest rank" not in md
    assert "the last-arriving rank's, i.e. the least over the ranks" in md
