"""The kernel tier with every allreduce candidate, on CPU: the real worker (kernel_bench under
torchrun, gloo, 2 ranks) in two interpreters — this one (install A) and the same one with
tests/shims/kb_install_b on PYTHONPATH (install B: flashinfer 0.7.2's PcieIpcAllReduceWorkspace
and sglang-kernel's fused_add_rmsnorm stood in, since the real ones need CUDA) — backend discovery
per install, the merge, the topology (a fake nvidia-smi printing the fixtures), the decision
table, a fast wrong candidate failing the tier, a hung one named while the rest still run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import venv_0523
from sglpatch.errors import SglpatchError
from sglpatch.gpu import regress
from sglpatch.gpu.kernel import launch as kernel_launch
from sglpatch.gpu.shared import profile as profiles

ROOT = Path(__file__).resolve().parents[1]
SHIM_B = ROOT / "tests" / "shims" / "kb_install_b"
TOPO = ROOT / "tests" / "fixtures" / "topo"

# skipped without torch, found not imported: collecting this file in every xdist worker must not load it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def install_b(tmp_path: Path) -> str:
    """An interpreter path: this Python with install B's stand-ins in front of its path."""
    p = tmp_path / "venv-b" / "bin" / "python3"
    p.parent.mkdir(parents=True)
    p.write_text(f"#!/bin/sh\nPYTHONPATH={SHIM_B}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} \"$@\"\n")
    p.chmod(0o755)
    return str(p)


def fake_nvidia_smi(tmp_path: Path) -> str:
    p = tmp_path / "nvidia-smi"
    p.write_text(f"#!/bin/sh\ncase \"$2\" in -m) cat '{TOPO}/two-sockets-no-switch.txt';; "
                 f"-p2p) cat '{TOPO}/p2p-two-sockets-cns.txt';; esac\n")
    p.chmod(0o755)
    return str(p)


def project(tmp_path: Path, kernel_extra: str = "", env: str = "", sizes: str = "[1, 3, 8]", step_timeout: int = 60) -> Path:
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "targets" / "c.toml").write_text(textwrap.dedent(f"""
        [env]
        {env}
        [kernel]
        python = "{sys.executable}"
        device = "cpu"
        world_size = 2
        hidden = 64
        sizes = {sizes}
        samples = 3
        inner = 2
        timeout_s = 240
        step_timeout_s = {step_timeout}
        pcie_ipc_max_rows = 4
        nvidia_smi = "{fake_nvidia_smi(tmp_path)}"
        """) + textwrap.dedent(kernel_extra))
    return proj


def kernel_doc(report: Path) -> dict:
    return json.loads((report / "report.json").read_text())["tiers"]["kernel"]


DECISION = """
    [kernel.decision]
    layers = 61
    decode_step_ms = 12.2
    spec_cycle_ms = 30.0
    [kernel.decision.confirm]
    pcie_ipc = "scripts/regress.sh --tier server --ab A,B --modes no_spec,eagle3"
    """


def test_two_installs_one_report(tmp_path):
    b = install_b(tmp_path)
    proj = project(tmp_path, 'backends = ["nccl", "nccl_add_rmsnorm", "pcie_ipc", "b12x_oneshot", "b12x_fused", '
                   '"b12x_twoshot", "mscclpp"]\n'
                   'required_backends = ["nccl"]\n' + DECISION, env='NCCL_PROTO = "LL"\nNCCL_ALGO = "Ring"')
    srv = tmp_path / "srv"
    srv.mkdir()
    (srv / "report.json").write_text(json.dumps({"tiers": {"server": {"modes": [
        # gloo on CPU takes ~0.1-10 ms per allreduce: a step and a cycle long enough for 122 of them
        {"mode": "no_spec", "benchmark": {"median_tpot_ms": 5000.0}},
        {"mode": "eagle3", "benchmark": {"accept_length": 2.05}, "verify_profile": {"median_of_records": {
            "draft_ms_median": 800.0, "verify_ms_median": 9000.0, "extend_ms_median": 200.0}}}]}}}))
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), ab=f"{sys.executable},{b}",
                              with_profile=str(srv))
    k = kernel_doc(tmp_path / "r")
    assert res["exit_code"] == 0, k["failures"]
    a_inst, b_inst = k["installs"]
    # discovery per install: B's stand-ins import there only, each absent backend with its reason
    assert b_inst["hardware"]["versions"]["flashinfer-python"] == "0.7.2"
    assert b_inst["hardware"]["versions"]["sglang-kernel"] == "0.4.1"
    assert "flashinfer-python" not in a_inst["hardware"]["versions"]
    assert a_inst["absent"]["pcie_ipc"].startswith("flashinfer.comm: ModuleNotFoundError")
    assert "sgl_kernel" in a_inst["absent"]["nccl_add_rmsnorm"]
    assert "pcie_ipc" not in b_inst["absent"] and "nccl_add_rmsnorm" not in b_inst["absent"]
    for inst in (a_inst, b_inst):
        assert inst["absent"]["mscclpp"] == "MSCCL++ needs CUDA devices"
    assert "No module named 'b12x'" in a_inst["absent"]["b12x_oneshot"]
    assert b_inst["absent"]["b12x_twoshot"].startswith("PCIeTwoShotBF16 supports world size 4 only")
    assert b_inst["label"] == f"B: torch {b_inst['hardware']['versions']['torch']} ({tmp_path / 'venv-b'})"
    # the merge: every row labelled with its install; B measured PCIe-IPC, declined past its workspace
    got = {(r["backend"], r["install"], r["mode"], r["rows"]): r["status"] for r in k["results"]}
    for mode in ("eager", "graph"):
        for n in (1, 3):
            for b_ in ("pcie_ipc", "nccl_add_rmsnorm", "b12x_oneshot", "b12x_fused"):
                assert got[(b_, "B", mode, n)] == "ok", b_
            assert got[("nccl", "A", mode, n)] == got[("nccl", "B", mode, n)] == "ok"
            assert got[("nccl_p2p_off", "A", mode, n)] == got[("nccl_default_env", "A", mode, n)] == "ok"
        assert got[("pcie_ipc", "B", mode, 8)] == "declined"
        assert got[("pcie_ipc", "B", mode, 4)] == "ok"  # the served row count (pcie_ipc_max_rows) is measured too
        assert ("nccl", "B", mode, 4) not in got
    assert not any(i == "B" and b_.endswith(("_p2p_off", "_default_env")) for b_, i, _, _ in got)
    # every path over back-to-back replays against NCCL (issue 53): the fused ones too, per install
    rep = {(r["backend"], r["install"], r["rows"]): r["status"] for r in k["replay"]}
    for b_ in ("nccl", "pcie_ipc", "nccl_add_rmsnorm", "b12x_oneshot", "b12x_fused"):
        assert rep[(b_, "B", 1)] == rep[(b_, "B", 3)] == "ok", b_
    assert rep[("nccl", "A", 16)] == "ok" and rep[("pcie_ipc", "B", 16)] == "declined"  # past its workspace
    # NCCL's defaults: the profile's NCCL_* removed for that launch only
    de = next(L for L in k["launches"] if "--unset-env" in L["cmd"])
    assert de["env_removed"] == ["NCCL_ALGO", "NCCL_PROTO"] and a_inst["default_env"]["removed"] == de["env_removed"]
    assert k["hardware"]["env"]["NCCL_PROTO"] == "LL"
    # PCIe-IPC as P5 serves it: seed launch configurations, nothing tuned, no cache written anywhere
    info = b_inst["backend_info"]["pcie_ipc"]
    assert (info["buckets"], info["max_numel"], info["tuned"], info["tune_cache"]) == ([4], 256, False, os.devnull)
    assert not (tmp_path / "r" / "scratch" / "flashinfer-autotune").exists()
    assert not any(L["backends"] == ["pcie_ipc", "pcie_ipc_tuned"] for L in k["launches"])
    # the topology
    t = k["topology"]
    assert t["class"] == "two-sockets-no-switch" and t["numa"]["5"] == 1 and t["p2p_missing"] == ["2->5", "5->2"]
    # the decision table, from the server report's step and cycle
    d = k["decision"]
    assert d["baseline"]["decode_step_ms"] == 5000.0 and d["baseline"]["spec_cycle_ms"] == 10000.0
    assert d["served"] == "nccl [A]" and 2.05 in d["accept_lengths"]
    ranked = {(c["backend"], c["install"]) for c in d["candidates"]}
    assert {("nccl", "A"), ("nccl", "B"), ("pcie_ipc", "B"), ("b12x_oneshot", "B"), ("b12x_fused", "B"),
            ("nccl_p2p_off", "A")} <= ranked
    fused = next(c for c in d["candidates"] if c["backend"] == "b12x_fused")
    assert fused["fused"] and "less the separate add-RMSNorm" in fused["t_decode_how"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "**Class: `two-sockets-no-switch`**" in md and "GPU4 1" in md and "**not OK: 2->5, 5->2**" in md
    assert " pcie_ipc [B] |" in md and "| **pcie_ipc** | B |" in md and "a PROJECTION" in md
    assert "B: torch" in md and "| 0.7.2 |" in md and "Absent backends (install A:" in md


def test_a_fast_wrong_candidate_fails_the_tier(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLPATCH_STANDIN_PCIE_IPC", "wrong")
    proj = project(tmp_path, 'backends = ["nccl", "pcie_ipc"]\nrequired_backends = ["nccl"]\n'
                   'p2p_disabled_run = false\n' + DECISION, sizes="[1, 3]")
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), python=install_b(tmp_path))
    k = kernel_doc(tmp_path / "r")
    assert res["exit_code"] == 1
    wrong = [f for f in k["failures"] if f.startswith("WRONG RESULT pcie_ipc")]
    assert len(wrong) == 6 and "rank 1: max abs error 1.0" in wrong[0]  # rows 1, 3 and the served 4
    assert sorted({f.split("[")[1].split(",")[0] for f in wrong}) == ["1", "3", "4"]
    assert all(r["status"] == "ok" for r in k["results"] if r["backend"] == "nccl")
    assert {x["backend"]: x["why"] for x in k["decision"]["not_ranked"]}["pcie_ipc"].startswith("a WRONG result")


def test_a_replay_that_differs_from_nccl_is_named_by_the_real_worker(tmp_path):
    """The worker's replay check (gloo, 2 ranks): selftest_wrong's fault, planted on the device at replay 0
    on the last rank, is named once per backend; NCCL's replays are the same as NCCL."""
    proj = project(tmp_path, 'backends = ["nccl", "selftest_wrong"]\nrequired_backends = ["nccl"]\n'
                   'p2p_disabled_run = false\nreplay_iterations = 8\nreplay_sizes = [1, 3]\n', sizes="[1]")
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj))
    k = kernel_doc(tmp_path / "r")
    assert res["exit_code"] == 1
    replay = [f for f in k["failures"] if f.startswith("REPLAY MISMATCH: selftest_wrong")]
    assert len(replay) == 1 and "[1,64] x 8 back-to-back CUDA-graph replays: 1 differ from NCCL on the same inputs, " \
        "first replay 0 on rank 1, output element [0,7]" in replay[0], k["failures"]
    assert [(r["rows"], r["status"]) for r in k["replay"] if r["backend"] == "selftest_wrong"] == [(1, "mismatch"), (3, "mismatch")]
    assert {r["status"] for r in k["replay"] if r["backend"] == "nccl"} == {"ok"}


def test_a_hung_backend_is_named_and_the_rest_are_relaunched(tmp_path):
    proj = project(tmp_path, 'backends = ["selftest_hang", "nccl"]\nrequired_backends = ["nccl"]\n'
                   'p2p_disabled_run = false\n', sizes="[1]", step_timeout=3)
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), quick=True)
    k = kernel_doc(tmp_path / "r")
    assert res["exit_code"] == 0, k["failures"]
    # torchrun exits 1 when a worker's watchdog ends it (exit 3); whichever rank notices first speaks
    hang = k["errors"]["selftest_hang"]
    assert hang.startswith("launch exited 1 in this backend (log kernel-main.log): [kernel_bench] HANG rank ")
    assert hang.endswith("(step timeout 3 s) in selftest_hang: set-up")
    assert k["installs"][0]["hung"] == ["selftest_hang"]
    assert [L["backends"] for L in k["launches"]] == [["selftest_hang", "nccl"], ["nccl"]]
    assert all(L["survivors"] == [] for L in k["launches"])
    assert {(r["backend"], r["status"]) for r in k["results"]} == {("nccl", "ok")}
    assert k["quick"] and "`--quick`" in (tmp_path / "r" / "report.md").read_text()


def test_launch_plan_and_usage_errors(tmp_path):
    prof = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    a = {"key": "A", "python": "/py/a"}
    ls = kernel_launch.kernel_launches(prof, 8, tmp_path, a, True)
    assert [L["name"] for L in ls] == ["main", "p2p_off", "default_env"]
    # torchrun's log folder in the report's scratch, not a torchelastic_* folder left in TMPDIR
    assert ls[0]["cmd"][6:10] == ["--log-dir", str(tmp_path / "scratch" / "torchelastic"), "-m", "sglpatch.gpu.kernel.bench"]
    assert ls[2]["unset"] == ["NCCL_ALGO", "NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_NTHREADS", "NCCL_P2P_LEVEL",
                              "NCCL_PROTO"]
    cmd = ls[0]["cmd"]
    assert cmd[cmd.index("--pcie-ipc-rows") + 1] == "3,6,12,24" and "--pcie-ipc-max-rows" not in cmd
    assert "pcie_ipc" in ls[0]["backends"] and "--pcie-ipc-tune" not in cmd  # the default: no tuned leg
    assert [L["name"] for L in kernel_launch.kernel_launches(prof, 8, tmp_path, {"key": "B", "python": "/b"}, False)] \
        == ["main-B"]
    q = kernel_launch.kernel_launches(prof, 8, tmp_path, a, True, quick=True)[0]["cmd"]
    assert q[q.index("--sizes") + 1] == "1,3" and q[q.index("--samples") + 1] == "8"
    env = kernel_launch.worker_env({"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"] == f"{Path(kernel_launch.__file__).resolve().parents[3]}{os.pathsep}/x"  # the sglpatch under test
    with pytest.raises(SglpatchError, match="not an executable interpreter"):
        kernel_launch.interpreters({}, f"{sys.executable},{tmp_path / 'nope'}")
    with pytest.raises(SglpatchError, match="the same interpreter twice"):
        kernel_launch.interpreters({}, f"{sys.executable},{sys.executable}")
    with pytest.raises(SglpatchError, match="compares installs in the kernel or the server tier"):  # one spelling: --ab
        regress.run_regress("cpu", None, str(tmp_path / "r"), str(ROOT), python=f"{sys.executable},{sys.executable}")
    with pytest.raises(SglpatchError, match="belong to the kernel tier"):
        regress.run_regress("server", None, str(tmp_path / "r"), str(ROOT), quick=True)


def test_nccl_defaults_also_when_a_sitecustomize_sets_the_tuning(tmp_path):
    """The user keeps their NCCL tuning in a sitecustomize.py: removing it from the launch's env is
    not enough, the worker removes what the interpreter set again before NCCL starts."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['NCCL_PROTO'] = 'LL'\nos.environ['NCCL_ALGO'] = 'Ring'\n")
    py = tmp_path / "venv-c" / "bin" / "python3"
    py.parent.mkdir(parents=True)
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    proj = project(tmp_path, 'backends = ["nccl"]\nrequired_backends = ["nccl"]\np2p_disabled_run = false\n',
                   env='NCCL_PROTO = "LL"\nNCCL_ALGO = "Ring"', sizes="[1]")
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), python=str(py))
    k = kernel_doc(tmp_path / "r")
    assert res["exit_code"] == 0, k["failures"]
    assert k["installs"][0]["default_env"] == {"removed": ["NCCL_ALGO", "NCCL_PROTO"],
                                               "still_set_inside": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}}
    default = json.loads((tmp_path / "r" / "kernel-default_env.json").read_text())
    assert not any(n.startswith("NCCL_") for n in default["hardware"]["env"])
    assert {r["backend"] for r in k["results"]} == {"nccl", "nccl_default_env"}
    assert "the interpreter set ['NCCL_ALGO', 'NCCL_PROTO'] again itself" in (tmp_path / "r" / "report.md").read_text()


def test_pcie_ipc_in_the_stress_run(tmp_path):
    """--stress with install B: every PCIe-IPC result compared with the reference allreduce; a
    backend without a stress mode is listed, not an error."""
    import subprocess

    out = tmp_path / "kb.json"
    cmd = [install_b(tmp_path), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(tmp_path / "torchelastic"), "-m", "sglpatch.gpu.kernel.bench",
           "--device", "cpu", "--hidden", "64", "--stress", "240",
           "--stress-sizes", "1,3", "--stress-batch", "48", "--backends", "pcie_ipc,b12x_twoshot,flashinfer_fused",
           "--out", str(out), "--scratch-dir", str(tmp_path)]
    env = kernel_launch.worker_env(dict(os.environ, OMP_NUM_THREADS="1"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert {(x["backend"], x["mode"], x["status"], x["iterations_done"]) for x in doc["stress"]} == \
        {("pcie_ipc", "eager", "ok", 240), ("pcie_ipc", "graph", "ok", 240)}
    assert doc["absent"]["b12x_twoshot"].startswith("PCIeTwoShotBF16 supports world size 4 only")
    assert doc["absent"]["flashinfer_fused"].startswith("not in the stress run (fused with RMSNorm")


def test_two_real_venvs(tmp_path):
    """Discovery with a second real venv: the 0.5.23 test venv that scripts/test.sh builds (real
    flashinfer-python 0.7.2, installed --no-deps on a CPU box), next to this one."""
    venv = os.environ.get("SGLPATCH_TEST_VENV_0523", "")
    py = venv_0523()  # once scripts/test.sh's background build of it is done
    if not venv or not py.is_file():
        pytest.skip(f"no 0.5.23 test venv ($SGLPATCH_TEST_VENV_0523; scripts/test.sh builds it, log: {venv}.log)")
    proj = project(tmp_path, 'backends = ["nccl", "pcie_ipc", "b12x_oneshot"]\nrequired_backends = ["nccl"]\n'
                   'p2p_disabled_run = false\n', sizes="[1]")
    res = regress.run_regress("kernel", "c", str(tmp_path / "r"), str(proj), ab=f"{sys.executable},{py}")
    k = kernel_doc(tmp_path / "r")
    assert res["exit_code"] == 0, k["failures"]
    a, b = k["installs"]
    assert b["hardware"]["versions"]["flashinfer-python"] == "0.7.2" and "flashinfer-python" not in a["hardware"]["versions"]
    assert a["absent"]["pcie_ipc"].startswith("flashinfer.comm: ModuleNotFoundError")
    # the real 0.7.2 on a CPU box: flashinfer.comm lacks a dependency or the workspace finds no GPU;
    # either way a reason, never a crash
    assert b["absent"].get("pcie_ipc") or b["errors"].get("pcie_ipc")
    assert b["absent"]["b12x_oneshot"]
    assert {(r["backend"], r["install"]) for r in k["results"] if r["status"] == "ok"} == {("nccl", "A"), ("nccl", "B")}
