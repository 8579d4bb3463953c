"""One regress run, resolved once, and the face every tier shows `regress`.

`regress` reads the flags, resolves the profile (targets/NAME.toml over the defaults, checked)
and the Python(s) under test once, and hands the result down as one :class:`RunPlan`. Each tier
(cpu, kernel, server) is a :class:`Tier`: made from the plan, then `check` (may it run here,
with these options?), `run` (measure) and `report` (status, summary and markdown). `regress`
calls only that face; what a tier needs beyond the plan it keeps on itself between the steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch.gpu.shared.report import TierResult


@dataclass(frozen=True)
class RunPlan:
    """What every tier reads, resolved once by `regress` (never re-read from targets/ by a tier)."""

    profile: dict  # the checked profile (profile.load_profile): target, env, cpu, kernel, server, model
    profile_path: Path | None
    project: Path  # the sglpatch checkout holding targets/ and tests/
    report_dir: Path
    base_env: dict = field(default_factory=dict)  # os.environ + the profile's [env]: every step starts here
    python: str | None = None  # the Python under test ("A,B": several installs, kernel tier only)
    workdir: Path | None = None  # whose recorded install the cpu tier uses
    baseline: Path | None = None  # kernel tier: a previous report.json
    stress: int | None = None  # kernel tier: iterations (-1: the profile's stress_iterations)
    quick: bool = False
    with_profile: str | None = None  # kernel tier: a server-tier report's measured step
    modes: str | None = None  # server tier
    parity_with: str | None = None
    ab: str | None = None
    doctor: bool = False  # server tier: the doctor before the load

    def section(self, name: str) -> dict:
        return self.profile.get(name) or {}

    def replace(self, **changes) -> RunPlan:
        return dataclasses.replace(self, **changes)


class Tier:
    """The face of a tier: `check()`, then `run()` if it said yes, then `report()` always."""

    name = ""

    def __init__(self, plan: RunPlan):
        self.plan = plan
        self.result = TierResult(self.name)

    def check(self) -> bool:
        """Whether the tier can run here; False leaves `result` saying why (cannot run, refused)."""
        return True

    def run(self) -> None:
        """Measure, into `result` (its data and failures)."""

    def report(self) -> TierResult:
        """`result` with its status, summary and markdown."""
        return self.result

    def cannot_run(self, summary: str, why: str | None = None, outcome: str = "cannot_start") -> bool:
        self.result.set_outcome(outcome)
        self.result.summary = summary
        if why:
            self.result.md = [f"- cannot run here: {why}"]
            self.result.data["cannot_run"] = why
        return False
