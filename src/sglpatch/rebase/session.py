"""A real rebase: state in DIR/.git/sglpatch-rebase/, stop for a human, --continue / --skip / --abort,
and the finishing step that writes the project (patches, series, lock, CHANGELOG, report)."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from sglpatch.pythonenv import install
from sglpatch import linepath
from sglpatch.stack import export, status
from sglpatch.errors import say
from sglpatch.fsutil import crashpoint, journal, tmp_prefix, write_if_changed
from sglpatch.gitcmd import Git
from sglpatch.lines import dest as line_dest
from sglpatch.lines import seed as seed_line
from sglpatch.upstream.pin import Lock, write_lock
from sglpatch.project import Project
from sglpatch.rebase_plan_file import Plan, RebaseError
from sglpatch.series import PATCH_DIR
from sglpatch.workdir import (APPLIED_KEY, BACKUP_PREFIX, PATCHED_BRANCH, REBASE_REF_PREFIX, REBASE_STATE_FILE, UPSTREAM_BRANCH, Workdir, clear_scratch,
                              edits, open_workdir, pin_key, rebase_state_dir, record, scratch_dir)
from sglpatch.rebase.outcome import CHANGELOG, DROPPED, REPORTS_DIR, RESOLUTIONS_DIR, Action, Outcome, RebaseStopped, table
from sglpatch.rebase.merge import commit_like
from sglpatch.rebase.resolutions import Recorded, read_resolutions, write_resolutions
from sglpatch.rebase.classify import run_steps
from sglpatch.rebase.plan import in_sync_stack, prepare
from sglpatch.rebase import claim, finish_report, state


# --------------------------------------------------------------------------------------
# real rebase: state, stop, continue, abort, finish


def _in_progress(git: Git) -> str:
    """The one line for a new rebase while state.json exists: what happened, what to run."""
    wd = git.workdir
    if state.abort_started(git):
        return (f"an `--abort` of the rebase in {wd} was interrupted before it finished; "
                f"`sglpatch rebase --workdir {wd} --abort` finishes it, then start again")
    plan = state.load(git)
    if plan.stopped:
        i = plan.stopped["index"]
        return (
            f"a rebase is already in progress in {wd}, stopped at patch {i + 1}/{len(plan.names)} ({plan.names[i]}) for you; "
            f"resolve it, then `sglpatch rebase --workdir {wd} --continue` (or `--skip` / `--abort`)"
        )
    return (
        f"a rebase is already in progress in {wd}, but its process was interrupted (killed?) before it finished; "
        f"`sglpatch rebase --workdir {wd} --continue` completes it, or `--abort` puts {wd} and the project back as they were"
    )


def _report_name(old: Lock, new: Lock) -> str:
    return f"{old.version}..{new.version}"


def start(
    project_root: Path, workdir: Path, onto: str, source: str = "sdist", commit: str | None = None, url: str | None = None,
    promote: bool = False,
) -> list[str]:
    """Rebase the primary series onto onto in workdir; the result is written to lines/<release>/
    (sglpatch.lines), or over the primary's series, patches/ and upstream.lock with promote."""
    project_root = Path(project_root).resolve()
    project = Project.load(project_root)
    git = open_workdir(Path(workdir), create=False)
    saved = rebase_state_dir(git) / REBASE_STATE_FILE
    if saved.is_file():
        raise RebaseError(_in_progress(git))
    # the whole rebase, its finishing step included, holds DIR's lock: an --abort or an export
    # from another shell is refused instead of working on half-moved branches
    with Workdir(git.workdir).hold(git):
        if saved.is_file():
            raise RebaseError(_in_progress(git))
        if rebase_state_dir(git).exists():  # a rebase killed before it saved state.json: it had changed nothing yet
            say(f"removing {rebase_state_dir(git)} left by a killed rebase (no state saved in it: nothing to resume)")
            shutil.rmtree(rebase_state_dir(git))
        clear_scratch(git)  # left by a killed run
        state.check_project(project_root, [".", PATCH_DIR, REPORTS_DIR])  # before anything: a read-only project
        dirty = edits(git, put_back=True)[0]
        if dirty:
            raise RebaseError(f"{git.workdir} has uncommitted changes ({', '.join(dirty[:3])}); commit and `sglpatch export`, or stash them")
        own = linepath.workdir_of(git.workdir, onto.lstrip('v'))
        install.guard_serving(git.workdir, f"onto {onto}", f"`sglpatch apply --workdir {own} --no-install && "
                              f"sglpatch rebase --onto {onto} --workdir {own}`")
        in_sync = in_sync_stack(git, project)
        if in_sync is None:
            raise RebaseError(
                f"{git.workdir} does not hold the primary series on {project.lock.version} (unexported commits, another line, "
                f"or not applied); the rebase starts from it: `sglpatch export --workdir {git.workdir}` saves unexported work, "
                f"`sglpatch apply --workdir {git.workdir} --no-install` builds it (installs nothing), then rebase"
            )
        branch = git.current_branch()
        plan = prepare(git, project_root, onto, source, commit, url, in_sync)
        crashpoint("rebase:upstream")
        plan.orig = {
            "branch": branch,
            "head": git.head_commit(),
            "upstream": git.rev(UPSTREAM_BRANCH),
            "patched": git.rev(PATCHED_BRANCH),
            "applied": git.config_get(APPLIED_KEY),
        }
        new_lock = Lock.parse(plan.new_lock, "target")
        plan.dest = "" if promote else line_dest(new_lock.version)
        state.check_project(project_root, _project_dirs(plan, project.lock, new_lock))
        rebase_state_dir(git).mkdir(parents=True, exist_ok=True)
        state.snapshot(git, project_root, new_lock.version, _report_name(project.lock, new_lock), plan.dest)
        state.save_orig(git, plan.orig, project_root)
        git.update_ref(f"{REBASE_REF_PREFIX}/onto", plan.onto, message="sglpatch rebase: new upstream")
        crashpoint("rebase:snapshot")
        state.save(git, plan)  # from here on a rebase is in progress: --continue / --abort
        crashpoint("rebase:saved")
        _drive(git, plan)
        return _finish(git, plan)


def _project_dirs(plan: Plan, old_lock: Lock, new_lock: Lock) -> list[str]:
    """The project folders the finishing step writes in."""
    report = f"{REPORTS_DIR}/{_report_name(old_lock, new_lock)}"
    at = f"{plan.dest}/" if plan.dest else ""
    return [".", f"{at}.", f"{at}{PATCH_DIR}", report, f"{report}/dropped", f"{RESOLUTIONS_DIR}/{new_lock.version}"]


def _drive(git: Git, plan: Plan) -> list[str]:
    outcomes = run_steps(git, plan, dry_run=False)
    git.update_ref(f"{REBASE_REF_PREFIX}/head", plan.head, message="sglpatch rebase: progress")
    state.save(git, plan)
    crashpoint("rebase:progress")
    if outcomes and outcomes[-1].action == Action.STOP and plan.next < len(plan.names):
        _stop(git, plan, outcomes[-1])  # raises RebaseStopped
    return []


def _stop(git: Git, plan: Plan, o: Outcome) -> list[str]:
    i = plan.next
    data = export.format_patch(git, plan.old_commits[i])
    git.run("checkout", "-q", "--detach", plan.head)
    crashpoint("rebase:stop:checkout")
    with tempfile.TemporaryDirectory(prefix=tmp_prefix("rb"), dir=scratch_dir(git)) as tmp:
        pf = Path(tmp) / "patch"
        pf.write_bytes(data)
        rc, out, err = git.run("apply", "--3way", "--index", f"-p{plan.strips[i]}", "--whitespace=nowarn", "--", str(pf), check=False)
    unmerged = sorted(set(line.split("\t", 1)[1] for line in git.run("ls-files", "-u").splitlines() if "\t" in line))
    crashpoint("rebase:stop:applied")
    plan.stopped = {"index": i, "files": unmerged or o.files, "outcome": asdict(o)}
    state.save(git, plan)
    crashpoint("rebase:stop:saved")
    wd = git.workdir
    lines = table([Outcome(**d) for d in plan.outcomes] + [o])
    lines += [
        "",
        f"rebase stopped at patch {i + 1}/{len(plan.names)}: {o.name} ({o.subject})",
        f"{o.status}: " + (", ".join(plan.stopped["files"]) or "see above"),
        f"DIR {wd} is on a detached HEAD at the new stack so far, with the patch applied and conflict markers in place.",
        "next:",
        f"  1. edit the files above in {wd} (look for <<<<<<< / >>>>>>>), keeping the patch's intent on the new code",
        f"  2. sglpatch rebase --workdir {wd} --continue      # commits your resolution, records it, goes on",
        f"     sglpatch rebase --workdir {wd} --skip          # or: drop this patch (recorded as a decision)",
        f"     sglpatch rebase --workdir {wd} --abort         # or: put DIR and the project back exactly as before",
    ]
    raise RebaseStopped("\n".join(lines))


def _aborting(git: Git) -> None:
    """An --abort that was interrupted (killed) must be finished, not continued from its half-reset tree."""
    if state.abort_started(git):
        raise RebaseError(f"an `--abort` of the rebase in {git.workdir} was interrupted before it finished; "
                          f"`sglpatch rebase --workdir {git.workdir} --abort` finishes it (nothing is continued)")


def _where_stopped(git: Git, plan: Plan) -> None:
    """--continue / --skip take the tree as the resolution: it must be where the stop left it."""
    branch, head = git.current_branch(), git.head_commit()
    if branch is None and head == plan.head:
        return
    i, wd = plan.stopped["index"], git.workdir
    at = f"on branch {branch}" if branch else f"detached at {(head or '?')[:12]}"
    raise RebaseError(
        f"{wd} is not where the rebase stopped (detached at {plan.head[:12]}, the new stack before patch "
        f"{i + 1}/{len(plan.names)}) but {at}: nothing taken as a resolution; `git -C {wd} checkout -f --detach "
        f"{plan.head[:12]}` and resolve patch {i + 1} again (or --skip), or `sglpatch rebase --workdir {wd} --abort`")


def continue_(workdir: Path, skip: bool = False) -> list[str]:
    git = open_workdir(Path(workdir), create=False)
    _aborting(git)
    state.load(git)  # the one-line answer when there is nothing to continue (or its state is damaged)
    with Workdir(git.workdir).hold(git):
        _aborting(git)
        plan = state.load(git)  # again, under the lock: an --abort may have ended it meanwhile
        if plan.stopped:
            _where_stopped(git, plan)
        if not plan.stopped:  # the process was killed before it stopped or finished: resume
            if git.current_branch() is None and git.head_commit() == plan.head:
                # killed inside the stop: the half-applied patch there is ours, the stop redoes it
                git.run("reset", "-q", "--hard", plan.head)
            _drive(git, plan)
        else:
            _resolved(git, plan, skip)
        return _finish(git, plan)


def _resolved(git: Git, plan: Plan, skip: bool) -> None:
    """--continue / --skip after a stop: record the resolution, go on."""
    i = plan.stopped["index"]
    o = Outcome(**plan.stopped["outcome"])
    if skip:
        git.run("reset", "-q", "--hard", plan.head)
        o.action, o.how = Action.SKIP, "dropped by hand (--skip)"
        plan.hand[o.name] = "drop"
    else:
        touched = sorted(set(plan.stopped["files"]) | set(git.dirty_files()))
        git.run("add", "-u")
        for f in plan.stopped["files"]:
            if (git.workdir / f).exists():
                git.run("add", "--", f)
        left = []
        for f in touched:
            p = git.workdir / f
            if p.is_file():
                text = p.read_text(errors="replace")
                if re.search(r"^(<<<<<<< |>>>>>>> )", text, re.M):
                    left.append(f)
        if left:
            raise RebaseError(f"conflict markers are still in {', '.join(left)}; resolve them, then --continue again")
        tree = git.run("write-tree")
        if tree == git.tree_of(plan.head):
            o.action, o.how = Action.SKIP, "the resolution left no change: dropped"
            plan.hand[o.name] = "drop"
        else:
            new = commit_like(git, tree, plan.head, plan.old_commits[i])
            git.run("update-ref", "--no-deref", "-m", "sglpatch rebase: resolved", "HEAD", new)
            plan.head = new
            o.action, o.how, o.new_commit = Action.HAND, "resolved by hand", new
            plan.hand[o.name] = "replace"
    plan.outcomes.append(asdict(o))
    plan.next = i + 1
    plan.stopped = {}
    state.save(git, plan)
    _drive(git, plan)


def abort(workdir: Path, here: Path | None = None) -> list[str]:
    """here: the project this command runs in (None: none found); the recorded one must be it."""
    git = open_workdir(Path(workdir), create=False)
    with Workdir(git.workdir).hold(git):
        if not (rebase_state_dir(git) / REBASE_STATE_FILE).exists():
            state.load(git)  # says why there is nothing to abort
        orig, project = state.load_orig(git)  # also when state.json is damaged
        state.check_abortable(git, project, here)  # before anything moves
        with claim.holding(project):
            own = claim.check_abort(project, git)  # refused when another rebase claimed its line since
            lines = _abort(git, orig, project)
            if own:
                claim.release(project, own)
        return lines


def _abort(git: Git, orig: dict, project: Path) -> list[str]:
    """--abort's moves, once checked (under DIR's lock and the project's)."""
    state.mark_abort(git)  # from here on, the next command finishes this abort (never continues)
    crashpoint("rebase:abort:marked")
    # files first (HEAD may be detached at the new stack), then refs, then HEAD
    git.run("reset", "-q", "--hard", orig["head"])
    crashpoint("rebase:abort:reset")
    git.update_ref(f"refs/heads/{UPSTREAM_BRANCH}", orig["upstream"], message="sglpatch rebase --abort")
    git.update_ref(f"refs/heads/{PATCHED_BRANCH}", orig["patched"], message="sglpatch rebase --abort")
    if orig.get("branch"):
        git.run("symbolic-ref", "HEAD", f"refs/heads/{orig['branch']}")
    git.run("reset", "-q", "--hard", orig["head"])
    if orig.get("applied"):
        git.config_set(APPLIED_KEY, orig["applied"])
    for ref in ("onto", "head"):
        git.run("update-ref", "-d", f"{REBASE_REF_PREFIX}/{ref}", check=False)
    kept = state.restore(git, project)
    shutil.rmtree(rebase_state_dir(git))
    lines = [f"rebase aborted: {git.workdir} and {project} are back as they were"]
    if kept:
        lines.append(f"kept what you changed in {project} during the rebase (the rebase did not write it): " + ", ".join(kept))
    return lines


def _finish(git: Git, plan: Plan) -> list[str]:
    """The finishing step (under DIR's lock): every project folder it writes in is checked first
    (inside the project, writable), then the branches move and the project is written, each
    write recorded in the journal that --abort undoes."""
    project_root = Path(plan.project)
    state.check_project(project_root, _project_dirs(plan, Lock.parse(plan.old_lock, "old lock"), Lock.parse(plan.new_lock, "target")))
    with claim.holding(project_root):  # one finishing step (or --abort) at a time in the project
        own = claim.own_id(git) or claim.claim(project_root, git, plan.dest)  # a finish resumed keeps its claim
        with journal(state.journal_file(git), project_root):
            out = _finish_journaled(git, plan)
        claim.release(project_root, own)
    return out


def _finish_journaled(git: Git, plan: Plan) -> list[str]:
    project_root = Path(plan.project)
    old_lock = Lock.parse(plan.old_lock, "old lock")
    new_lock = Lock.parse(plan.new_lock, "target")
    outcomes = [Outcome(**d) for d in plan.outcomes]
    new_base, new_head = plan.onto, plan.head
    report_name = _report_name(old_lock, new_lock)
    # 1. DIR: backups, then the branches
    stamp = time.strftime("%Y%m%d-%H%M%S")
    git.update_ref(f"{BACKUP_PREFIX}/{stamp}-pre-rebase-upstream", plan.orig["upstream"], message="sglpatch rebase")
    git.update_ref(f"{BACKUP_PREFIX}/{stamp}-pre-rebase-patched", plan.orig["patched"], message="sglpatch rebase")
    crashpoint("rebase:finish:backup")
    git.update_ref(f"refs/heads/{UPSTREAM_BRANCH}", new_base, message=f"sglpatch rebase: {new_lock.describe()}")
    crashpoint("rebase:finish:upstream")
    if plan.source == "git":
        git.config_set(pin_key(UPSTREAM_BRANCH), f"{new_lock.pin_digest()} {new_base}")
    if git.current_branch() == PATCHED_BRANCH:
        git.run("reset", "-q", "--keep", new_head)
        git.update_ref(f"refs/heads/{PATCHED_BRANCH}", new_head, message="sglpatch rebase")
    else:
        git.update_ref(f"refs/heads/{PATCHED_BRANCH}", new_head, message="sglpatch rebase")
        git.run("checkout", "-q", PATCHED_BRANCH)
    crashpoint("rebase:finish:patched")
    # 2. report (before export, which deletes dropped patch files)
    report_dir = project_root / REPORTS_DIR / report_name
    rd = finish_report.range_diff(git, plan, new_base, new_head)
    snap = rebase_state_dir(git) / "project" / "files"
    for o in outcomes:
        if o.action in DROPPED:
            # from the snapshot: a killed earlier finish may have exported (removed) it already
            # a line's rebase leaves the primary's patches/ as they are: the dropped patch is read there
            old = project_root / PATCH_DIR / o.name if plan.dest else snap / PATCH_DIR / o.name
            write_if_changed(report_dir / "dropped" / o.name, old.read_bytes(), within=project_root)
    report = [
        f"# Rebase {old_lock.describe()} -> {new_lock.describe()}",
        "",
        f"source: {plan.source}; new upstream commit in the workdir {new_base}; new patched {new_head}",
        "",
        "```",
        *table(outcomes),
        "```",
        "",
        "## Per-patch range-diff (old stack vs new stack)",
        "",
    ]
    for part in finish_report.split_range_diff(rd):
        report += ["```diff", part, "```", ""]
    write_if_changed(report_dir / "report.md", ("\n".join(report) + "\n").encode(), within=project_root)
    write_if_changed(report_dir / "range-diff.txt", rd.encode(), within=project_root)
    crashpoint("rebase:finish:report")
    # 3. record hand resolutions
    if plan.hand:
        recs, _ = read_resolutions(project_root, new_lock.version)
        commits = git.commits(new_base, new_head)
        by_subject = {git.subject(c): c for c in commits}
        for k, name in enumerate(plan.names):
            action = plan.hand.get(name)
            if not action:
                continue
            o = next(o for o in outcomes if o.name == name)
            data = export.format_patch(git, by_subject[o.subject]) if action == "replace" else None
            # keyed by the conflict it resolves (rerere-like), so any release showing the same
            # conflict is offered it; a 3-way-but-broken stop has no conflict: keyed by the patch
            recs[name] = Recorded(action, f"resolved by hand during the rebase onto {new_lock.version}", plan.sha256s[k], data,
                                  o.conflict)
        write_resolutions(project_root, new_lock.version, recs)
        crashpoint("rebase:finish:resolutions")
    # 4. patches/ + series, lock (with the blobs of the files the new series touches), CHANGELOG
    return _finish_project(git, plan, outcomes, old_lock, new_lock, new_base, report_dir)


def _finish_project(git, plan, outcomes, old_lock, new_lock, new_base, report_dir) -> list[str]:
    project_root = Path(plan.project)
    line_root = project_root / plan.dest if plan.dest else project_root
    if plan.dest:
        seed_line(project_root, line_root, old_lock.version, new_lock.version)
    res = export.export_locked(line_root, git)  # this rebase holds DIR's lock
    crashpoint("rebase:finish:export")
    project = Project.load(line_root)
    new_lock.blobs = status.touched_blobs(git, new_base, project.patches)
    write_lock(line_root, new_lock)
    crashpoint("rebase:finish:lock")
    rel = str(report_dir.relative_to(project_root)) + "/report.md"
    before = rebase_state_dir(git) / "project" / "files" / (f"{plan.dest}/{CHANGELOG}" if plan.dest else CHANGELOG)
    finish_report.insert_changelog(
        line_root,
        finish_report.changelog_section(old_lock, new_lock, plan.source, outcomes, rel),
        before.read_text(encoding="utf-8") if before.is_file() else "",
    )
    crashpoint("rebase:finish:changelog")
    record(git, project.digest(new_base), git.rev(PATCHED_BRANCH))
    crashpoint("rebase:finish:recorded")
    for ref in ("onto", "head"):
        git.run("update-ref", "-d", f"{REBASE_REF_PREFIX}/{ref}", check=False)
    (rebase_state_dir(git) / REBASE_STATE_FILE).unlink()  # first: a kill in the rmtree leaves nothing to resume
    shutil.rmtree(rebase_state_dir(git))
    out = [f"rebased onto {new_lock.describe()}"] + table(outcomes)
    out.append(f"exported: {len(res.written)} written, {len(res.unchanged)} unchanged, {len(res.removed)} removed")
    if plan.dest:
        out.append(f"report: {rel}; the line {new_lock.version} is in {plan.dest}/ (series, patches/, upstream.lock, CHANGELOG.md: "
                   f"commit them); the primary series, patches/ and upstream.lock are unchanged (--promote rewrites them)")
        out.append(f"{git.workdir} holds it; install it with `sglpatch apply --line {new_lock.version} --workdir {git.workdir} "
                   f"--python PYTHON`, or build a new venv: `scripts/apply.sh --line {new_lock.version} --venv NEWDIR`")
    else:
        out.append(f"report: {rel}; CHANGELOG.md and upstream.lock updated (commit them)")
    return out
