"""Tier cpu: the patch tests (tests/patches) against the installed, patched sglang."""

from __future__ import annotations

import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from sglpatch.gpu.procs import run_step, tail
from sglpatch.gpu.profiles import expand
from sglpatch.gpu.report import TierResult


def tier_cpu(prof: dict, project: Path, report_dir: Path, base_env: dict) -> TierResult:
    tr = TierResult("cpu")
    cfg = prof["cpu"]
    python = expand(cfg["python"] or sys.executable)
    tests = project / cfg["tests"]
    if not tests.exists():
        tr.fail(f"patch tests not found at {tests}")
        tr.summary = "no patch tests"
        return tr
    if cfg.get("import_check"):
        mod = cfg["import_check"]
        r = subprocess.run([python, "-c", f"import {mod}, sys; print(getattr({mod}, '__file__', ''));"
                            f" print(getattr({mod}, '__version__', ''))"],
                           capture_output=True, text=True, env=base_env, timeout=300, cwd="/")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            tr.fail(f"{mod} does not import with {python}: {last} (install the patched tree first)")
            tr.summary = f"{mod} not importable"
            return tr
        lines = r.stdout.splitlines() + ["", ""]
        tr.data["under_test"] = {"module": mod, "file": lines[0], "version": lines[1], "python": python}
    junit = report_dir / "cpu-junit.xml"
    # pytest runs with sglpatch's own interpreter (the conftest needs sglpatch + GitPython);
    # the interpreter holding the INSTALLED patched sglang is handed over in
    # SGLPATCH_PATCHED_PYTHON for the patch tests' `patched_python` fixture to use.
    runner = expand(cfg.get("pytest_python") or sys.executable)
    base_env = dict(base_env, SGLPATCH_PATCHED_PYTHON=python)
    cmd = [runner, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={junit}", *map(str, cfg.get("pytest_args", []))]
    res = run_step(cmd, base_env, report_dir / "cpu-pytest.log", cfg["timeout_s"], cwd=str(project))
    tr.data["pytest"] = res
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        for s in suites:
            for k in counts:
                counts[k] += int(s.get(k, 0))
    except (OSError, ET.ParseError):
        pass
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    tr.data["counts"] = counts
    tr.summary = (f"{counts['passed']} passed, {counts['failures']} failed, {counts['errors']} errors, "
                  f"{counts['skipped']} skipped")
    if res["timed_out"]:
        tr.fail(f"pytest timed out after {cfg['timeout_s']} s (killed); log {res['log']}")
    elif res["rc"] == 5:
        tr.fail(f"no patch tests collected from {tests}")
    elif res["rc"] != 0:
        tr.fail(f"pytest exit {res['rc']}: {tr.summary}; log {res['log']}")
    else:
        tr.status = "pass"
    tr.md = [f"- patched sglang from: `{python}` (SGLPATCH_PATCHED_PYTHON); pytest run by `{runner}`", f"- under test: {tr.data.get('under_test')}",
             f"- `{shlex.join(cmd)}`", f"- result: {tr.summary} (log `cpu-pytest.log`, junit `cpu-junit.xml`)"]
    if tr.status == "fail":
        tr.md += ["", "```", tail(report_dir / "cpu-pytest.log", 30), "```"]
    return tr
