"""What a bisect is made of: git bisect run's exit protocol, the branch and environment names,
and the records (a commit of the range, one CMD run, the result)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch import exitcodes
from sglpatch.errors import SglpatchError

ENV_COMMIT = "SGLPATCH_BISECT_COMMIT"
ENV_PATCH = "SGLPATCH_BISECT_PATCH"
KILL_GRACE_S = 5.0  # SIGTERM to the CMD's process group, then SIGKILL after this
SNAPSHOT_EVERY_S = 0.5  # how often the CMD's descendants are recorded while it runs
# git bisect run's CMD protocol: good, bad, skip ("cannot run here"), abort (git's own 255)
EXIT_GOOD, EXIT_BAD, EXIT_SKIP, EXIT_ABORT = exitcodes.OK, exitcodes.ERROR, exitcodes.CANNOT_RUN, 255
VERDICT_EXIT = {"good": EXIT_GOOD, "bad": EXIT_BAD, "skip": EXIT_SKIP, "stop": EXIT_ABORT}  # stop: no verdict (command.NO_VERDICT)


class BisectError(SglpatchError):
    pass


@dataclass
class PatchRef:
    """A commit of the range, named as a series entry when it is one."""

    commit: str
    index: int  # 1-based position in upstream..patched; 0 when it is not a series commit
    total: int  # number of series commits (upstream..patched)
    name: str  # series name, or "upstream" / the short commit id
    subject: str
    description: str = ""

    @property
    def label(self) -> str:
        if self.index:
            return f"[{self.index}/{self.total}] {self.name}"
        return f"{self.name} ({self.commit[:12]})"


@dataclass
class Step:
    run: int  # 1-based count of CMD runs
    phase: str  # "triage" or "bisect"
    commit: str
    label: str
    rc: int | None  # CMD's exit status; None when it timed out; -N when killed by signal N
    verdict: str  # good / bad / skip / stop
    seconds: float
    log: str
    note: str = ""

    def code(self) -> str:
        return "timeout" if self.rc is None else (f"signal {-self.rc}" if self.rc < 0 else f"exit {self.rc}")

    def outcome(self) -> str:
        rc = self.code()
        note = f" ({self.note})" if self.note else ""
        return f"{rc} -> {self.verdict}, {self.seconds:.1f}s{note}"

    def line(self) -> str:
        return f"{self.run:>3}  {self.phase:<6}  {self.label}  {self.outcome()}"


@dataclass
class BisectResult:
    outcome: str  # found | upstream | no-regression | ambiguous | inconclusive | cannot-run
    message: str
    n: int  # commits in good..bad
    bound: int  # ceil(log2(n+1)) + 2
    runs: int  # CMD runs made, triage included
    steps: list[Step] = field(default_factory=list)
    first_bad: PatchRef | None = None
    candidates: list[PatchRef] = field(default_factory=list)
    log_dir: Path | None = None

    @property
    def exit_code(self) -> int:
        """0 when a conclusion was reached, 125 when CMD could not run at all, 1 when skips/timeouts left it open."""
        if self.outcome == "cannot-run":
            return exitcodes.CANNOT_RUN
        return exitcodes.OK if self.outcome in ("found", "upstream", "no-regression") else exitcodes.ERROR


def run_bound(n: int) -> int:
    """Most CMD runs for n patches, the two triage runs included."""
    return math.ceil(math.log2(n + 1)) + 2


def log2_steps(candidates: int) -> int:
    return math.ceil(math.log2(candidates)) if candidates > 1 else 0
