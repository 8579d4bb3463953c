"""sglpatch regress on CPU: profiles, report, crossover, tier cpu (the server tier's tests are in
test_regress_server.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglpatch.gpu import regress

from sglpatch.gpu.kernel import tier as kernel

from sglpatch.gpu.shared import step_runner

from sglpatch.gpu.shared import profile as profiles
from sglpatch.cli import main as cli_main
from sglpatch.errors import SglpatchError

ROOT = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def make_project(tmp_path: Path, profile: str, name: str = "t") -> Path:
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True, exist_ok=True)
    (proj / "tests" / "patches").mkdir(parents=True, exist_ok=True)
    (proj / "targets" / f"{name}.toml").write_text(textwrap.dedent(profile))
    return proj


# ----------------------------------------------------------------------------- profiles


@pytest.mark.parametrize("name", ["h200x2", "rtx6000x8-kimi-k25"])
def test_shipped_profiles_load(name):
    prof = profiles.load_profile(profiles.resolve_profile_path(name, ROOT))
    assert prof["kernel"]["sizes"] == [1, 2, 3, 4, 8, 16, 64, 512, 2048]
    assert prof["kernel"]["hidden"] == 7168
    if name.startswith("rtx"):
        assert prof["kernel"]["world_size"] == 8 and prof["server"]["tp"] == 8
        assert prof["env"]["NCCL_ALGO"] == "Ring" and prof["env"]["NCCL_PROTO"] == "LL"
        assert prof["server"]["baselines"]["no_spec_tok_s"] == 82.0
        assert [m["name"] for m in prof["server"]["modes"] if not m.get("optional")] == ["no_spec", "eagle3"]
        assert {(p["a"], p["b"]) for p in prof["server"]["parity"]} == {
            ("no_spec_p2_off", "no_spec"), ("no_spec_p2_off", "no_spec_p1_on"),  # P2, P1 on vs off
            ("no_spec_nccl", "no_spec_pcie_ipc"), ("eagle3_nccl", "eagle3_pcie_ipc"),  # P5 vs NCCL (issue 53)
            ("no_spec_nccl", "no_spec_b12x"), ("eagle3_nccl", "eagle3_b12x")}  # P7 vs NCCL
        assert "EAGLE3" in prof["server"]["modes"][1]["args"]
    else:
        assert prof["server"] is None and prof["kernel"]["world_size"] == 2


def test_profile_errors(tmp_path):
    proj = make_project(tmp_path, "[bogus]\nx = 1\n")
    with pytest.raises(SglpatchError, match="unknown section"):
        profiles.load_profile(profiles.resolve_profile_path("t", proj))
    with pytest.raises(SglpatchError, match="not found"):
        profiles.resolve_profile_path("nope", proj)


def test_cli_user_error_is_one_line(capsys, tmp_path):
    rc = cli_main(["regress", "--tier", "cpu", "--profile", "does-not-exist", "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("sglpatch: error:") and "\n" not in err


# ----------------------------------------------------------------------------- kernel pieces


def _rows(table):
    out = []
    for backend, mode, vals in table:
        for n, us in vals.items():
            out.append({"backend": backend, "mode": mode, "rows": n, "hidden": 7168, "status": "ok",
                        "median_us": us, "p90_us": us + 1, "bytes": n * 7168 * 2})
    return out


def test_crossover_finds_cap_and_ignores_a_lone_dip():
    rows = _rows([("nccl", "graph", {1: 10, 3: 10, 4: 9, 64: 15, 512: 46, 2048: 120}),
                  ("symm_mem", "graph", {1: 8, 3: 8, 4: 9.5, 64: 14, 512: 53, 2048: 180})])
    c = kernel.find_crossover(rows, "graph", 7168)
    assert c["custom"] == "symm_mem" and c["stand_in"]
    assert c["wins_up_to_rows"] == 64 and c["first_loss_rows"] == 512
    assert c["recommended_max_bytes"] == 64 * 7168 * 2
    assert c["losses_below_crossover"] == [4]
    assert c["speedup_at_3"] == 1.25


def test_crossover_prefers_real_custom_ar_and_handles_never_wins():
    rows = _rows([("nccl", "graph", {1: 10, 3: 10}), ("symm_mem", "graph", {1: 5, 3: 5}),
                  ("custom_ar", "graph", {1: 12, 3: 12})])
    c = kernel.find_crossover(rows, "graph", 7168)
    assert c["custom"] == "custom_ar" and not c["stand_in"]
    assert c["wins_up_to_rows"] == 0 and c["first_loss_rows"] == 1


def test_kernel_markdown_names_hardware_and_flags_wrong_results(tmp_path):
    rows = _rows([("nccl", "graph", {3: 10})])
    rows.append({"backend": "symm_mem", "mode": "graph", "rows": 3, "hidden": 7168, "status": "wrong",
                 "bytes": 43008, "detail": "rank 1: max abs error 2.0"})
    d = {"hardware": {"world_size": 2, "gpu_name": "NVIDIA H200", "nvlink": True, "torch": "2.11", "nccl": "2.28.9"},
         "results": rows, "sizes": [3], "hidden": 7168, "absent": {"custom_ar": "sgl_kernel does not import"},
         "crossover": {"graph": None}}
    prof = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    md = "\n".join(kernel.kernel_markdown(d, prof))
    assert "2x NVIDIA H200" in md and "NVLink: yes" in md
    assert "not from the profile's target" in md
    assert "**WRONG**" in md and "custom_ar: sgl_kernel does not import" in md


def test_baseline_compared_only_on_same_hardware():
    new = _rows([("nccl", "graph", {3: 20.0})])
    old = {"tiers": {"kernel": {"hardware": {"gpu_name": "NVIDIA H200", "world_size": 2},
                                "results": _rows([("nccl", "graph", {3: 10.0})])}}}
    cmp = kernel.compare_kernel_baseline(new, old, {"gpu_name": "NVIDIA H200", "world_size": 2}, 0.15, 2.0)
    assert cmp["compared"] == 1 and len(cmp["regressions"]) == 1
    cmp = kernel.compare_kernel_baseline(new, old, {"gpu_name": "RTX", "world_size": 8}, 0.15, 2.0)
    assert not cmp["hardware_matches"] and cmp["regressions"] == []


def test_kernel_tier_without_gpus_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel, "count_gpus", lambda python, env: (0, "test"))
    res = regress.run_regress("kernel", None, str(tmp_path / "r"), str(ROOT))
    assert res["exit_code"] == regress.EXIT_CANNOT_RUN
    assert json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]["status"] == "cannot_run"


def test_one_spelling_for_two_installs_and_the_old_one_warns_once(tmp_path, monkeypatch, capsys):
    """--ab A,B in the kernel tier runs the bench in each interpreter, as --python A,B did; the old
    spelling still works, read as --ab, with one warning."""
    b = tmp_path / "b" / "bin" / "python3"
    b.parent.mkdir(parents=True)
    b.symlink_to(sys.executable)
    from sglpatch.gpu.kernel import launch

    seen, interpreters = [], launch.interpreters
    monkeypatch.setattr(kernel, "count_gpus", lambda python, env: (0, "test"))
    monkeypatch.setattr(kernel.kernel_launch, "interpreters", lambda k, given: (seen.append(given), interpreters(k, given))[1])
    for i, kw in enumerate(({"ab": f"{sys.executable},{b}"}, {"python": f"{sys.executable},{b}"})):
        res = regress.run_regress("kernel", None, str(tmp_path / f"r{i}"), str(ROOT), **kw)
        assert res["exit_code"] == regress.EXIT_CANNOT_RUN
    assert seen == [f"{sys.executable},{b}"] * 2  # the kernel tier's installs, A then B, both times
    err = capsys.readouterr().err.splitlines()
    assert err == ["sglpatch: warning: --python A,B is spelled --ab A,B now (every tier that compares installs); read as --ab"]
    rc = cli_main(["regress", "--tier", "cpu", "--ab", f"{sys.executable},{b}", "--project", str(ROOT),
                   "--report-dir", str(tmp_path / "r3")])
    assert rc == 2 and capsys.readouterr().err.strip().splitlines() == [
        "sglpatch: error: --ab A,B compares installs in the kernel or the server tier: use it with --tier kernel or "
        "--tier server (the cpu tier tests one install: --python PATH)"]


def test_nvlink_detection_from_topo():
    from sglpatch.gpu.kernel.bench import nvlink_from_topo, percentile

    assert nvlink_from_topo("\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n") is True
    assert nvlink_from_topo("\tGPU0\tGPU1\nGPU0\t X \tNODE\nGPU1\tNODE\t X \n") is False
    assert nvlink_from_topo(None) is None
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == pytest.approx(9.1)


def test_run_step_kills_a_hung_tree(tmp_path):
    pidfile = tmp_path / "p.json"
    code = ("import subprocess,sys,json,time\n"
            "c=subprocess.Popen([sys.executable,'-c','import time\\nwhile True: time.sleep(1)'],start_new_session=True)\n"
            f"open({str(pidfile)!r},'w').write(json.dumps([c.pid]))\n"
            "while True: time.sleep(1)\n")
    t0 = time.monotonic()
    res = step_runner.run_step([sys.executable, "-c", code], dict(os.environ), tmp_path / "log", timeout_s=1.5)
    assert res["timed_out"] and res["survivors"] == []
    assert time.monotonic() - t0 < 20
    assert not alive(json.loads(pidfile.read_text())[0])


# ----------------------------------------------------------------------------- tier cpu


def test_cpu_tier_counts_and_fails(tmp_path):
    proj = make_project(tmp_path, '[cpu]\nimport_check = "json"\ntimeout_s = 60\n')
    (proj / "tests" / "patches" / "test_p.py").write_text(
        "import os\n"
        "def test_ok(): assert os.environ['SGLPATCH_ENV_FROM_PROFILE'] == 'yes'\n"
        "def test_ok2(): assert os.environ['SGLPATCH_PATCHED_PYTHON']\n"
        "def test_bad(): assert 0\n")
    (proj / "targets" / "t.toml").write_text('[env]\nSGLPATCH_ENV_FROM_PROFILE = "yes"\n'
                                              '[cpu]\nimport_check = "json"\ntimeout_s = 60\n')
    res = regress.run_regress("cpu", "t", str(tmp_path / "r"), str(proj))
    t = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["cpu"]
    assert res["exit_code"] == 1 and t["status"] == "fail"
    assert t["counts"]["passed"] == 2 and t["counts"]["failed"] == 1
    (proj / "tests" / "patches" / "test_p.py").write_text("def test_ok(): pass\n")
    res = regress.run_regress("cpu", "t", str(tmp_path / "r2"), str(proj))
    assert res["exit_code"] == 0
    assert "1 passed" in (tmp_path / "r2" / "report.md").read_text()


def test_cpu_tier_cannot_run_when_patched_tree_not_installed(tmp_path):
    """Not installed at all: cannot run here (bisect skips), with the command that installs it."""
    proj = make_project(tmp_path, '[cpu]\nimport_check = "no_such_module_sglpatch"\n')
    (proj / "tests" / "patches" / "test_p.py").write_text("def test_ok(): pass\n")
    res = regress.run_regress("cpu", "t", str(tmp_path / "r"), str(proj))
    assert res["exit_code"] == 125 and res["tiers"][0][1] == "cannot_run"
    report = (tmp_path / "r" / "report.md").read_text()
    assert "no_such_module_sglpatch is not installed in" in report and "scripts/apply.sh --python" in report


# ----------------------------------------------------------------------------- scripts


def test_regress_sh_defaults_the_profile(tmp_path):
    env = dict(os.environ, SGLPATCH_PROFILE="h200x2")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "regress.sh"), "--tier", "server", "--report-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == regress.EXIT_CANNOT_RUN, r.stderr
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["profile"].endswith("h200x2.toml")


def test_regress_outside_a_project_is_one_line_not_the_installed_folder(tmp_path):
    r = subprocess.run(["sglpatch", "regress", "--tier", "cpu"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"sglpatch: error: no sglpatch project here ({tmp_path.resolve()}): run from the sglpatch checkout or pass --project DIR"
    ]
    assert not list(tmp_path.iterdir())  # no report folder written either


def test_gpu_suite_sees_the_series_side_only_through_series_side():
    """Two rooms: sglpatch.gpu imports no series-side module except through series_side, and never cli."""
    import ast

    series_side = {"sglpatch.stack", "sglpatch.series", "sglpatch.upstream", "sglpatch.rebase", "sglpatch.bisect", "sglpatch.gitcmd",
                   "sglpatch.cli", "sglpatch.pythonenv.install", "sglpatch.pythonenv.flashinfer_set", "sglpatch.watch",
                   "sglpatch.workdir", "sglpatch.project", "sglpatch.lines"}
    allowed = {"sglpatch.errors", "sglpatch.proctree", "sglpatch.pythonenv.preflight", "sglpatch.exitcodes",
               "sglpatch.pythonenv.interpreter", "sglpatch.pythonenv.jit_kernels", "sglpatch.argtypes"}  # standard library only

    def module(base: str, name: str) -> str:  # from P import X: P.X when X is a module, else P
        sub = ROOT / "src" / Path(*f"{base}.{name}".split("."))
        return f"{base}.{name}" if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file() else base

    def under(n: str, names: set) -> bool:
        return any(n == m or n.startswith(m + ".") for m in names)

    for path in (ROOT / "src" / "sglpatch" / "gpu").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglpatch"):
                names = [module(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("sglpatch")]
            for n in names:
                if n.startswith("sglpatch.gpu") or n in allowed:
                    continue
                assert path.name == "series_side.py" and under(n, series_side), f"{path.name} imports {n}"


def test_judge_names_each_failure_and_passes_optional_set_up_errors():
    """The kernel tier's judge (issue 29): NCCL failing to set up fails the run in any install, a
    required backend only in the first; an optional backend's set-up error (symm_mem without P2P
    atomics) is reported, not a failure; every WRONG result and raised row is one failure."""
    from sglpatch.gpu.shared.report import TierResult

    def inst(key, label, errors=None, hung=()):
        return {"key": key, "label": label, "errors": errors or {}, "hung": list(hung), "absent": {}}

    installs = [inst("A", "0.5.9", {"nccl_p2p_off": "ncclInternalError", "symm_mem": "no multicast"}),
                inst("B", "0.5.23", {"nccl": "timeout", "custom_ar": "no P2P"}, hung=["nccl"])]
    rows = [{"backend": "nccl", "install": "A", "mode": "graph", "rows": 3, "hidden": 7168, "status": "ok"},
            {"backend": "custom_ar", "install": "A", "mode": "graph", "rows": 3, "hidden": 7168, "status": "ok"},
            {"backend": "pcie_ipc", "install": "B", "mode": "graph", "rows": 3, "hidden": 7168, "status": "wrong",
             "detail": "rank 1: max abs error 2.0"}]
    tr = TierResult("kernel")
    kernel.judge(tr, {"required_backends": ["nccl", "custom_ar"]}, installs, rows, cpu_test=False)
    assert tr.status == "fail"
    assert tr.failures == ["backend nccl_p2p_off [0.5.9] failed to set up: ncclInternalError",
                           "backend nccl [0.5.23] HUNG: timeout",
                           "WRONG RESULT pcie_ipc [B] graph [3,7168]: rank 1: max abs error 2.0"]
    ok = TierResult("kernel")
    kernel.judge(ok, {"required_backends": ["nccl"]}, [inst("A", "0.5.9", {"symm_mem": "no multicast"})], rows[:1], cpu_test=False)
    assert ok.failures == [] and ok.status == "skipped"


def test_the_report_is_labelled_with_the_lines_that_served(tmp_path):
    """Issue 27: the whole report names the line (not only the server tier's "What served")."""
    from sglpatch.gpu.shared.report import TierResult, write_report

    server = TierResult("server", "pass", "ok", data={"served_by": {"line": "0.5.23 (lines/0.5.23/)"}})
    ab = TierResult("server", "pass", "ok", data={"ab": {"sides": [{"served_by": {"line": "0.5.9 (primary)"}},
                                                                  {"served_by": {"line": "0.5.23 (lines/0.5.23/)"}},
                                                                  {"served_by": {}}]}})
    doc = {"status": "pass", "started_utc": "s", "finished_utc": "f", "command": "c", "exit_code": 0}
    write_report(tmp_path / "r", doc, [TierResult("cpu", "pass", "ok"), ab, server])
    assert json.loads((tmp_path / "r" / "report.json").read_text())["lines"] == ["0.5.9 (primary)", "0.5.23 (lines/0.5.23/)"]
    assert "- line: 0.5.9 (primary), 0.5.23 (lines/0.5.23/)\n" in (tmp_path / "r" / "report.md").read_text()
    write_report(tmp_path / "n", doc, [TierResult("cpu", "pass", "ok")])
    assert "- line: (no workdir of this checkout served)\n" in (tmp_path / "n" / "report.md").read_text()
