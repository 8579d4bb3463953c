"""The cpu tier's underlying outcome: from pytest's exit status, its timeout and pytest_record's
record to a row of sglpatch.gpu.shared.verdict.TABLE, with one line naming the cause.

Only tests that ran decide: a failed or erroring test, or a test module whose import failed
inside the code under test, is a failure; pytest's own errors (2 without collection errors, 3, 4,
5), a signal, a module or fixture that needs what the runner or the Python under test lacks, and a
missing record are "cannot run here".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sglpatch.gpu.shared import verdict


@dataclass(frozen=True)
class Judged:
    outcome: str
    line: str

    @property
    def status(self) -> str:
        return verdict.status_of(self.outcome)


def counts(record: dict | None) -> dict:
    tests = list((record or {}).get("tests", {}).values())
    n = {k: tests.count(k) for k in ("passed", "failed", "error", "skipped", "cannot_run")}
    return {"tests": len(tests), "passed": n["passed"], "failed": n["failed"], "errors": n["error"],
            "skipped": n["skipped"], "cannot_run": n["cannot_run"]}


def _log_cause(rc: int, log: str) -> str:
    """The one line of pytest's output that names why it stopped (exit 3 and 4)."""
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    if rc == 3:
        errs = [ln.removeprefix("INTERNALERROR>").strip() for ln in lines if ln.startswith("INTERNALERROR>")]
        named = [e for e in errs if re.match(r"^[\w.]+(Error|Exception)\b", e)]
        if named or errs:
            return (named or errs)[-1]
    conftest = next((ln for ln in lines if "while loading conftest" in ln), None)
    if conftest:
        e = [ln for ln in lines if ln.startswith("E ")]
        return f"{conftest.strip()} {e[-1][1:].strip() if e else ''}".strip()
    errors = [ln for ln in lines if ln.startswith("ERROR:") or ln.startswith("ImportError") or "Error:" in ln]
    return (errors or lines or ["(no output)"])[-1].strip()


def judge(rc: int | None, timed_out: bool, record: dict | None, log: str, timeout_s: float | None = None) -> Judged:
    if timed_out:
        return Judged("timed_out", f"pytest timed out after {timeout_s} s (killed)")
    if rc is None or rc < 0:
        return Judged("interrupted", f"pytest was killed by signal {-rc if rc else '?'}")
    if rc == 3:
        return Judged("runner_internal_error", f"pytest's internal error: {_log_cause(rc, log)}")
    if rc == 4:
        return Judged("runner_usage_error", f"pytest's usage error: {_log_cause(rc, log)}")
    if rc == 5:
        return Judged("nothing_collected", "pytest collected no test")
    if rc not in (0, 1, 2):
        return Judged("interrupted", f"pytest exited {rc}")
    if record is None:
        return Judged("no_runner", "the runner wrote no outcome record (sglpatch.gpu.cpu.pytest_record did not run)")
    c = counts(record)
    errs = record.get("collect_errors", [])
    under = [e for e in errs if e.get("kind") == "under_test"]
    runner = [e for e in errs if e.get("kind") != "under_test"]
    if c["failed"] or c["errors"]:
        failed = [k for k, v in record["tests"].items() if v in ("failed", "error")]
        return Judged("failed", f"{c['failed']} failed, {c['errors']} errors: {', '.join(failed[:5])}")
    if under:
        e = under[0]
        return Judged("under_test_broken", f"{e['nodeid']} does not import: {e['cause']} (in the code under test)")
    if runner:
        e = runner[0]
        return Judged("runner_lacks", f"{e['nodeid']} does not import here: {e['cause']} (not the code under test)")
    lacking = record.get("cannot_run", [])
    if lacking:
        return Judged("runner_lacks", f"{lacking[0]['nodeid']}: {lacking[0]['cause']}")
    if rc == 2:
        return Judged("interrupted", "pytest was interrupted")
    if rc == 1:
        return Judged("no_runner", "pytest exited 1 with nothing failed in its record")
    if not c["passed"]:
        return Judged("nothing_collected", f"no test ran: {c['skipped']} skipped, none passed")
    return Judged("passed", f"{c['passed']} passed, {c['skipped']} skipped")
