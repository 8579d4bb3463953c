"""`regress --tier server --ab A_PYTHON,B_PYTHON` on CPU: two "installs" = the patched venv's
python (A, sglang 0.5.9 + the series) and a wrapper that runs the same interpreter as if it were
0.5.23 (B: sglang.__version__ and the stand-in's reported version 0.5.23, P2 gone, upstream's
PCIe-IPC log lines, twice the decode speed, accept length 3).  The real bench_serving measures
both; the test checks the A/B table, its ratios, the allreduce evidence, the per-side env and that
no process survives."""

from __future__ import annotations

import json
import stat
import textwrap
import time
from pathlib import Path

import pytest
from conftest import SERIES, copy_project
from test_regress_server import (  # noqa: F401 — fixtures
    PROMPTS,
    alive,
    bench_env,
    free_port,
    server_profile,
    tokenizer_dir,
)

from sglpatch.errors import SglpatchError
from sglpatch.gpu import regress
from sglpatch.gpu.server import tier as server_tier
from sglpatch.gpu.server import report as server_report
from sglpatch.gpu.server.evidence import IPC_NAME, NCCL_NAME, P2_NAME, UNKNOWN, allreduce_backend

MODES = """
[[server.modes]]
name = "no_spec"
args = ["--mode", "fast", "--tok-s", "150"]
[[server.modes]]
name = "eagle3"
args = ["--mode", "fast", "--tok-s", "100", "--accept-length", "2", "--speculative-algorithm", "EAGLE3",
        "--speculative-num-steps", "2"]
gate = false
[server.modes.env]
SGLANG_VERIFY_PROFILE = "1"
"""
EXTRA = """
[[server.version_env]]
min_version = "0.5.21"
why = "upstream PCIe-IPC"
[server.version_env.env]
SGLANG_ENABLE_PCIE_IPC_ALLREDUCE = "1"
SGLANG_ENABLE_PCIE_CUSTOM_AR = "0"
[server.ab.b.env]
SGLPATCH_AB_SIDE = "b"
"""


def make_b_python(tmp_path: Path, python: Path) -> Path:
    """B: <tmp>/ml-env-0.5.23/bin/python3, the same interpreter playing sglang 0.5.23."""
    shim = tmp_path / "b-shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import os\nimport sglang\nsglang.__version__ = os.environ['STANDIN_SGLANG_VERSION']\n")
    wrapper = tmp_path / "ml-env-0.5.23" / "bin" / "python3"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        export STANDIN_SGLANG_VERSION=0.5.23 STANDIN_SPEED=3 STANDIN_ACCEPT_LENGTH=3
        export PYTHONPATH="{shim}${{PYTHONPATH:+:$PYTHONPATH}}"
        exec "{python}" "$@"
        """))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


def test_ab_compares_two_installs_in_one_report(tmp_path, patched_python, tokenizer_dir, bench_env):  # noqa: F811
    port = free_port()
    pidfile = tmp_path / "pids.json"
    proj = copy_project(tmp_path / "proj")
    (proj / "targets").mkdir(exist_ok=True)
    (proj / "targets" / "t.toml").write_text(
        server_profile(port, "[]", pidfile, patched_python, tokenizer_dir, bench_env, modes=MODES, extra=EXTRA))
    b_python = make_b_python(tmp_path, Path(patched_python))
    t0 = time.monotonic()
    res = regress.run_regress("server", "t", str(tmp_path / "rep"), str(proj), ab=f"{patched_python},{b_python}")
    took = time.monotonic() - t0
    rep = tmp_path / "rep"
    doc = json.loads((rep / "report.json").read_text())
    srv = doc["tiers"]["server"]
    assert res["exit_code"] == 0 and srv["status"] == "pass", srv["failures"]
    a, b = srv["ab"]["sides"]
    assert a["label"].startswith("A: 0.5.9 + P5 (") and b["label"].startswith("B: 0.5.23 (")  # A carries the series, P5 included
    assert b["label"].endswith("ml-env-0.5.23)") and srv["ab"]["same_prompts"]
    assert a["served_by"]["sglang_version"] == "0.5.9" and [c.split(":")[0] for c in a["served_by"]["carried"]] == SERIES
    # the same modes, A's first then B's, each side's files in its own folder, one server at a time
    assert [m["mode"] for m in a["modes"]] == [m["mode"] for m in b["modes"]] == ["no_spec", "eagle3"]
    for side in ("A", "B"):
        for mode in ("no_spec", "eagle3"):
            assert (rep / side / f"bench-{mode}.jsonl").is_file() and (rep / side / f"server-{mode}.log").is_file()
    assert (rep / "A" / "server-eagle3.log").stat().st_mtime <= (rep / "B" / "server-no_spec.log").stat().st_ctime
    # B's server is the one that said 0.5.23 (its /get_server_info, through the real bench_serving)
    assert {m["served"]["version"] for m in b["modes"]} == {"0.5.23"}
    assert {m["served"]["version"] for m in a["modes"]} == {"0.0.0-standin"}
    # per-side env: the version rule and [server.ab.b.env] on B only
    assert b["version_env"] and "0.5.23 >= 0.5.21" in b["version_env"][0] and a["version_env"] == []
    assert b["modes"][0]["env_added"]["SGLPATCH_AB_SIDE"] == "b" and "SGLPATCH_AB_SIDE" not in a["modes"][0]["env_added"]
    # the table: per mode A, B and B/A, computed from the sides' own numbers
    rows = {r["mode"]: r for r in srv["ab"]["table"]}
    for name, r in rows.items():
        for key in ("single_stream_tok_s", "output_throughput", "accept_length", "verify_ms_p4"):
            if r["a"][key] is None:
                assert name == "no_spec" and key in ("accept_length", "verify_ms_p4")
                assert r["ratio_b_over_a"][key] is None
                continue
            assert r["ratio_b_over_a"][key] == round(r["b"][key] / r["a"][key], 3)  # handed on rounded to 3 places
    tok = "single_stream_tok_s"
    assert rows["no_spec"]["a"][tok] == next(m for m in a["modes"] if m["mode"] == "no_spec")["benchmark"][tok]
    assert rows["no_spec"]["ratio_b_over_a"][tok] > 1.3  # B decodes three times as fast (a loaded box narrows it)
    assert rows["eagle3"]["a"]["accept_length"] == 2.0 and rows["eagle3"]["b"]["accept_length"] == 3.0
    assert rows["eagle3"]["ratio_b_over_a"]["accept_length"] == 1.5
    assert rows["no_spec"]["a"]["accept_length"] is None is rows["no_spec"]["b"]["accept_length"]
    # P4's verify ms (median of the records' verify_ms_median): step 20 ms on A, 10 ms on B
    va, vb = rows["eagle3"]["a"]["verify_ms_p4"], rows["eagle3"]["b"]["verify_ms_p4"]
    assert 15 < va < 40 and 7 < vb < 30 and rows["eagle3"]["ratio_b_over_a"]["verify_ms_p4"] < 0.95
    # which allreduce served, with the log line and the switch that chose it
    ea, eb = rows["eagle3"]["a"]["allreduce"], rows["eagle3"]["b"]["allreduce"]
    assert ea["backend"] == P2_NAME and "Custom allreduce on 1 PCIe-only GPUs for tensors up to" in ea["evidence"]
    assert ea["selected_by"] == {"SGLANG_ENABLE_PCIE_CUSTOM_AR": "1"}
    assert eb["backend"] == IPC_NAME and eb["evidence"].endswith("FlashInfer PCIe-IPC all-reduce enabled (world=1, "
                                                                 "workspace sized on first reduction)")
    assert eb["selected_by"] == {"SGLANG_ENABLE_PCIE_CUSTOM_AR": "0", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"}
    md = (rep / "report.md").read_text()
    assert "### A/B: two installs, same profile, same prompts" in md and "this table only reports" in md
    assert f"| mode | metric | {a['label']} | {b['label']} | B/A |" in md
    assert "| eagle3 | accept length | 2.00 | 3.00 | 1.50x |" in md
    assert "| eagle3 | allreduce (decode / verify tensors) | custom allreduce (P2) | PCIe-IPC (upstream) | |" in md
    assert f"carries {len(SERIES)} patch(es)" in md
    # nothing survives: every tracked process of every mode of both sides is gone
    pids = json.loads(pidfile.read_text())
    assert pids["grandchild"] in b["modes"][-1]["tracked_pids"]
    for side in (a, b):
        for m in side["modes"]:
            assert m["survivors"] == [] and m["bench_run"]["survivors"] == []
            assert not [p for p in m["tracked_pids"] if alive(p)]
    # no bench waited out its timeout (server_profile's bench_timeout, 120 s): the run itself takes
    # 60 s and 91 s in two parallel suite runs on a loaded 2-core machine (the bound was 90 s)
    assert took < 120


# ----------------------------------------------------------------------------- units


def _log(tmp_path, *lines) -> Path:
    p = tmp_path / "server.log"
    p.write_text("\n".join(["[2026 TP0] Load weight begin.", *lines, "The server is fired up and ready to roll!"]) + "\n")
    return p


def test_allreduce_backend_from_the_real_log_lines(tmp_path):
    p2 = ("[TP0] Custom allreduce on 8 PCIe-only GPUs for tensors up to 65536 bytes "
          "(SGLANG_PCIE_CUSTOM_AR_MAX_BYTES), NCCL above.")
    off = ("[TP0] Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs. "
           "To silence this warning, specify disable_custom_all_reduce=True explicitly.")
    ipc = "[TP0] FlashInfer PCIe-IPC all-reduce enabled (world=8, workspace sized on first reduction)"
    ipc_fail = "[TP0] FlashInfer PCIe-IPC workspace (max_numel=57344) failed: oom; reductions stay on NCCL"
    fus_523 = ("[TP0] FlashInfer AllReduce Fusion enabled and workspace initialized: backend=trtllm, rank=0, "
               "world_size=8, max_token_num=2048, hidden_dim=7168")
    fus_059 = "[TP0] FlashInfer workspace initialized for rank 0, world_size 8"
    env = {"SGLANG_ENABLE_PCIE_CUSTOM_AR": "1", "OTHER": "x"}
    ev = allreduce_backend(_log(tmp_path, p2), env, [])
    assert (ev["backend"], ev["evidence"], ev["selected_by"]) == (P2_NAME, p2, {"SGLANG_ENABLE_PCIE_CUSTOM_AR": "1"})
    ev = allreduce_backend(_log(tmp_path, p2, ipc), {}, [])
    assert ev["backend"] == P2_NAME and "tries its custom allreduce first" in ev["note"]
    assert allreduce_backend(_log(tmp_path, p2.replace("65536", "0")), {}, [])["backend"] == NCCL_NAME
    assert allreduce_backend(_log(tmp_path, off, ipc), {}, [])["evidence"] == ipc
    ev = allreduce_backend(_log(tmp_path, off, ipc, ipc_fail), {}, [])
    assert (ev["backend"], ev["evidence"]) == (NCCL_NAME, ipc_fail)
    assert allreduce_backend(_log(tmp_path, off), {}, [])["backend"] == NCCL_NAME
    ev = allreduce_backend(_log(tmp_path), {}, [])
    assert ev["backend"] == UNKNOWN and ev["evidence"] is None
    assert allreduce_backend(tmp_path / "missing.log", {}, [])["backend"] == UNKNOWN
    for fus in (fus_523, fus_059):
        ev = allreduce_backend(_log(tmp_path, off, fus), {}, ["--enable-flashinfer-allreduce-fusion"])
        assert ev["fusion"] == fus and ev["selected_by"] == {"--enable-flashinfer-allreduce-fusion": True}
    ev = allreduce_backend(_log(tmp_path, off), {}, ["--enable-flashinfer-allreduce-fusion"])
    assert ev["fusion"] == "flag set, no fusion line in the log"
    p1_off = ("[TP0] FlashInfer allreduce fusion is disabled because SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 hands the "
              "decode/verify reductions to the PCIe-IPC allreduce on SM120. Using the unfused allreduce.")
    ev = allreduce_backend(_log(tmp_path, p1_off, off, ipc), {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"},
                           ["--flashinfer-allreduce-fusion-backend", "trtllm"])
    assert ev["backend"] == IPC_NAME and ev["fusion"] == p1_off
    assert ev["selected_by"] == {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1", "--flashinfer-allreduce-fusion-backend": "trtllm"}


def test_version_rules_and_p4_verify_ms():
    srv = {"version_env": [{"min_version": "0.5.21", "env": {"X": 1}},
                           {"min_version": "0.5.10", "max_version": "0.5.21", "env": {"Y": "1"}}]}
    assert server_tier.version_env(srv, "0.5.23")[0] == {"X": "1"}
    assert server_tier.version_env(srv, "0.5.10.post1")[0] == {"Y": "1"}
    assert server_tier.version_env(srv, "0.5.9")[0] == {} and server_tier.version_env(srv, "?")[0] == {}
    vp = {"median_of_records": {"verify_ms_median": 21.5}, "last": {"verify_ms_median": 30.0}}
    assert server_report.verify_ms_of(vp) == 21.5
    assert server_report.verify_ms_of({"last": {"verify_ms": {"median": 7.0}}}) == 7.0
    assert server_report.verify_ms_of(None) is None
    from sglpatch.gpu.server.ab import install_label

    assert install_label(str(Path.home() / "ml-env" / "bin" / "python3"), "0.5.9") == "0.5.9 (~/ml-env)"


def test_ab_usage_errors(tmp_path):
    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SglpatchError, match="use it with --tier kernel or --tier server"):
        regress.run_regress("cpu", "rtx6000x8-kimi-k25", str(tmp_path / "r"), str(root), ab="a,b")
    with pytest.raises(SglpatchError, match="both given: name the installs once, with --ab A,B"):
        regress.run_regress("kernel", "rtx6000x8-kimi-k25", str(tmp_path / "r"), str(root), ab="a,b", python="c,d")
    with pytest.raises(SglpatchError, match="give two interpreters"):
        regress.run_regress("server", "rtx6000x8-kimi-k25", str(tmp_path / "r"), str(root), ab="only-one")
    with pytest.raises(SglpatchError, match="do not go together"):
        regress.run_regress("server", "rtx6000x8-kimi-k25", str(tmp_path / "r"), str(root), ab="a,b",
                            parity_with=str(tmp_path))
    no_sglang = tmp_path / "bare" / "bin" / "python3"  # an interpreter without sglang: refused before A runs
    no_sglang.parent.mkdir(parents=True)
    no_sglang.write_text("#!/bin/sh\nexec python3 -S \"$@\"\n")
    no_sglang.chmod(0o755)
    with pytest.raises(SglpatchError, match="not an executable file"):
        regress.run_regress("server", "rtx6000x8-kimi-k25", str(tmp_path / "r"), str(root),
                            ab=f"{tmp_path / 'missing' / 'python3'},{no_sglang}")
    with pytest.raises(SglpatchError, match=r"--ab: A .*sglang does not import"):
        regress.run_regress("server", "rtx6000x8-kimi-k25", str(tmp_path / "r"), str(root), ab=f"{no_sglang},{no_sglang}")
    assert not list((tmp_path / "r").glob("*/server-*.log"))  # nothing was launched


def test_target_profile_turns_pcie_ipc_on_from_0521():
    from sglpatch.gpu.shared import profile as profiles

    prof = profiles.load_profile(Path(__file__).resolve().parents[1] / "targets" / "rtx6000x8-kimi-k25.toml")
    env, why = server_tier.version_env(prof["server"], "0.5.23")
    assert env == {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1", "SGLANG_ENABLE_PCIE_CUSTOM_AR": "0"} and why
    assert server_tier.version_env(prof["server"], "0.5.9")[0] == {}
