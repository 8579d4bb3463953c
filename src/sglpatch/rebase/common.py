"""Constants, RebaseStopped and the per-patch outcome of a rebase (and its table); RebaseError is
sglpatch.rebaseplan's, beside the saved plan it refuses (the workdir's guard reads it too)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglpatch import exitcodes
from sglpatch.errors import SglpatchError



RESOLUTIONS_DIR = "resolutions"
REPORTS_DIR = "rebase-reports"
CHANGELOG = "CHANGELOG.md"

# dry-run exit codes (sglpatch.exitcodes; errors stay 1)
EXIT_NOTHING = exitcodes.OK  # every patch applies exactly
EXIT_UNATTENDED = exitcodes.OK  # work, but `rebase` does it alone (3-way, drops, recorded resolutions): the watch's verdict too
EXIT_HUMAN = exitcodes.HUMAN  # a conflict or an obsolete patch without a recorded resolution


class RebaseStopped(SglpatchError):
    """The rebase stopped for a human; the message says what to do next (exit 3)."""

    exit_code = exitcodes.HUMAN


# --------------------------------------------------------------------------------------
# outcomes


@dataclass
class Outcome:
    name: str
    subject: str
    status: str  # upstream | exact | 3way | conflict | obsolete
    action: str = ""  # keep | refresh | drop | recorded | hand | skip | stop
    how: str = ""  # how it was verified / resolved
    files: list[str] = field(default_factory=list)  # conflicting files
    hunks: list[str] = field(default_factory=list)  # conflicting hunks / regions
    hint: str = ""  # Applied-Upstream
    note: str = ""
    new_commit: str = ""
    conflict: str = ""  # conflict_key() of a conflict / obsolete result ("" otherwise)

    @property
    def needs_human(self) -> bool:
        return self.action in ("stop",)


def _table(outcomes: list[Outcome]) -> list[str]:
    lines = [f"{'#':>2}  {'patch':<46} {'on new upstream':<16} plan"]
    for k, o in enumerate(outcomes, 1):
        plan = {
            "keep": "keep as is",
            "refresh": "keep, refreshed by the 3-way merge",
            "drop": "drop (already upstream)",
            "recorded": "use the recorded resolution",
            "recorded-drop": "drop (recorded decision)",
            "hand": "resolved by hand",
            "skip": "dropped by hand (--skip)",
            "stop": "needs you: resolve, then --continue",
        }.get(o.action, o.action)
        lines.append(f"{k:>2}  {o.name[:46]:<46} {o.status:<16} {plan}")
        if o.how:
            lines.append(f"      {o.how}")
        for f in o.files:
            lines.append(f"      conflict: {f}")
        for h in o.hunks:
            lines.append(f"        {h}")
        if o.note:
            lines.append(f"      note: {o.note}")
    return lines
