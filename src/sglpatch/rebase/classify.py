"""The engine: classify every patch on the new upstream (in series order), prepare the old stack and
the new upstream, and the dry run (the upstream watch uses classify())."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sglpatch import mergecheck, stack, treecache
from sglpatch import upstream as up
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, private_tmpdir
from sglpatch.gitcmd import Git
from sglpatch.lock import Lock
from sglpatch.project import Project
from sglpatch.rebaseplan import Plan, RebaseError
from sglpatch.series import PATCH_DIR, Entry, PatchFile, parse_patch, read_series
from sglpatch.workdir import PATCHED_BRANCH, UPSTREAM_BRANCH, open_workdir, recorded
from sglpatch.rebase.common import EXIT_HUMAN, EXIT_NOTHING, EXIT_UNATTENDED, Outcome, RESOLUTIONS_DIR, _table
from sglpatch.rebase.merge import _commit_like, _conflict_regions, _failing_hunks, _three_way
from sglpatch.rebase.upstreamed import _upstream_evidence
from sglpatch.rebase.resolutions import Recorded, _rerere, conflict_key, lenient_resolutions, read_resolutions


# --------------------------------------------------------------------------------------
# the engine


def _step(
    git: Git,
    plan: Plan,
    i: int,
    project_patch: PatchFile,
    recs: dict[str, Recorded],
    dry_run: bool,
) -> Outcome:
    """Classify patch i on plan.head and, when it can go on alone, extend plan.head."""
    name = plan.names[i]
    entry = Entry(name=name, strip=plan.strips[i])
    old_commit = plan.old_commits[i]
    old_parent = plan.old_base if i == 0 else plan.old_commits[i - 1]
    patch = project_patch
    head = plan.head
    hint = patch.dep3.get("Applied-Upstream", "")
    o = Outcome(name=name, subject=patch.subject, status="", hint=hint)
    evidence = _upstream_evidence(git, head, old_parent, old_commit, entry, patch)
    new_commit = None
    if evidence:
        o.status, o.action, o.how = "upstream", "drop", evidence
        if not hint:
            o.note = "no Applied-Upstream field; found in the tree"
        return o
    try:
        new_commit = stack.commit_patch(git, head, entry, patch, exact=True)
        o.status = "exact"
    except SglpatchError:
        clean, tree, files = _three_way(git, head, old_parent, old_commit)
        if clean and tree == git.tree_of(head):
            o.status, o.action = "upstream", "drop"
            o.how = "verified: the 3-way result equals the new upstream"
            return o
        if clean:
            o.status = "3way"
            new_commit = _commit_like(git, tree, head, old_commit)
            problems = mergecheck.check(git, old_parent, head, new_commit, patch.files)
            if problems:  # merged is not working: never carried unattended
                o.status, o.how, o.hunks = "3way-broken", f"3-way but broken: {problems[0]}", problems
                o.files = sorted({x.split(":", 1)[0] for x in problems})
        else:
            modified = [f for f in patch.files if git.blob_text(old_parent, f) is not None]
            gone = [f for f in modified if git.blob_text(head, f) is None]
            o.status = "obsolete" if modified and len(gone) == len(modified) else "conflict"
            o.files = files
            o.hunks = _failing_hunks(git, head, patch, entry.strip)
            for f in files:
                o.hunks += _conflict_regions(git, tree, f)
    if hint:
        o.note = f"Applied-Upstream says {hint!r}, but the change is not in the new tree: kept"
    rec = recs.get(name)
    key = conflict_key(git, tree, o.files) if o.status in ("conflict", "obsolete") else ""
    o.conflict = key
    if key and (rec is None or rec.patch_sha256 != plan.sha256s[i]):
        rec = _rerere(Path(plan.project), name, key, plan.sha256s[i], o) or rec
    if rec is not None and rec.patch_sha256 != plan.sha256s[i] and not (key and rec.conflict == key):
        o.note = (o.note + "; " if o.note else "") + (
            f"the recorded resolution in {RESOLUTIONS_DIR}/ is for another version of this patch: not used"
        )
        rec = None
    if rec is not None:
        if rec.action == "drop":
            o.action, o.how = "recorded-drop", f"recorded decision: {rec.why}" if rec.why else "recorded decision"
            return o
        rp = parse_patch(name, rec.data, entry.strip)
        try:
            new_commit = stack.commit_patch(git, head, entry, rp, exact=True, advice=RECORDED_ADVICE)
        except SglpatchError as e:
            o.action = "stop"
            o.note = (o.note + "; " if o.note else "") + f"the recorded resolution no longer applies ({e})"
            return o
        problems = mergecheck.check(git, old_parent, head, new_commit, rp.files)
        if problems:
            o.action = "stop"
            o.hunks = o.hunks + problems
            o.note = (o.note + "; " if o.note else "") + f"the recorded resolution applies but is broken on this upstream: {problems[0]}"
            return o
        o.action = "recorded"
        o.how = f"recorded resolution {RESOLUTIONS_DIR}/{rec.version or '{version}'}/{name}" + (f": {rec.why}" if rec.why else "")
        o.new_commit = new_commit
        plan.head = new_commit
        return o
    if o.status in ("conflict", "obsolete", "3way-broken"):
        o.action = "stop"
        return o
    o.action = "keep" if o.status == "exact" else "refresh"
    o.new_commit = new_commit
    plan.head = new_commit
    return o


def _load_old_patches(project_root: Path, plan: Plan) -> list[PatchFile]:
    series = read_series(project_root)
    by = {e.name: e for e in series.entries}
    out = []
    for name in plan.names:
        out.append(parse_patch(name, (project_root / PATCH_DIR / name).read_bytes(), by[name].strip))
    return out


def _run_steps(git: Git, plan: Plan, dry_run: bool, lenient: bool = False) -> list[Outcome]:
    """Go on from plan.next; returns all outcomes; stops (real rebase) at the first 'stop'.
    lenient (the watch): a resolutions folder that cannot be read is left out, with one line."""
    project_root = Path(plan.project)
    new_lock = Lock.parse(plan.new_lock, "target")
    outcomes = [Outcome(**d) for d in plan.outcomes]
    n = len(plan.names)
    if plan.next >= n:  # all classified: a resumed finish, whose project may be exported already
        return outcomes
    recs, _ = (lenient_resolutions if lenient else read_resolutions)(project_root, new_lock.version)
    patches = _load_old_patches(project_root, plan)
    while plan.next < n:
        i = plan.next
        o = _step(git, plan, i, patches[i], recs, dry_run)
        o.how = o.how.replace("{version}", new_lock.version)
        if not dry_run:
            say(f"[{i + 1}/{n}] {o.name}: {o.status} -> {o.action}")
        if o.action == "stop" and not dry_run:
            return outcomes + [o]
        outcomes.append(o)
        plan.outcomes.append(asdict(o))
        plan.next = i + 1
        if not dry_run:
            crashpoint(f"rebase:patch:{i + 1}")
    return outcomes


# --------------------------------------------------------------------------------------
# preparing: old stack, new upstream


def _in_sync_stack(git: Git, project: Project) -> tuple[str, list[str]] | None:
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


RECORDED_ADVICE = "a recorded resolution must fit the new upstream exactly: re-record it (scripts/rerecord.sh VERSION)"


def _build_new_upstream(git: Git, lock: Lock, source: str, url: str | None) -> str:
    if source in ("sdist", "wheel"):
        return up.build_registry(git, lock)
    if source == "git":
        return up.build_from_git(git, lock, url)
    raise RebaseError(f"unknown source {source!r}; use auto, git, sdist or wheel")


def _resolve_source(project: Project, onto: str, source: str, url: str | None) -> str:
    """--source auto: git when the URL answers, else the sdist, else the wheel (says which and why)."""
    if source != "auto":
        return source
    m = up._ONTO_VERSION_RE.match(onto.strip())
    if not m:
        return "git"
    tag = onto if onto.startswith("v") else f"v{m.group(1)}"
    chosen, why = up.choose_source(url or project.lock.url, tag, project.lock.name, m.group(1))
    say(f"source: {chosen} ({why})")
    return chosen


def _prepare(git: Git, project_root: Path, onto: str, source: str, commit: str | None, url: str | None, in_sync,
             cached: bool = False) -> Plan:
    """cached (dry runs): registry trees come from the tree cache (sglpatch.treecache), which git
    (a scratch repository) then borrows; a real rebase commits them into the workdir."""
    project = Project.load(project_root)
    source = _resolve_source(project, onto, source, url)
    registry = treecache.registry_commit if cached else up.build_registry
    if in_sync is None:
        say(f"building the current stack on {project.lock.describe()} to compare against")
        old_base = up.build_from_git(git, project.lock, url) if source == "git" else registry(git, project.lock)
        up.verify_blobs(git, old_base, project.lock, source)
        old_commits = stack.build_chain(git, project, old_base, progress=False)
    else:
        old_base, old_commits = in_sync
    version_guess = up._ONTO_VERSION_RE.match(onto)
    recorded_target = {}
    if version_guess:
        _, recorded_target = read_resolutions(project_root, version_guess.group(1))
    new_lock = up.target_lock(project.lock, onto, source, recorded=recorded_target, commit=commit, url=url)
    if new_lock.pin_digest() == project.lock.pin_digest():
        raise RebaseError(f"the series is already pinned to {new_lock.describe()}; nothing to rebase")
    t0 = time.monotonic()
    onto_commit = registry(git, new_lock) if cached and source in ("sdist", "wheel") else _build_new_upstream(git, new_lock, source, url)
    got = new_lock.artifact_kind if source in ("sdist", "wheel") else source  # 0.5.11+ have no sdist: the wheel
    why = f" (the registry has no {source} of {new_lock.version})" if got != source else ""
    say(f"new upstream {new_lock.describe()} ready from {got}{why} in {time.monotonic() - t0:.1f}s")
    return Plan(
        project=str(project_root),
        source=source,
        old_lock=project.lock.dumps(),
        new_lock=new_lock.dumps(),
        old_base=old_base,
        old_commits=old_commits,
        names=[e.name for e in project.series.entries],
        strips=[e.strip for e in project.series.entries],
        sha256s=[hashlib.sha256(p.data).hexdigest() for p in project.patches],
        onto=onto_commit,
        head=onto_commit,
    )


def classify(git: Git, project_root: Path, old_base: str, old_commits: list[str], new_lock: Lock, onto: str, source: str) -> list[Outcome]:
    """Classify every patch of the project's series on `onto` (dry run; the watch calls this
    once per release with the old stack built once). git must hold all of these objects."""
    project = Project.load(project_root)
    plan = Plan(
        project=str(project_root), source=source, old_lock=project.lock.dumps(), new_lock=new_lock.dumps(),
        old_base=old_base, old_commits=list(old_commits), names=[e.name for e in project.series.entries],
        strips=[e.strip for e in project.series.entries], sha256s=[hashlib.sha256(p.data).hexdigest() for p in project.patches],
        onto=onto, head=onto,
    )
    outcomes = _run_steps(git, plan, dry_run=True, lenient=True)
    for o in outcomes:
        o.how = o.how.replace("{version}", new_lock.version)
    return outcomes


# --------------------------------------------------------------------------------------
# dry run: the upstream watch


@dataclass
class DryRunResult:
    outcomes: list[Outcome]
    target: str
    exit_code: int
    lines: list[str]


def dry_run(
    project_root: Path, workdir: Path | None, onto: str, source: str = "sdist", commit: str | None = None, url: str | None = None
) -> DryRunResult:
    """Classify without changing anything: work happens in a scratch repository that borrows
    DIR's objects read-only (objects/info/alternates); DIR's refs, files and config stay as they are."""
    return treecache.healing(_dry_run, project_root, workdir, onto, source, commit, url)  # a damaged cached object: once more


def _dry_run(project_root: Path, workdir: Path | None, onto: str, source: str, commit: str | None, url: str | None) -> DryRunResult:
    project_root = Path(project_root).resolve()
    project = Project.load(project_root)
    with private_tmpdir("watch") as tmp:
        scratch = Path(tmp) / "repo"
        scratch.mkdir()
        sg = Git(scratch)
        sg.run("init", "-q", "--bare")
        in_sync = None
        if workdir is not None and (Path(workdir) / ".git").is_dir():
            dg = open_workdir(Path(workdir), create=False)
            in_sync = _in_sync_stack(dg, project)
            if in_sync is not None:
                objects = (Path(workdir) / ".git" / "objects").resolve()
                (scratch / "objects" / "info").mkdir(parents=True, exist_ok=True)
                (scratch / "objects" / "info" / "alternates").write_text(f"{objects}\n")
        plan = _prepare(sg, project_root, onto, source, commit, url, in_sync, cached=True)
        outcomes = _run_steps(sg, plan, dry_run=True)
    new_lock = Lock.parse(plan.new_lock, "target")
    if any(o.action == "stop" for o in outcomes):
        code, verdict = EXIT_HUMAN, "the series needs a human: conflicts without a recorded resolution"
    elif all(o.action == "keep" for o in outcomes):
        code, verdict = EXIT_NOTHING, "every patch applies exactly: `sglpatch rebase` will only move the pin"
    else:
        code, verdict = EXIT_UNATTENDED, "the series needs work that `sglpatch rebase` does unattended"
    lines = [f"upstream watch: {project.lock.describe()} -> {new_lock.describe()} (dry run, nothing changed)"]
    lines += _table(outcomes)
    lines.append(f"verdict: {verdict} (exit {code})")
    return DryRunResult(outcomes, new_lock.version, code, lines)
