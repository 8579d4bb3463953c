"""A pytest plugin the cpu tier loads (`-p sglpatch.gpu.cpu.pytest_record`): what ran, and why what
did not run did not, written as JSON to $SGLPATCH_CPU_RECORD when the session ends.

* Each test's outcome (passed, failed, error, skipped). An error raised as :class:`CannotRunHere` (a
  fixture that finds the Python under test lacking what the tests need, not the code under test)
  counts as `cannot_run`, not as an error.
* Each collection error, classified: `under_test` when the exception arose in the code under test
  (a traceback frame, a SyntaxError's or an ImportError's file under one of the folders in
  $SGLPATCH_UNDER_TEST_DIRS, os.pathsep-separated; or a missing submodule of the package under test,
  $SGLPATCH_UNDER_TEST_MODULE), else `runner` (the runner lacks a module, or the test file is broken).

Standard library and pytest only: loaded by whatever interpreter runs the tier's pytest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

RECORD_ENV, DIRS_ENV, MODULE_ENV = "SGLPATCH_CPU_RECORD", "SGLPATCH_UNDER_TEST_DIRS", "SGLPATCH_UNDER_TEST_MODULE"


class CannotRunHere(Exception):
    """Raised by a fixture when this machine or the Python under test lacks what a test needs."""


_RECORD: dict = {"tests": {}, "collect_errors": [], "cannot_run": []}


def _inside(path: str | None, dirs: list[Path]) -> bool:
    if not path:
        return False
    p = Path(path).resolve()
    return any(p.is_relative_to(d) for d in dirs)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify(exc: BaseException, dirs: list[Path], module: str) -> str:
    """`under_test` or `runner`: where a collection error came from (see the module's text)."""
    for e in _chain(exc):
        tb = e.__traceback__
        while tb is not None:
            if _inside(tb.tb_frame.f_code.co_filename, dirs):
                return "under_test"
            tb = tb.tb_next
        if isinstance(e, SyntaxError) and _inside(e.filename, dirs):
            return "under_test"
        if isinstance(e, ImportError):
            if _inside(getattr(e, "path", None), dirs):
                return "under_test"
            name = getattr(e, "name", None) or ""
            if module and name.startswith(module + "."):  # the package is there, a module of it is not
                return "under_test"
    return "runner"


def one_line(exc: BaseException) -> str:
    for e in _chain(exc):  # the innermost cause: pytest wraps an import error in its CollectError
        last = e
    text = str(last).strip().splitlines()
    return f"{type(last).__name__}: {text[-1] if text else ''}".strip()


def _dirs() -> list[Path]:
    return [Path(d).resolve() for d in os.environ.get(DIRS_ENV, "").split(os.pathsep) if d]


def pytest_exception_interact(node, call, report):
    if report.when == "collect":
        exc = call.excinfo.value
        _RECORD["collect_errors"].append({"nodeid": report.nodeid, "cause": one_line(exc),
                                          "kind": classify(exc, _dirs(), os.environ.get(MODULE_ENV, ""))})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is not None and isinstance(call.excinfo.value, CannotRunHere):
        _RECORD["cannot_run"].append({"nodeid": item.nodeid, "cause": str(call.excinfo.value)})
        rep.sglpatch_cannot_run = True


def pytest_runtest_logreport(report):
    tests = _RECORD["tests"]
    if getattr(report, "sglpatch_cannot_run", False):
        tests[report.nodeid] = "cannot_run"
    elif report.when == "call" or report.outcome != "passed":
        prev = tests.get(report.nodeid)
        if prev in (None, "passed"):  # a teardown error after a pass is an error
            tests[report.nodeid] = "error" if report.failed and report.when != "call" else report.outcome


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(RECORD_ENV)
    if path:
        doc = dict(_RECORD, exitstatus=int(exitstatus))
        tmp = Path(path).with_name(Path(path).name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
