"""What a finished rebase writes beside the new stack: the per-patch ``git range-diff`` of the old
stack against the new one (the report under rebase-reports/), and the CHANGELOG.md section that
names the move and each patch's outcome."""

from __future__ import annotations

import re
import time
from pathlib import Path

from sglpatch.fsutil import write_if_changed
from sglpatch.gitcmd import Git
from sglpatch.rebase.outcome import CHANGELOG, DROPPED, RESOLUTIONS_DIR, Action, Outcome
from sglpatch.rebase_plan_file import Plan
from sglpatch.upstream.pin import Lock


def range_diff(git: Git, plan: Plan, new_base: str, new_head: str) -> str:
    old_head = plan.old_commits[-1] if plan.old_commits else plan.old_base
    rc, out, err = git.run(
        "range-diff", "--no-color", "--creation-factor=95", f"{plan.old_base}..{old_head}", f"{new_base}..{new_head}", check=False, strip=False
    )
    return out if rc == 0 else f"(git range-diff failed: {err.strip()})\n"


def split_range_diff(text: str) -> list[str]:
    parts, cur = [], []
    for line in text.splitlines():
        if re.match(r"^\s*(\d+|-):\s+[0-9a-f-]+ [<>=!] ", line) and cur:
            parts.append("\n".join(cur))
            cur = []
        cur.append(line)
    return parts + (["\n".join(cur)] if cur else [])


def changelog_section(old: Lock, new: Lock, source: str, outcomes: list[Outcome], report_rel: str) -> str:
    today = time.strftime("%Y-%m-%d", time.gmtime())
    lines = [
        f"## Rebase onto sglang {new.version} (from {old.version}) - {today}",
        "",
        f"- Target: {new.name} {new.version}, tag {new.tag}, commit {new.commit}, {new.artifact_kind} {new.sdist_filename} sha256 "
        f"{new.sdist_sha256} (source: {source})."
        + (" The release records no commit and GitHub did not answer: the pin says commit = unknown." if new.commit == "unknown" else ""),
    ]
    for o in outcomes:
        if o.action in DROPPED:
            pr = f" Upstream: {o.hint}." if o.hint else ""
            lines.append(f"- `{o.name}` ({o.subject}): {o.status}; dropped from the series. {o.how}.{pr}")
        elif o.action == Action.RECORDED:
            lines.append(f"- `{o.name}` ({o.subject}): {o.status}; resolved with the {o.how}.")
        elif o.action == Action.HAND:
            lines.append(f"- `{o.name}` ({o.subject}): {o.status} in {', '.join(o.files)}; resolved by hand and recorded in {RESOLUTIONS_DIR}/{new.version}/.")
        elif o.action == Action.REFRESH:
            lines.append(f"- `{o.name}` ({o.subject}): applied with a 3-way merge; refreshed.")
        else:
            lines.append(f"- `{o.name}` ({o.subject}): applies exactly; unchanged.")
        if o.note:
            lines.append(f"  Note: {o.note}.")
    lines.append(f"- Per-patch `git range-diff` old vs new stack: `{report_rel}`.")
    return "\n".join(lines) + "\n"


def insert_changelog(project_root: Path, section: str, before: str = "") -> None:
    path = project_root / CHANGELOG
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Changelog\n"
    lines = text.split("\n")
    title = section.split("\n", 1)[0].rsplit(" - ", 1)[0]  # the heading without its date
    if sum(x.startswith(title) for x in lines) > sum(x.startswith(title) for x in before.split("\n")):
        return  # a killed earlier run of this rebase inserted it already
    at = next((k for k, line in enumerate(lines) if line.startswith("## ")), None)
    if at is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        new = "\n".join(lines[:at]) + ("\n" if at else "") + section + "\n" + "\n".join(lines[at:])
    write_if_changed(path, new.encode(), within=project_root)
