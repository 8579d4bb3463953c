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
import json
from pathlib import Path

from sglpatch.pythonenv import interpreter
from sglpatch.gpu.shared import series_side
from sglpatch.gpu.shared.step_runner import run_step, tail
from sglpatch.gpu.shared.profile import expand
from sglpatch.gpu.shared.plan import Tier
from sglpatch.gpu.shared.report import TierResult
from sglpatch.gpu.cpu import outcome, pytest_record


def _read_record(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _tail_text(log: str) -> str:
    return tail(Path(log), 200)


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


def _check_under_test(tier: Tier, mod: str, python: str, where: str, env: dict) -> bool:
    """Whether the module under test imports with python; else the tier's result says why (cannot run, or failed)."""
    tr = tier.result
    st = interpreter.module_state(python, module=mod, env=env)
    if st is None:
        tier.cannot_run(f"{python} does not run", f"{python} ({where}) does not run as a Python")
        return False
    if st.ok:
        tr.data["under_test"] = {"module": mod, "file": st.file, "version": st.version, "python": python, "from": where}
        return True
    if st.not_installed:
        tier.cannot_run(f"{mod} not installed in {python}",
                    f"{mod} is not installed in {python} ({where}): install the patched tree first "
                    f"(scripts/apply.sh --python {python}), or pass --python PATH")
        return False
    if st.lacks_dependencies:
        tree = st.tree or f"<the tree {mod} is installed from>"
        cmd = interpreter.deps_command(python, tree, st.dist_version, interpreter.find_uv())
        tier.cannot_run(f"{mod}'s dependencies missing in {python}",
                    f"{mod} does not import with {python} ({where}): {interpreter.missing_summary(st)}; install them: {cmd}; "
                    "or build a complete new venv: scripts/apply.sh --venv NEWDIR")
        return False
    tr.fail(f"{mod} does not import with {python} ({where}): {st.error}", outcome="under_test_broken")
    tr.summary = f"{mod} does not import"
    return False


class CpuTier(Tier):
    """The patch tests against the installed, patched sglang (pytest, run by sglpatch's interpreter)."""

    name = "cpu"

    def check(self) -> bool:
        plan, tr = self.plan, self.result
        single = plan.python if plan.python and "," not in plan.python else None
        self.python, self.where = cpu_python(plan.profile, single, plan.workdir)
        cfg = plan.profile["cpu"]
        python, where = self.python, self.where
        self.tests = plan.project / cfg["tests"]
        if not self.tests.exists():
            tr.fail(f"patch tests not found at {self.tests}")
            tr.summary = "no patch tests"
            return False
        if not (shutil.which(python) if os.sep not in python else os.path.isfile(python)):
            return self.cannot_run(f"no Python at {python}",
                                   f"{python} ({where}) does not exist: pass --python PATH (the Python you serve "
                                   "from), or install the patched tree with scripts/apply.sh first")
        if cfg.get("import_check") and not _check_under_test(self, cfg["import_check"], python, where, plan.base_env):
            return False
        # pytest runs with sglpatch's own interpreter (the conftest needs sglpatch + GitPython);
        # the interpreter holding the INSTALLED patched sglang is handed over in
        # SGLPATCH_PATCHED_PYTHON for the patch tests' `patched_python` fixture to use.
        self.runner = expand(cfg.get("pytest_python") or sys.executable)
        has_pytest = interpreter.module_state(self.runner, module="pytest", timeout=60)
        if has_pytest is None or not has_pytest.ok:
            return self.cannot_run("no pytest", f"the test runner {self.runner} has no pytest: "
                                   f"{self.runner} -m pip install 'pytest>=8'", outcome="no_runner")
        return True

    def run(self) -> None:
        plan, tr, cfg = self.plan, self.result, self.plan.profile["cpu"]
        report_dir = plan.report_dir
        junit, record = report_dir / "cpu-junit.xml", report_dir / "cpu-record.json"
        under = tr.data.get("under_test") or {}
        base_env = dict(plan.base_env, SGLPATCH_PATCHED_PYTHON=self.python, **{
            pytest_record.RECORD_ENV: str(record), pytest_record.MODULE_ENV: cfg.get("import_check") or "",
            pytest_record.DIRS_ENV: str(Path(under["file"]).parent) if under.get("file") else ""})
        # --continue-on-collection-errors: the tests that import still run; a module that does not is
        # judged by where its import failed (pytest_record), not by pytest's exit 2 for the whole run
        self.cmd = [self.runner, "-m", "pytest", str(self.tests), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    "-p", "sglpatch.gpu.cpu.pytest_record", "--continue-on-collection-errors",
                    f"--junitxml={junit}", *map(str, cfg.get("pytest_args", []))]
        record.unlink(missing_ok=True)
        res = run_step(self.cmd, base_env, report_dir / "cpu-pytest.log", cfg["timeout_s"], cwd=str(plan.project))
        tr.data["pytest"] = res
        rec = _read_record(record)
        counts = tr.data["counts"] = outcome.counts(rec)
        tr.summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                      f"{counts['skipped']} skipped")
        judged = outcome.judge(res["rc"], res["timed_out"], rec, _tail_text(res["log"]), cfg["timeout_s"])
        tr.data["collect_errors"] = (rec or {}).get("collect_errors", [])
        log = f"log {res['log']}"
        if judged.outcome == "passed":
            tr.set_outcome("passed")
        elif judged.status == "fail":
            tr.fail(f"{judged.line}; {log}", outcome=judged.outcome)
        else:
            self.cannot_run(f"pytest could not run the patch tests: {judged.line}",
                            f"{judged.line} (pytest exit {res['rc']}; {log}); no verdict", outcome=judged.outcome)

    def report(self) -> TierResult:
        tr = self.result
        if "pytest" not in tr.data:
            return tr
        tr.md = [*tr.md, f"- patched sglang from: `{self.python}` ({self.where}; SGLPATCH_PATCHED_PYTHON); "
                 f"pytest run by `{self.runner}`",
                 f"- under test: {tr.data.get('under_test')}",
                 f"- `{shlex.join(self.cmd)}`", f"- result: {tr.summary} (log `cpu-pytest.log`, junit `cpu-junit.xml`)"]
        if tr.status != "pass":
            tr.md += ["", "```", tail(self.plan.report_dir / "cpu-pytest.log", 30), "```"]
        return tr
