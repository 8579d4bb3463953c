"""export: the workdir's commits written back to a line's patch files and series, byte-stable, under the
workdir's lock, from a tree on that line's pin only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sglpatch import lineguard
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, remove, write_if_changed
from sglpatch.gitcmd import Git
from sglpatch.project import Project
from sglpatch.series import (
    PATCH_DIR,
    SERIES_NAME,
    Entry,
    Series,
    parse_patch,
    patch_path,
    read_patch,
    read_series,
    slug,
)
from sglpatch.stack.build import FORMAT_PATCH_FLAGS
from sglpatch.workdir import (
    BACKUP_PREFIX,
    BUILT,
    PATCHED_BRANCH,
    UPSTREAM_BRANCH,
    Workdir,
    edits,
    guard_no_rebase,
    record,
)


@dataclass
class ExportResult:
    written: list[str]
    unchanged: list[str]
    removed: list[str]
    series_changed: bool


def _taken(path: Path, data: bytes) -> bool:
    """A file that is not in the series holds this name, and not with these very bytes (those
    are ours, from an export that was stopped before it rewrote the series)."""
    return path.exists() and not (path.is_file() and path.read_bytes() == data)


def format_patch(git: Git, commit: str, built: bool = False) -> bytes:
    """commit as a patch file, without the build's output (BUILT) unless built."""
    if built:
        return git.run("format-patch", *FORMAT_PATCH_FLAGS, "-1", commit, binary=True)
    return git.run("format-patch", *FORMAT_PATCH_FLAGS, f"{commit}^!", "--", ".", *(f":(top,exclude){p}" for p in BUILT), binary=True)


def export(project_root: Path, workdir: Path) -> ExportResult:
    with Workdir(workdir).transaction() as git:
        guard_no_rebase(git)
        lineguard.guard_pin(git, Path(project_root))
        return export_locked(Path(project_root), git)


def export_locked(project_root: Path, git: Git) -> ExportResult:
    """export, for a caller that holds DIR's lock (the rebase's finishing step)."""
    series = read_series(project_root)
    for e in series.entries:  # none of them may lead outside the project (a linked folder)
        patch_path(project_root, e.name)
    base, head = git.rev(UPSTREAM_BRANCH), git.rev(PATCHED_BRANCH)
    if not base or not head:
        raise SglpatchError(f"{git.workdir} has no {UPSTREAM_BRANCH}/{PATCHED_BRANCH} branches; run `sglpatch apply` first")
    if dirty := edits(git)[0]:
        say(f"warning: {len(dirty)} uncommitted file(s) in {git.workdir} are not exported; commit them on {PATCHED_BRANCH} first")
    commits = git.commits(base, head)
    old_by_name = {e.name: e for e in series.entries}
    old_subjects: dict[str, str] = {}
    for e in series.entries:
        try:
            old_subjects[e.name] = read_patch(project_root, e).subject
        except SglpatchError:
            pass
    new_entries: list[Entry] = []
    datas: list[bytes] = []
    used: set[str] = set()
    built = set(git.run("log", "--format=%H", f"{base}..{head}", "--", *BUILT).split())  # commits with build output
    for c in commits:
        data = format_patch(git, c)
        if c in built:
            say(f"commit {c[:12]} ({git.subject(c)}): {', '.join(BUILT)} is build output, never exported: "
                + ("the commit changes nothing else, so it is not a patch" if not data.strip() else "left out of its patch"))
            if not data.strip():
                continue
        if not data.strip():  # git format-patch writes nothing for a commit without a change
            raise SglpatchError(
                f"commit {c[:12]} ({git.subject(c)}) on {PATCHED_BRANCH} changes nothing, so it cannot be a patch: drop it "
                f"(`git -C {git.workdir} rebase -i {base[:12]}`, delete its line) or give it a change, then re-run export; "
                "nothing was written"
            )
        subject, i, name = parse_patch(f"commit {c[:12]}", data).subject, len(new_entries), None  # i: numbered among the exported
        if i < len(series.entries) and old_subjects.get(series.entries[i].name) == subject:
            name = series.entries[i].name
        if name is None or name in used:
            name = next((n for n, s in old_subjects.items() if s == subject and n not in used), None)
        if name is None:
            name = f"{i + 1:04d}-{slug(subject)}.patch"
            k = 2
            while name in used or (name not in old_by_name and _taken(project_root / PATCH_DIR / name, data)):
                name = f"{i + 1:04d}-{slug(subject)}-{k}.patch"
                k += 1
        used.add(name)
        old = old_by_name.get(name)
        if old is not None:
            entry = Entry(name=name, strip=1, comments=old.comments, raw=old.raw if old.strip == 1 else None)
        else:
            entry = Entry(name=name, strip=1)
        new_entries.append(entry)
        datas.append(data)
    written, unchanged = [], []
    for k, (entry, data) in enumerate(zip(new_entries, datas), 1):
        if write_if_changed(patch_path(project_root, entry.name), data, within=project_root):
            written.append(entry.name)
        else:
            unchanged.append(entry.name)
        crashpoint(f"export:patch:{k}")
    new_series = Series(entries=new_entries, trailer=series.trailer)
    orphan_comments = [c for e in series.entries if e.name not in used for c in e.comments]
    if orphan_comments:
        new_series.trailer = orphan_comments + new_series.trailer
    # dropped patches go before the series is rewritten: a kill in between leaves the old
    # series naming a missing file, which the next export repairs (the other order would
    # leave an orphan that no series names)
    removed = []
    for e in series.entries:
        if e.name not in used:
            p = patch_path(project_root, e.name)
            if remove(p, within=project_root):
                removed.append(e.name)
    crashpoint("export:removed")
    series_changed = write_if_changed(project_root / SERIES_NAME, new_series.dumps().encode(), within=project_root)
    crashpoint("export:series")
    # the workdir now matches the series again
    project = Project.load(project_root)
    record(git, "build-output-left-out" if built else project.digest(base), head)  # so the next apply builds patched without it
    if built:
        say(f"run `sglpatch apply` to build {PATCHED_BRANCH} again without the build output (the old one is kept under {BACKUP_PREFIX}/)")
    return ExportResult(written, unchanged, removed, series_changed)


# --------------------------------------------------------------------------------------
# status and check
