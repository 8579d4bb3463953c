"""The one table from a tier's underlying outcome to its status and to `regress`'s exit code.

A verdict comes only from what ran: exit 1 ("a regression") only from tests that ran and failed,
or a step that ran and failed or measured below its bar. Whatever kept the tests from running
(pytest's own errors, a conftest or plugin that does not load, a runner that lacks a module, an
interrupt, a tier that cannot start) is "cannot run here", exit 125, which `git bisect run` skips
and `sglpatch bisect --triage` never concludes from. Standard library only (the GPU box runs it).

`python -m sglpatch.gpu.shared.verdict` prints the table (docs/regress.md shows it).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglpatch import exitcodes

PASS, FAIL, CANNOT_RUN = "pass", "fail", "cannot_run"
EXIT = {PASS: exitcodes.OK, FAIL: exitcodes.ERROR, CANNOT_RUN: exitcodes.CANNOT_RUN}


@dataclass(frozen=True)
class Row:
    outcome: str
    status: str
    tiers: str
    meaning: str

    @property
    def exit_code(self) -> int:
        return EXIT[self.status]


TABLE: tuple[Row, ...] = (
    Row("passed", PASS, "all", "every test or step that ran passed, and something ran"),
    Row("failed", FAIL, "all", "tests ran and failed (pytest 1), or a step ran and failed: a wrong result (also over "
        "back-to-back CUDA-graph replays), a crash, a hang, below its bar or the baseline, a parity pair whose two "
        "modes did not say the same thing (greedy text, or EAGLE-3 accept length beyond its tolerance), a process left "
        "behind"),
    Row("under_test_broken", FAIL, "cpu", "the code under test does not import: the tier's import check, or a test "
        "module whose import fails inside the code under test"),
    Row("timed_out", FAIL, "cpu", "the tests ran past the tier's timeout and were killed: a hang"),
    Row("runner_internal_error", CANNOT_RUN, "cpu", "pytest's internal error (3): a plugin or hook the runner cannot load"),
    Row("runner_usage_error", CANNOT_RUN, "cpu", "pytest's usage error (4): a conftest or plugin that does not load, "
        "an option the runner does not know"),
    Row("nothing_collected", CANNOT_RUN, "cpu", "no test ran: pytest collected none (5), or every one skipped"),
    Row("interrupted", CANNOT_RUN, "cpu", "the runner was interrupted (pytest 2 without collection errors) or killed by a signal"),
    Row("runner_lacks", CANNOT_RUN, "cpu", "a test module or fixture needs what the runner or the Python under test "
        "lacks (a module outside the code under test)"),
    Row("no_runner", CANNOT_RUN, "cpu", "the test runner has no pytest, or its outcome record is missing"),
    Row("cannot_start", CANNOT_RUN, "all", "the tier cannot start here: no GPU or driver, no torch, no Python with the "
        "code under test or its dependencies, no such section in the profile"),
)
ROWS = {r.outcome: r for r in TABLE}


def status_of(outcome: str) -> str:
    return ROWS[outcome].status


def run_status(statuses: list[str], every_tier_asked: bool) -> str:
    """A run's status from its tiers' (in order): any fail fails it; else it passes when a tier passed
    and (for --tier all) any did, (for one tier) that one did; else it could not run."""
    if FAIL in statuses:
        return FAIL
    if PASS in (statuses if every_tier_asked else statuses[:1]):
        return PASS
    return CANNOT_RUN


def lines() -> list[str]:
    return ["| outcome | tiers | status | exit | meaning |", "|---|---|---|---|---|"] + [
        f"| {r.outcome} | {r.tiers} | {r.status} | {r.exit_code} | {r.meaning} |" for r in TABLE]


if __name__ == "__main__":
    print("\n".join(lines()))
