"""Tier cpu: the patch tests (tests/patches) against the installed, patched sglang.

The Python under test: --python, else the one `apply` last installed the workdir's tree into
(recorded in the workdir), else the profile's [cpu] python, else this interpreter. One that does
not exist, lacks sglang or lacks sglang's own dependencies cannot run here (exit 125, with what
to do); an import that fails inside sglang's own code is a failure (a patch broke it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from sglpatch import pyenv
from sglpatch.gpu import series_side
from sglpatch.gpu.procs import run_step, tail
from sglpatch.gpu.profiles import expand
from sglpatch.gpu.report import TierResult


def cpu_python(prof: dict, python: str | None, workdir: Path | None) -> tuple[str, str]:
    """(the interpreter under test, where that choice came from)."""
    if python:
        return expand(python), "--python"
    recorded = series_side.installed_python(workdir) if workdir else None
    if recorded:
        return recorded, f"the Python `apply` installed {workdir} into"
    if prof["cpu"]["python"]:
        return expand(prof["cpu"]["python"]), "the profile's [cpu] python"
    return sys.executable, "this interpreter (no --python, no install recorded, none in the profile)"


def _cannot_run(tr: TierResult, summary: str, why: str) -> TierResult:
    tr.status, tr.summary = "cannot_run", summary
    tr.md = [f"- cannot run here: {why}"]
    tr.data["cannot_run"] = why
    return tr


def _check_under_test(tr: TierResult, mod: str, python: str, where: str, env: dict) -> bool:
    """Whether the module under test imports with python; else tr says why (cannot run, or failed)."""
    st = pyenv.module_state(python, module=mod, env=env)
    if st is None:
        _cannot_run(tr, f"{python} does not run", f"{python} ({where}) does not run as a Python")
        return False
    if st.ok:
        tr.data["under_test"] = {"module": mod, "file": st.file, "version": st.version, "python": python, "from": where}
        return True
    if st.not_installed:
        _cannot_run(tr, f"{mod} not installed in {python}",
                    f"{mod} is not installed in {python} ({where}): install the patched tree first "
                    f"(scripts/apply.sh --python {python}), or pass --python PATH")
        return False
    if st.lacks_dependencies:
        tree = st.tree or f"<the tree {mod} is installed from>"
        cmd = pyenv.deps_command(python, tree, st.dist_version, pyenv.find_uv())
        _cannot_run(tr, f"{mod}'s dependencies missing in {python}",
                    f"{mod} does not import with {python} ({where}): {pyenv.missing_summary(st)}; install them: {cmd}; "
                    "or build a complete new venv: scripts/apply.sh --venv NEWDIR")
        return False
    tr.fail(f"{mod} does not import with {python} ({where}): {st.error}")
    tr.summary = f"{mod} does not import"
    return False


def tier_cpu(prof: dict, project: Path, report_dir: Path, base_env: dict, python: str | None = None,
             where: str = "the profile's [cpu] python") -> TierResult:
    tr = TierResult("cpu")
    cfg = prof["cpu"]
    python = expand(python or cfg["python"] or sys.executable)
    tests = project / cfg["tests"]
    if not tests.exists():
        tr.fail(f"patch tests not found at {tests}")
        tr.summary = "no patch tests"
        return tr
    if not (shutil.which(python) if os.sep not in python else os.path.isfile(python)):
        return _cannot_run(tr, f"no Python at {python}",
                           f"{python} ({where}) does not exist: pass --python PATH (the Python you serve from), "
                           "or install the patched tree with scripts/apply.sh first")
    if cfg.get("import_check") and not _check_under_test(tr, cfg["import_check"], python, where, base_env):
        return tr
    # pytest runs with sglpatch's own interpreter (the conftest needs sglpatch + GitPython);
    # the interpreter holding the INSTALLED patched sglang is handed over in
    # SGLPATCH_PATCHED_PYTHON for the patch tests' `patched_python` fixture to use.
    runner = expand(cfg.get("pytest_python") or sys.executable)
    has_pytest = pyenv.module_state(runner, module="pytest", timeout=60)
    if has_pytest is None or not has_pytest.ok:
        return _cannot_run(tr, "no pytest", f"the test runner {runner} has no pytest: {runner} -m pip install 'pytest>=8'")
    junit = report_dir / "cpu-junit.xml"
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
    tr.md = [f"- patched sglang from: `{python}` ({where}; SGLPATCH_PATCHED_PYTHON); pytest run by `{runner}`",
             f"- under test: {tr.data.get('under_test')}",
             f"- `{shlex.join(cmd)}`", f"- result: {tr.summary} (log `cpu-pytest.log`, junit `cpu-junit.xml`)"]
    if tr.status == "fail":
        tr.md += ["", "```", tail(report_dir / "cpu-pytest.log", 30), "```"]
    return tr
