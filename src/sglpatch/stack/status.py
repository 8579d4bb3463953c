"""status and check: what a workdir carries and holds, and whether the series, patches/ and the lock
agree and apply exactly; the lock's blob ids."""

from __future__ import annotations

from pathlib import Path

from sglpatch.errors import SglpatchError
from sglpatch.fsutil import private_tmpdir
from sglpatch.gitcmd import Git
from sglpatch.project import Project
from sglpatch.series import (
    PATCH_DIR,
    REQUIRED_DEP3,
    SERIES_NAME,
    PatchFile,
    read_series,
)
from sglpatch.stack.build import build_chain
from sglpatch.upstream import materialize as up
from sglpatch.workdir import (
    PATCHED_BRANCH,
    UPSTREAM_BRANCH,
    Workdir,
    edits,
    guard_no_rebase,
    open_workdir,
    recorded,
)


def status(project_root: Path, workdir: Path) -> list[str]:
    project = Project.load(project_root)
    lines = [f"pin:      {project.lock.describe()}", f"series:   {len(project.patches)} patches"]
    git = open_workdir(workdir, create=False)
    guard_no_rebase(git)
    base = git.rev(UPSTREAM_BRANCH)
    head = git.rev(PATCHED_BRANCH)
    lines.append(f"workdir:  {git.workdir} (on {git.current_branch() or 'detached HEAD'})")
    if not base or not head:
        lines.append("state:    not applied; run `sglpatch apply`")
        return lines
    pin_ok = up.upstream_pin(git) == project.lock.pin_digest()
    lines.append(f"upstream: {base[:12]} {'(matches the lock)' if pin_ok else '(does NOT match the lock: run sglpatch apply)'}")
    commits = git.commits(base, head)
    rec_digest, rec_head = recorded(git)
    for k, c in enumerate(commits, 1):
        lines.append(f"  {k}. {c[:12]} {git.subject(c)}")
    if rec_head != head:
        lines.append(f"state:    {PATCHED_BRANCH} has unexported commits: run `sglpatch export`")
    elif rec_digest != project.digest(base):
        lines.append("state:    the series changed since the last apply: run `sglpatch apply`")
    else:
        lines.append("state:    in sync with the series")
    dirty, built = edits(git)
    lines.append(f"dirty:    {len(dirty)} uncommitted file(s)" + (": " + ", ".join(dirty[:5]) if dirty else "")
                 + (f" ({', '.join(built)}: build output, put back by the next apply)" if built else ""))
    return lines


def check(project_root: Path, workdir: Path | None = None, source: str = "sdist") -> list[str]:
    """Problems found (empty = all good): series vs patches/ vs lock, headers, exact application."""
    project_root = Path(project_root)
    problems: list[str] = []
    project = Project.load(project_root)  # raises on a malformed lock/series/patch
    listed = set(project.series.names)
    for p in sorted((project_root / PATCH_DIR).glob("*.patch")) if (project_root / PATCH_DIR).is_dir() else []:
        if p.name not in listed:
            problems.append(f"{PATCH_DIR}/{p.name} is not listed in {SERIES_NAME}")
    for patch in project.patches:
        missing = [f for f in REQUIRED_DEP3 if not patch.dep3.get(f)]
        if missing:
            problems.append(f"{patch.name}: DEP-3 field(s) missing: {', '.join(missing)}")
        if not patch.subject:
            problems.append(f"{patch.name}: no Subject")

    def run_on(git: Git) -> None:
        base = up.materialize(git, project.lock, source)
        touched_upstream = set(touched_blobs(git, base, project.patches))
        locked = set(project.lock.blobs)
        for f in sorted(touched_upstream - locked):
            problems.append(f"upstream.lock: blobs lacks {f} (touched by the series); run `sglpatch lock --update-blobs`")
        for f in sorted(locked - touched_upstream):
            problems.append(f"upstream.lock: blobs lists {f}, which the series does not touch; run `sglpatch lock --update-blobs`")
        try:
            build_chain(git, project, base, progress=False)
        except SglpatchError as e:
            problems.append(str(e))

    if workdir is not None:
        with Workdir(workdir).transaction() as git:  # it may move the upstream branch
            guard_no_rebase(git)
            run_on(git)
    else:
        with private_tmpdir("check") as tmp:
            run_on(open_workdir(Path(tmp) / "w", create=True))
    return problems


def touched_blobs(git: Git, base: str, patches: list[PatchFile]) -> dict[str, str]:
    """path -> blob id in base, for every file the patches touch that exists there (the lock's [blobs])."""
    blobs = {}
    for patch in patches:
        for f in patch.files:
            b = git.blob_id(base, f)
            if b:
                blobs[f] = b
    return blobs


def update_blobs(project_root: Path, workdir: Path) -> dict[str, str]:
    """Recompute lock.blobs from the upstream branch for the files the series touches."""
    from sglpatch.upstream.pin import write_lock

    project = Project.load(project_root)
    with Workdir(workdir).transaction() as git:
        guard_no_rebase(git)
        base = git.rev(UPSTREAM_BRANCH)
        if not base:
            raise SglpatchError(f"{workdir} has no {UPSTREAM_BRANCH} branch; run `sglpatch apply` first")
        blobs = touched_blobs(git, base, project.patches)
        project.lock.blobs = blobs
        write_lock(project_root, project.lock)
    return blobs


def carried(project_root: Path, workdir: Path) -> list[str]:
    """'name: subject' of every patch on upstream..patched, in order (for the end of apply)."""
    git = open_workdir(workdir, create=False)
    base, head = git.rev(UPSTREAM_BRANCH), git.rev(PATCHED_BRANCH)
    if not base or not head:
        return []
    names = read_series(project_root).names
    commits = git.commits(base, head)
    return [f"{names[k] if k < len(names) else c[:12]}: {git.subject(c)}" for k, c in enumerate(commits)]
