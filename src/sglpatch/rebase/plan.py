"""The plan of a rebase (saved as its state between --continue calls) and preparing it: the old
stack (DIR's, when it holds the series on its pin, else built), the target pin (rebase.target)
and the new upstream tree."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from sglpatch.stack import build
from sglpatch.upstream import treecache
from sglpatch.upstream import materialize as up
from sglpatch.errors import say
from sglpatch.gitcmd import Git
from sglpatch.upstream.pin import Lock
from sglpatch.rebase import target
from sglpatch.project import Project
from sglpatch.rebase_plan_file import Plan, RebaseError
from sglpatch.workdir import PATCHED_BRANCH, UPSTREAM_BRANCH, recorded
from sglpatch.rebase.resolutions import read_resolutions


def new_plan(project_root: Path, project: Project, source: str, new_lock: Lock, old_base: str, old_commits: list[str],
             onto: str) -> Plan:
    """The plan of moving the project's series from old_base (its commits old_commits) onto onto."""
    return Plan(
        project=str(project_root),
        source=source,
        old_lock=project.lock.dumps(),
        new_lock=new_lock.dumps(),
        old_base=old_base,
        old_commits=list(old_commits),
        names=[e.name for e in project.series.entries],
        strips=[e.strip for e in project.series.entries],
        sha256s=[hashlib.sha256(p.data).hexdigest() for p in project.patches],
        onto=onto,
        head=onto,
    )


def in_sync_stack(git: Git, project: Project) -> tuple[str, list[str]] | None:
    """(upstream, commits) of DIR when it holds exactly the project's series on its pin."""
    base = git.rev(UPSTREAM_BRANCH)
    head = git.rev(PATCHED_BRANCH)
    if not base or not head or up.upstream_pin(git) != project.lock.pin_digest():
        return None
    rec_digest, rec_head = recorded(git)
    if rec_head != head or rec_digest != project.digest(base):
        return None
    commits = git.commits(base, head)
    return (base, commits) if len(commits) == len(project.patches) else None


def _build_new_upstream(git: Git, lock: Lock, source: str, url: str | None) -> str:
    if source in ("sdist", "wheel"):
        return up.build_registry(git, lock)
    if source == "git":
        return up.build_from_git(git, lock, url)
    raise RebaseError(f"unknown source {source!r}; use auto, git, sdist or wheel")


def prepare(git: Git, project_root: Path, onto: str, source: str, commit: str | None, url: str | None, in_sync,
            cached: bool = False) -> Plan:
    """cached (dry runs): registry trees come from the tree cache (sglpatch.upstream.treecache), which git
    (a scratch repository) then borrows; a real rebase commits them into the workdir."""
    project = Project.load(project_root)
    if source == "auto":  # decided once, before the command runs (sglpatch.context.Context.source)
        raise RebaseError("--source auto reached the rebase undecided: the command's context decides it (sglpatch.context)")
    registry = treecache.registry_commit if cached else up.build_registry
    if in_sync is None:
        say(f"building the current stack on {project.lock.describe()} to compare against")
        old_base = up.build_from_git(git, project.lock, url) if source == "git" else registry(git, project.lock)
        up.verify_blobs(git, old_base, project.lock, source)
        old_commits = build.build_chain(git, project, old_base, progress=False)
    else:
        old_base, old_commits = in_sync
    version_guess = target.VERSION_RE.match(onto)
    recorded_target = {}
    if version_guess:
        _, recorded_target = read_resolutions(project_root, version_guess.group(1))
    new_lock = target.target_lock(project.lock, onto, source, recorded=recorded_target, commit=commit, url=url)
    if new_lock.pin_digest() == project.lock.pin_digest():
        raise RebaseError(f"the series is already pinned to {new_lock.describe()}; nothing to rebase")
    t0 = time.monotonic()
    onto_commit = registry(git, new_lock) if cached and source in ("sdist", "wheel") else _build_new_upstream(git, new_lock, source, url)
    got = new_lock.artifact_kind if source in ("sdist", "wheel") else source  # 0.5.11+ have no sdist: the wheel
    why = f" (the registry has no {source} of {new_lock.version})" if got != source else ""
    say(f"new upstream {new_lock.describe()} ready from {got}{why} in {time.monotonic() - t0:.1f}s")
    return new_plan(project_root, project, source, new_lock, old_base, old_commits, onto_commit)
