"""sglpatch regress on CPU: profiles, report, crossover, tier cpu, and the server tier's
orchestration against a real stand-in HTTP server (tests/standin_server.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglpatch import regress
from sglpatch.cli import main as cli_main
from sglpatch.errors import SglpatchError

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def server_profile(port: int, standin_args: str, pidfile: Path, *, health_timeout=20, modes=None) -> str:
    modes = modes or '[[server.modes]]\nname = "no_spec"\nargs = []\n'
    return f"""
    [target]
    name = "standin"
    [env]
    SGLPATCH_TEST_MARKER = "1"
    [server]
    python = "{sys.executable}"
    port = {port}
    command = ["{{python}}", "{STANDIN}", "--port", "{{port}}", "--pid-file", "{pidfile}"]
    launch_args = {standin_args}
    health_timeout_s = {health_timeout}
    request_timeout_s = 20
    stop_grace_s = 1.0
    poll_s = 0.1
    [server.benchmark]
    num_requests = 3
    warmup_requests = 1
    max_new_tokens = 40
    prompts = ["a", "b"]
    [server.baselines]
    no_spec_tok_s = 82.0
    tolerance = 0.05
    """ + textwrap.dedent(modes)


def run_server(tmp_path, standin_args, **kw):
    port = free_port()
    pidfile = tmp_path / "pids.json"
    proj = make_project(tmp_path, server_profile(port, standin_args, pidfile, **kw))
    t0 = time.monotonic()
    res = regress.run_regress("server", "t", str(tmp_path / "rep"), str(proj))
    took = time.monotonic() - t0
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    pids = json.loads(pidfile.read_text()) if pidfile.exists() else {}
    return res, doc, took, pids


def assert_all_gone(doc, pids):
    assert pids, "stand-in never reported its children"
    modes = doc["tiers"]["server"]["modes"]
    for m in modes:
        assert m["survivors"] == []
    # the grandchild left the session: only PID tracking can have ended it
    assert pids["grandchild"] in modes[-1]["tracked_pids"]
    for p in pids.values():
        assert not alive(p), f"pid {p} survived the stop"


# ----------------------------------------------------------------------------- profiles


@pytest.mark.parametrize("name", ["h200x2", "rtx6000x8-kimi-k25"])
def test_shipped_profiles_load(name):
    prof = regress.load_profile(regress.resolve_profile_path(name, ROOT))
    assert prof["kernel"]["sizes"] == [1, 2, 3, 4, 8, 16, 64, 512, 2048]
    assert prof["kernel"]["hidden"] == 7168
    if name.startswith("rtx"):
        assert prof["kernel"]["world_size"] == 8 and prof["server"]["tp"] == 8
        assert prof["env"]["NCCL_ALGO"] == "Ring" and prof["env"]["NCCL_PROTO"] == "LL"
        assert prof["server"]["baselines"]["no_spec_tok_s"] == 82.0
        assert [m["name"] for m in prof["server"]["modes"]] == ["no_spec", "eagle3"]
        assert "EAGLE3" in prof["server"]["modes"][1]["args"]
    else:
        assert prof["server"] is None and prof["kernel"]["world_size"] == 2


def test_profile_errors(tmp_path):
    proj = make_project(tmp_path, "[bogus]\nx = 1\n")
    with pytest.raises(SglpatchError, match="unknown section"):
        regress.load_profile(regress.resolve_profile_path("t", proj))
    with pytest.raises(SglpatchError, match="not found"):
        regress.resolve_profile_path("nope", proj)


def test_cli_user_error_is_one_line(capsys, tmp_path):
    rc = cli_main(["regress", "--tier", "cpu", "--profile", "does-not-exist", "--report", str(tmp_path / "r")])
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
    c = regress.find_crossover(rows, "graph", 7168)
    assert c["custom"] == "symm_mem" and c["stand_in"]
    assert c["wins_up_to_rows"] == 64 and c["first_loss_rows"] == 512
    assert c["recommended_max_bytes"] == 64 * 7168 * 2
    assert c["losses_below_crossover"] == [4]
    assert c["speedup_at_3"] == 1.25


def test_crossover_prefers_real_custom_ar_and_handles_never_wins():
    rows = _rows([("nccl", "graph", {1: 10, 3: 10}), ("symm_mem", "graph", {1: 5, 3: 5}),
                  ("custom_ar", "graph", {1: 12, 3: 12})])
    c = regress.find_crossover(rows, "graph", 7168)
    assert c["custom"] == "custom_ar" and not c["stand_in"]
    assert c["wins_up_to_rows"] == 0 and c["first_loss_rows"] == 1


def test_kernel_markdown_names_hardware_and_flags_wrong_results(tmp_path):
    rows = _rows([("nccl", "graph", {3: 10})])
    rows.append({"backend": "symm_mem", "mode": "graph", "rows": 3, "hidden": 7168, "status": "wrong",
                 "bytes": 43008, "detail": "rank 1: max abs error 2.0"})
    d = {"hardware": {"world_size": 2, "gpu_name": "NVIDIA H200", "nvlink": True, "torch": "2.11", "nccl": "2.28.9"},
         "results": rows, "sizes": [3], "hidden": 7168, "absent": {"custom_ar": "sgl_kernel does not import"},
         "crossover": {"graph": None}}
    prof = regress.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    md = "\n".join(regress.kernel_markdown(d, prof))
    assert "2x NVIDIA H200" in md and "NVLink: yes" in md
    assert "not from the profile's target" in md
    assert "**WRONG**" in md and "custom_ar: sgl_kernel does not import" in md


def test_baseline_compared_only_on_same_hardware():
    new = _rows([("nccl", "graph", {3: 20.0})])
    old = {"tiers": {"kernel": {"hardware": {"gpu_name": "NVIDIA H200", "world_size": 2},
                                "results": _rows([("nccl", "graph", {3: 10.0})])}}}
    cmp = regress.compare_kernel_baseline(new, old, {"gpu_name": "NVIDIA H200", "world_size": 2}, 0.15, 2.0)
    assert cmp["compared"] == 1 and len(cmp["regressions"]) == 1
    cmp = regress.compare_kernel_baseline(new, old, {"gpu_name": "RTX", "world_size": 8}, 0.15, 2.0)
    assert not cmp["hardware_matches"] and cmp["regressions"] == []


def test_kernel_tier_without_gpus_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setattr(regress, "count_gpus", lambda python, env: (0, "test"))
    res = regress.run_regress("kernel", None, str(tmp_path / "r"), str(ROOT))
    assert res["exit_code"] == regress.EXIT_CANNOT_RUN
    assert json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["kernel"]["status"] == "cannot_run"


def test_nvlink_detection_from_topo():
    from sglpatch.kernel_bench import nvlink_from_topo, percentile

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
    res = regress.run_step([sys.executable, "-c", code], dict(os.environ), tmp_path / "log", timeout_s=1.5)
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
    assert t["counts"]["passed"] == 2 and t["counts"]["failures"] == 1
    (proj / "tests" / "patches" / "test_p.py").write_text("def test_ok(): pass\n")
    res = regress.run_regress("cpu", "t", str(tmp_path / "r2"), str(proj))
    assert res["exit_code"] == 0
    assert "1 passed" in (tmp_path / "r2" / "report.md").read_text()


def test_cpu_tier_fails_when_patched_tree_not_installed(tmp_path):
    proj = make_project(tmp_path, '[cpu]\nimport_check = "no_such_module_sglpatch"\n')
    (proj / "tests" / "patches" / "test_p.py").write_text("def test_ok(): pass\n")
    res = regress.run_regress("cpu", "t", str(tmp_path / "r"), str(proj))
    assert res["exit_code"] == 1
    assert "does not import" in res["tiers"][0][3][0]


# ----------------------------------------------------------------------------- tier server


def test_crash_scanner_ignores_exception_word(tmp_path):
    log = tmp_path / "l"
    log.write_text("UserWarning: Exception ignored in hook\nException: harmless\nTraceback (most recent call last):\n"
                   '  File "x", line 1\nImportError: optional\n')
    sc = regress.CrashScanner(log)
    assert sc.scan() is None and sc.last_exception_line == "ImportError: optional"
    with open(log, "a") as f:
        f.write("[rank3] torch.OutOfMemoryError: CUDA out of memory. Tried\n")
    assert "CUDA out of memory" in sc.scan()


def test_server_slow_load_with_exception_warnings_still_waits(tmp_path):
    res, doc, took, pids = run_server(tmp_path, '["--mode", "slow", "--load-s", "2.5"]')
    srv = doc["tiers"]["server"]
    assert srv["status"] == "pass", srv["failures"]
    m = srv["modes"][0]
    assert m["health"]["state"] == "healthy" and m["health"]["after_s"] >= 2.0
    assert 250 < m["benchmark"]["tok_s"] < 600  # stand-in decodes at 400 tok/s
    assert res["exit_code"] == 0
    assert_all_gone(doc, pids)


def test_server_crash_fails_fast_with_crash_line(tmp_path):
    res, doc, took, pids = run_server(tmp_path, '["--mode", "crash", "--load-s", "0.8"]', health_timeout=60)
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and took < 20
    assert m["health"]["state"] == "crash"
    assert "ValueError: weight shape mismatch" in m["error"]
    assert_all_gone(doc, pids)


def test_server_oom_line_fails_fast_although_alive(tmp_path):
    res, doc, took, pids = run_server(tmp_path, '["--mode", "oom", "--load-s", "0.5"]', health_timeout=60)
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and took < 20
    assert m["health"]["state"] == "crash" and "CUDA out of memory" in m["error"]
    assert_all_gone(doc, pids)


def test_server_hang_times_out_and_is_cleaned_up(tmp_path):
    res, doc, took, pids = run_server(tmp_path, '["--mode", "hang"]', health_timeout=2)
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and m["health"]["state"] == "timeout"
    assert 2 <= took < 25
    assert_all_gone(doc, pids)


def test_server_two_modes_report_whether_speculation_pays(tmp_path):
    modes = """
    [[server.modes]]
    name = "no_spec"
    args = ["--mode", "fast", "--tok-s", "150"]
    [[server.modes]]
    name = "eagle3"
    args = ["--mode", "fast", "--tok-s", "50", "--accept-length", "2"]
    gate = false
    [server.modes.env]
    SGLANG_VERIFY_PROFILE = "1"
    """
    res, doc, took, pids = run_server(tmp_path, "[]", modes=modes)
    srv = doc["tiers"]["server"]
    assert srv["status"] == "pass", srv["failures"]
    no_spec, eagle = srv["modes"]
    assert 90 < no_spec["benchmark"]["tok_s"] < 160
    assert eagle["benchmark"]["accept_length"] == pytest.approx(2.0)
    assert eagle["server_info_accept_length"] == 2.0
    assert eagle["beats_baseline"] is False
    vp = eagle["verify_profile"]
    assert vp["records"] == 4 and vp["break_even_accept_length"] == 2.46
    assert no_spec["verify_profile"] is None
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "speculation does NOT pay" in md and "2.46" in md
    assert_all_gone(doc, pids)


def test_server_below_baseline_fails(tmp_path):
    res, doc, took, pids = run_server(tmp_path, '["--mode", "fast", "--tok-s", "50"]')
    assert res["exit_code"] == 1
    assert any("below" in f for f in doc["tiers"]["server"]["failures"])


def test_server_refuses_a_busy_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        pidfile = tmp_path / "pids.json"
        proj = make_project(tmp_path, server_profile(port, '["--mode", "fast"]', pidfile))
        res = regress.run_regress("server", "t", str(tmp_path / "rep"), str(proj))
    assert res["exit_code"] == 1 and "already in use" in res["tiers"][0][3][0]
    assert not pidfile.exists()


def test_regress_sh_defaults_the_profile(tmp_path):
    env = dict(os.environ, SGLPATCH_PROFILE="h200x2")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "regress.sh"), "--tier", "server", "--report", str(tmp_path / "r")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == regress.EXIT_CANNOT_RUN, r.stderr
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["profile"].endswith("h200x2.toml")
