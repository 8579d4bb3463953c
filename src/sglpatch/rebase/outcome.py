"""What a rebase says of each patch: its status on the new upstream and the action taken (the
words the watch's cells use too), the per-patch Outcome and its table; RebaseStopped, exit
codes and the project's names (RebaseError is sglpatch.rebase_plan_file's, the workdir's names are
sglpatch.workdir's)."""

from __future__ import annotations

import enum
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
# the words


class _Word(str, enum.Enum):
    """A word of the tables, reports and JSON: it compares, hashes, prints and serializes as its
    value, so a plain string read back from state.json or the watch's cache is the same word."""

    __str__ = str.__str__
    __format__ = str.__format__


class Status(_Word):
    """Where a patch stands on a release: the rebase's classification, and the watch's cell."""

    UPSTREAM = "upstream"  # the change is already in the new tree (verified)
    EXACT = "exact"  # applies with no offset and no fuzz
    THREE_WAY = "3way"  # applies with a 3-way merge against the old stack
    BROKEN = "3way-broken"  # the 3-way merge is clean but the merge check finds it broken
    CONFLICT = "conflict"  # the 3-way merge leaves conflicts
    OBSOLETE = "obsolete"  # every file it modifies is gone from the new tree
    RECORDED = "recorded"  # the watch's cell: a recorded resolution applies
    SUPERSEDED = "superseded"  # the watch's cell: upstream solved it differently (X-Superseded-By)


class Action(_Word):
    """What the rebase does with the patch (the plan column of the table)."""

    KEEP = "keep"
    REFRESH = "refresh"
    DROP = "drop"
    RECORDED = "recorded"
    RECORDED_DROP = "recorded-drop"
    HAND = "hand"
    SKIP = "skip"
    STOP = "stop"


DROPPED = (Action.DROP, Action.RECORDED_DROP, Action.SKIP)  # the actions that leave the patch out
PLAN = {
    Action.KEEP: "keep as is",
    Action.REFRESH: "keep, refreshed by the 3-way merge",
    Action.DROP: "drop (already upstream)",
    Action.RECORDED: "use the recorded resolution",
    Action.RECORDED_DROP: "drop (recorded decision)",
    Action.HAND: "resolved by hand",
    Action.SKIP: "dropped by hand (--skip)",
    Action.STOP: "needs you: resolve, then --continue",
}


# --------------------------------------------------------------------------------------
# outcomes


@dataclass
class Outcome:
    name: str
    subject: str
    status: Status | str  # a Status ("" while classifying; a plain str read back from JSON compares equal)
    action: Action | str = ""  # an Action
    how: str = ""  # how it was verified / resolved
    files: list[str] = field(default_factory=list)  # conflicting files
    hunks: list[str] = field(default_factory=list)  # conflicting hunks / regions
    hint: str = ""  # Applied-Upstream
    note: str = ""
    new_commit: str = ""
    conflict: str = ""  # conflict_key() of a conflict / obsolete result ("" otherwise)


def table(outcomes: list[Outcome]) -> list[str]:
    lines = [f"{'#':>2}  {'patch':<46} {'on new upstream':<16} plan"]
    for k, o in enumerate(outcomes, 1):
        lines.append(f"{k:>2}  {o.name[:46]:<46} {o.status:<16} {PLAN.get(o.action, o.action)}")
        if o.how:
            lines.append(f"      {o.how}")
        for f in o.files:
            lines.append(f"      conflict: {f}")
        for h in o.hunks:
            lines.append(f"        {h}")
        if o.note:
            lines.append(f"      note: {o.note}")
    return lines
