"""The series on sglang 0.5.23 (issue 12): the recorded rebase replays, and P1/P4 work there.

* Replay: `scripts/rebase.sh --onto 0.5.23` from a fresh copy of the project (0.5.9 pin, the
  committed resolutions/0.5.23/) finishes unattended, `sglpatch check` passes on the result,
  and a stop + `--abort` restores the workdir and the project byte for byte.
* P1/P4 on SGLang 0.5.23's own modules (issue 18): tests/real_0523/ runs in a second venv
  with 0.5.23's pins (scripts/test.sh builds .venv-0523 once: transformers 5.19.0,
  flashinfer-python 0.7.2 --no-deps, requirements-test-0523.txt; torch from the main venv),
  importing the replayed tree; the lines the real start-up code logged feed the regression
  suite's evidence reader; every mutant of tests/mutants.py still applies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SERIES, copy_project, sglpatch, venv_0523
from test_rebase import snapshot

TARGET = "0.5.23"
RES = ROOT / "resolutions" / TARGET
SRT = "python/sglang/srt"
P1 = "0001-sm120-flashinfer-allreduce-fusion.patch"
P4 = "0004-eagle-verify-profiling.patch"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (RES / "resolutions.toml").is_file(), reason="no recorded rebase onto 0.5.23"),
]


def rebase_sh(workdir: Path, project: Path, *args: str):
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "rebase.sh"), "--workdir", str(workdir), "--project", str(project), *args],
        capture_output=True, text=True, env=env, timeout=900,
    )


@pytest.fixture(scope="module")
def base_059(tmp_path_factory):
    """The committed series applied on 0.5.9 (project copy + workdir), to be copied per test."""
    from sglpatch.stack import build

    top = tmp_path_factory.mktemp("p0523")
    project = copy_project(top / "project")
    build.apply(project, top / "wd", source="sdist")
    return project, top / "wd"


@pytest.fixture(scope="module")
def rebased(base_059, tmp_path_factory):
    import shutil

    top = tmp_path_factory.mktemp("replay")
    project = Path(shutil.copytree(base_059[0], top / "project", symlinks=True))
    shutil.rmtree(project / "lines")  # the rebase writes lines/0.5.23/ anew: compared with the committed one
    workdir = Path(shutil.copytree(base_059[1], top / "wd", symlinks=True))
    res = rebase_sh(workdir, project, "--onto", TARGET)
    return project, workdir, res


# --------------------------------------------------------------------------------------
# the replay


def test_replay_is_unattended_and_the_result_checks(rebased):
    from sglpatch.stack import status
    from sglpatch.series import read_series

    project, workdir, res = rebased
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    line = project / "lines" / TARGET  # the result is the line (issue 27); the primary stays on 0.5.9
    assert read_series(project).names == read_series(ROOT).names and 'version = "0.5.9"' in (project / "upstream.lock").read_text()
    assert read_series(line).names == [P1, P4]
    for name in (P1, P4):  # the recorded ports, byte for byte
        assert (line / "patches" / name).read_bytes() == (RES / name).read_bytes()
    # the committed lines/0.5.23/ is what the tool writes, byte for byte (its CHANGELOG up to the date)
    committed = ROOT / "lines" / TARGET
    for rel in ("series", "upstream.lock", *(f"patches/{n}" for n in (P1, P4))):
        assert (line / rel).read_bytes() == (committed / rel).read_bytes(), rel
    assert sorted(p.name for p in (line / "patches").iterdir()) == sorted(p.name for p in (committed / "patches").iterdir())
    dated = r" - \d{4}-\d{2}-\d{2}\n"
    import re

    assert re.sub(dated, "\n", (line / "CHANGELOG.md").read_text()) == re.sub(dated, "\n", (committed / "CHANGELOG.md").read_text())
    log = (line / "CHANGELOG.md").read_text()
    assert "superseded by upstream's FlashInfer PCIe-IPC allreduce" in log and "pull/19689" in log
    assert status.check(line, workdir) == []
    check = sglpatch("check", "--project", str(line), "--workdir", str(workdir))
    assert check.returncode == 0, check.stdout + check.stderr


def test_stop_then_abort_restores_bytes(base_059, tmp_path):
    import shutil

    project = Path(shutil.copytree(base_059[0], tmp_path / "project", symlinks=True))
    workdir = Path(shutil.copytree(base_059[1], tmp_path / "wd", symlinks=True))
    toml = project / "resolutions" / TARGET / "resolutions.toml"
    toml.write_text(toml.read_text().split(f'[patch."{P4}"]')[0])  # P4 unrecorded: the replay stops there
    before = snapshot(workdir, project)
    res = rebase_sh(workdir, project, "--onto", TARGET)
    assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-2000:]
    assert f"rebase stopped at patch 4/{len(SERIES)}: {P4}" in res.stdout
    res = rebase_sh(workdir, project, "--abort")
    assert res.returncode == 0, res.stderr
    assert snapshot(workdir, project) == before


# --------------------------------------------------------------------------------------
# P1/P4 on SGLang 0.5.23's own modules (tests/real_0523/, in the 0.5.23 venv)




@pytest.fixture(scope="module")
def tree(rebased) -> Path:
    project, workdir, res = rebased
    assert res.returncode == 0
    return workdir


@pytest.fixture(scope="module")
def real_0523(tree, tmp_path_factory):
    """tests/real_0523/ run once per session with the 0.5.23 venv's python on the replayed tree."""
    py = venv_0523()
    if not py.is_file():
        pytest.skip(f"no 0.5.23 venv at {py.parent.parent} (scripts/test.sh builds it, log: {py.parent.parent}.log; set SGLPATCH_TEST_VENV_0523)")
    out = tmp_path_factory.mktemp("real0523") / "startup-lines.jsonl"
    env = dict(os.environ, SGLPATCH_REAL_0523=str(tree / "python"), PYTHONPATH=str(tree / "python"), CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", SGLPATCH_0523_OUT=str(out))
    proc = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "-rA",
                           "--basetemp", str(out.parent / "basetemp"), str(ROOT / "tests" / "real_0523")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    return proc, out


def test_p1_p4_on_sglang_0523_modules(real_0523):
    proc, _ = real_0523
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = [ln for ln in proc.stdout.splitlines() if ln.startswith("PASSED")]
    for name in ("test_sm120_gate_through_server_args", "test_workspace_precheck_on_gpus_without_multicast",
                 "test_startup_line_names_the_decode_path", "test_allreduce_dispatch_with_pcie_ipc_on_and_off",
                 "test_on_times_real_worker_cycles", "test_off_wraps_nothing", "test_profiler_logs_the_verdict_sentence_exactly"):
        assert any(name in ln for ln in passed), f"{name} did not run: {proc.stdout[-3000:]}"


def test_regression_suite_reads_the_startup_line(real_0523, tmp_path):
    """The lines the real module logged, in a server log: the "which allreduce served" reader."""
    from sglpatch.gpu.server.evidence import FUSED_NAME, IPC_NAME, NCCL_NAME, allreduce_backend, describe

    _, out = real_0523
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    by_path = {ln.split(": ", 1)[1].split(" (", 1)[0]: ln for ln in lines}
    assert {"PCIe-IPC", "NCCL", "trtllm fused", "custom allreduce"} <= set(by_path)
    log = tmp_path / "server.log"
    for path, backend in (("PCIe-IPC", IPC_NAME), ("NCCL", NCCL_NAME), ("trtllm fused", FUSED_NAME)):
        log.write_text("[2026-12-01 TP0] FlashInfer PCIe-IPC all-reduce enabled (world=8)\n"  # older evidence, overruled
                       f"[2026-12-01 TP0] {by_path[path]}\n")
        ev = allreduce_backend(log, {}, [])
        assert ev["backend"] == backend and ev["evidence"].endswith(by_path[path]), ev
    assert "trtllm fused" in describe(ev)


def test_every_mutant_applies_to_the_current_series(tree, base_059):
    """The kept mutation check (tests/mutants.py, results/mutants/): each planted fault still
    matches the patched trees exactly once, so `scripts/mutants.sh` tests what the series is."""
    import mutants

    assert mutants.check("0.5.23", tree) == []
    assert mutants.check("0.5.9", base_059[1]) == []
    assert mutants.check("tool", ROOT) == []  # the tool's own math (issue 29)
    new = {line: [m for m in ms if m.kind in ("default", "number", "verdict", "ordering")] for line, ms in mutants.MUTANTS.items()}
    assert all(len(ms) >= 6 for ms in new.values()), {line: len(ms) for line, ms in new.items()}
    table = json.loads((ROOT / "results" / "mutants" / "mutants.json").read_text())
    assert {(r["line"], r["id"]) for r in table} == {(line, m.id) for line, ms in mutants.MUTANTS.items() for m in ms}
    assert all(r["killed"] for r in table), [r["id"] for r in table if not r["killed"]]


# --------------------------------------------------------------------------------------
# apply --venv for a wheel-only release: the pins from the locked wheel


def test_venv_dry_run_reads_the_pins_from_the_locked_wheel(rebased, tmp_path):
    """`apply --line 0.5.23 --venv --dry-run` on the replay's 0.5.23 line: no --release-artifact; the
    release's Requires-Dist come from the locked wheel (index-verified, sglpatch.upstream.artifacts)."""
    import os
    import shutil

    uv = shutil.which("uv") or shutil.which("uv", path=os.path.dirname(sys.executable))
    if not uv:
        pytest.skip("uv not found (the dry run resolves with uv here)")
    project = rebased[0]
    assert 'filename = "sglang-0.5.23-cp311' in (project / "lines" / TARGET / "upstream.lock").read_text()
    new = tmp_path / "new"
    # the pins, not this box's driver (a CI box has none: the preflight would refuse on that alone)
    env = dict(os.environ, PATH=f"{os.path.dirname(uv)}:{os.environ['PATH']}", SGLPATCH_PREFLIGHT_NO_DRIVER="1")
    proc = sglpatch("apply", "--project", str(project), "--line", TARGET, "--workdir", str(tmp_path / "fork"), "--venv", str(new), "--dry-run",
                    "--python", sys.executable, env=env)
    assert "requirements from sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl" in proc.stderr, proc.stderr[-2000:]
    assert "pass --release-artifact" not in proc.stderr and "pip download of sglang==0.5.23 failed" not in proc.stderr
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("preflight: verdict: "), proc.stdout[-2000:] + proc.stderr[-2000:]
    if proc.returncode == 0:  # resolved for this interpreter: the release's own pins
        pins = proc.stdout.split("the release's pins: ", 1)[1].split("\n", 1)[0].split()
        assert {"torch==2.14.1", "flashinfer-python==0.7.2", "sglang-kernel==0.4.10", "transformers==5.19.0"} <= set(pins)
    else:  # this machine's Python cannot take the pins: one line per failed condition
        fails = [line for line in proc.stdout.splitlines() if line.startswith("preflight: FAIL")]
        assert proc.returncode == 1 and fails and all(len(line) < 400 for line in fails), proc.stdout[-2000:]
        assert "preflight refused" in proc.stderr.strip().splitlines()[-1]
    assert not new.exists() and not (tmp_path / "fork").exists()
