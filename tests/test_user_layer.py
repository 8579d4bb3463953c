"""The README's regress -> bisect flow as a new user runs it (issue 50), on the user-environment
layer (tests/userenv.py): a fresh clone, a scratch HOME, PATH /usr/bin:/bin, the scripts' own
.tool-venv made from the package index (it has no pytest-xdist), a scratch serving venv.

1. apply.sh into the serving venv;
2. regress.sh --tier cpu against it passes: every patch test, run by the tool venv's pytest;
3. a planted failing patch test (it fails from P4 on) gives exit 1, and bisect.sh --triage names P4;
4. the harness broken as it shipped (xdist's hook without optionalhook) gives 125 and no verdict:
   bisect.sh --triage says the command could not run, never "regression is upstream".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import SERIES
from userenv import User

P4 = "0004-eagle-verify-profiling.patch"
PLANTED = '''\
def test_no_verify_profiler_yet(patched_tree):
    """Planted: fails on every tree that carries P4 (it adds spec_profiler.py)."""
    assert not (patched_tree / "python/sglang/srt/speculative/spec_profiler.py").exists()
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    u = User(tmp_path_factory.mktemp("user"))
    u.python = u.serving_venv()
    # the planted profile: the target's, its cpu tier on tests/planted (the shipped conftest and harness above it)
    prof = (u.clone / "targets" / "rtx6000x8-kimi-k25.toml").read_text()
    (u.clone / "targets" / "planted.toml").write_text(prof.replace('tests = "tests/patches"', 'tests = "tests/planted"'))
    (u.clone / "tests" / "planted").mkdir()
    (u.clone / "tests" / "planted" / "test_planted.py").write_text(PLANTED)
    return u


@pytest.fixture(scope="module")
def applied(user):
    proc = user.run("bash", "scripts/apply.sh", "--python", user.python)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_apply_makes_the_tool_venv_and_installs_into_the_serving_venv(user, applied):
    out = applied.stdout
    assert f"{user.python} imports sglang 0.5.9 from {user.home}/sglang-fork/python/sglang/__init__.py" in out, out
    assert f"carries {len(SERIES)} patches:" in out, out
    assert f"setting up the sglpatch tool in {user.clone}/.tool-venv (first use" in applied.stderr, applied.stderr
    tool_py = user.clone / ".tool-venv" / "bin" / "python"
    # the scripts' own venv, as they build it: pytest, and no pytest-xdist (the harness must load without it)
    probe = user.run(tool_py, "-c", "import importlib.util as u; print(bool(u.find_spec('pytest')), bool(u.find_spec('xdist')))")
    assert probe.stdout.split() == ["True", "False"], probe


def test_regress_cpu_tier_passes_from_the_tools_own_venv(user, applied):
    proc = user.run("bash", "scripts/regress.sh", "--tier", "cpu", "--python", user.python)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    m = re.fullmatch(r"tier cpu: pass: (\d+) passed, 0 failed, 0 errors, (\d+) skipped", lines[0])
    assert m and int(m.group(1)) >= 100, lines
    assert lines[-1].startswith("regress: pass (exit 0); report: ") and lines[-1].endswith("/report.md"), lines
    report = json.loads((user.clone / lines[-1].split("report: ")[1]).parent.joinpath("report.json").read_text())
    cpu = report["tiers"]["cpu"]
    assert cpu["outcome"] == "passed" and cpu["pytest"]["cmd"][0] == str(user.clone / ".tool-venv" / "bin" / "python")
    assert cpu["under_test"]["python"] == str(user.python)


def test_a_planted_failing_patch_test_fails_and_bisect_names_its_patch(user, applied):
    regress = ["scripts/regress.sh", "--tier", "cpu", "--profile", "planted", "--python", user.python]
    proc = user.run("bash", *regress)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.startswith("tier cpu: fail: 0 passed, 1 failed, 0 errors, 0 skipped\n"), proc.stdout
    assert "test_planted.py::test_no_verify_profiler_yet" in proc.stdout
    before = sorted(p.name for p in user.clone.glob("regress-*"))
    bis = user.run("bash", "scripts/bisect.sh", "--triage", "--", *regress)
    assert bis.returncode == 0, bis.stdout + bis.stderr[-3000:]
    assert "regression is in the series (exit codes: 0 on GOOD, 1 on BAD): bisecting" in bis.stderr, bis.stderr
    assert f"  patch:       {P4} (#4 of {len(SERIES)})" in bis.stdout, bis.stdout
    # each step's report under the bisect's log folder, none left in the checkout; no misleading note
    assert sorted(p.name for p in user.clone.glob("regress-*")) == before
    logs = Path(re.search(r"^logs: (.+)$", bis.stdout, re.M).group(1))
    assert logs.is_relative_to(user.home / "sglang-fork" / ".git") and list(logs.glob("step-01-regress/*/report.json")), logs
    assert "note:" not in bis.stderr and "warning:" not in bis.stderr, bis.stderr


def test_a_broken_harness_gives_125_and_no_verdict(user, applied):
    """The harness as it shipped: xdist's hook without optionalhook, which the tool venv's pytest refuses."""
    harness = user.clone / "tests" / "harness.py"
    text = harness.read_text()
    broken = text.replace("@pytest.hookimpl(optionalhook=True)  # xdist's hook", "# xdist's hook")
    assert broken != text
    harness.write_text(broken)
    regress = ["scripts/regress.sh", "--tier", "cpu", "--profile", "planted", "--python", user.python]
    try:
        proc = user.run("bash", *regress)
        assert proc.returncode == 125, proc.stdout + proc.stderr[-2000:]
        assert proc.stdout.startswith("tier cpu: cannot_run: pytest could not run the patch tests: pytest's internal error: "
                                      "pluggy._manager.PluginValidationError: unknown hook 'pytest_configure_node'"), proc.stdout
        assert "regress: cannot_run (exit 125)" in proc.stdout
        bis = user.run("bash", "scripts/bisect.sh", "--triage", "--", *regress)
        assert bis.returncode == 125, bis.stdout + bis.stderr[-3000:]
        assert "CMD could not run here: all 2 run(s) exited" in bis.stdout, bis.stdout
        assert "regression is" not in bis.stdout + bis.stderr and "first bad" not in bis.stdout
    finally:
        harness.write_text(text)
