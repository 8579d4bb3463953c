"""The engine: classify every patch on the new upstream (in series order, each on the ones kept
before it), the steps a rebase takes, and the dry run (the upstream watch uses classify())."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from sglpatch.stack import build
from sglpatch.upstream import treecache
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, private_tmpdir
from sglpatch.gitcmd import Git
from sglpatch.upstream.pin import Lock
from sglpatch.project import Project
from sglpatch.series import PATCH_DIR, Entry, PatchFile, parse_patch, read_series
from sglpatch.rebase.outcome import EXIT_HUMAN, EXIT_NOTHING, EXIT_UNATTENDED, RESOLUTIONS_DIR, Action, Outcome, Status, table
from sglpatch.rebase import mergecheck
from sglpatch.rebase.merge import commit_like, conflict_regions, failing_hunks, three_way
from sglpatch.rebase.plan import in_sync_stack, new_plan, prepare
from sglpatch.rebase_plan_file import Plan
from sglpatch.workdir import open_workdir
from sglpatch.rebase.upstreamed import upstream_evidence
from sglpatch.rebase.resolutions import Recorded, rerere, conflict_key, lenient_resolutions, read_resolutions


RECORDED_ADVICE = "a recorded resolution must fit the new upstream exactly: re-record it (scripts/rerecord.sh VERSION)"


def _step(
    git: Git,
    plan: Plan,
    i: int,
    project_patch: PatchFile,
    recs: dict[str, Recorded],
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
    evidence = upstream_evidence(git, head, old_parent, old_commit, entry, patch)
    new_commit = None
    if evidence:
        o.status, o.action, o.how = Status.UPSTREAM, Action.DROP, evidence
        if not hint:
            o.note = "no Applied-Upstream field; found in the tree"
        return o
    try:
        new_commit = build.commit_patch(git, head, entry, patch, exact=True)
        o.status = Status.EXACT
    except SglpatchError:
        clean, tree, files = three_way(git, head, old_parent, old_commit)
        if clean and tree == git.tree_of(head):
            o.status, o.action = Status.UPSTREAM, Action.DROP
            o.how = "verified: the 3-way result equals the new upstream"
            return o
        if clean:
            o.status = Status.THREE_WAY
            new_commit = commit_like(git, tree, head, old_commit)
            problems = mergecheck.check(git, old_parent, head, new_commit, patch.files)
            if problems:  # merged is not working: never carried unattended
                o.status, o.how, o.hunks = Status.BROKEN, f"3-way but broken: {problems[0]}", problems
                o.files = sorted({x.split(":", 1)[0] for x in problems})
        else:
            modified = [f for f in patch.files if git.blob_text(old_parent, f) is not None]
            gone = [f for f in modified if git.blob_text(head, f) is None]
            o.status = Status.OBSOLETE if modified and len(gone) == len(modified) else Status.CONFLICT
            o.files = files
            o.hunks = failing_hunks(git, head, patch, entry.strip)
            for f in files:
                o.hunks += conflict_regions(git, tree, f)
    if hint:
        o.note = f"Applied-Upstream says {hint!r}, but the change is not in the new tree: kept"
    rec = recs.get(name)
    key = conflict_key(git, tree, o.files) if o.status in (Status.CONFLICT, Status.OBSOLETE) else ""
    o.conflict = key
    if key and (rec is None or rec.patch_sha256 != plan.sha256s[i]):
        rec = rerere(Path(plan.project), name, key, plan.sha256s[i], o) or rec
    if rec is not None and rec.patch_sha256 != plan.sha256s[i] and not (key and rec.conflict == key):
        o.note = (o.note + "; " if o.note else "") + (
            f"the recorded resolution in {RESOLUTIONS_DIR}/ is for another version of this patch: not used"
        )
        rec = None
    if rec is not None:
        if rec.action == "drop":
            o.action, o.how = Action.RECORDED_DROP, f"recorded decision: {rec.why}" if rec.why else "recorded decision"
            return o
        rp = parse_patch(name, rec.data, entry.strip)
        try:
            new_commit = build.commit_patch(git, head, entry, rp, exact=True, advice=RECORDED_ADVICE)
        except SglpatchError as e:
            o.action = Action.STOP
            o.note = (o.note + "; " if o.note else "") + f"the recorded resolution no longer applies ({e})"
            return o
        problems = mergecheck.check(git, old_parent, head, new_commit, rp.files)
        if problems:
            o.action = Action.STOP
            o.hunks = o.hunks + problems
            o.note = (o.note + "; " if o.note else "") + f"the recorded resolution applies but is broken on this upstream: {problems[0]}"
            return o
        o.action = Action.RECORDED
        o.how = f"recorded resolution {RESOLUTIONS_DIR}/{rec.version or '{version}'}/{name}" + (f": {rec.why}" if rec.why else "")
        o.new_commit = new_commit
        plan.head = new_commit
        return o
    if o.status in (Status.CONFLICT, Status.OBSOLETE, Status.BROKEN):
        o.action = Action.STOP
        return o
    o.action = Action.KEEP if o.status == Status.EXACT else Action.REFRESH
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


def run_steps(git: Git, plan: Plan, dry_run: bool, lenient: bool = False) -> list[Outcome]:
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
        o = _step(git, plan, i, patches[i], recs)
        o.how = o.how.replace("{version}", new_lock.version)
        if not dry_run:
            say(f"[{i + 1}/{n}] {o.name}: {o.status} -> {o.action}")
        if o.action == Action.STOP and not dry_run:
            return outcomes + [o]
        outcomes.append(o)
        plan.outcomes.append(asdict(o))
        plan.next = i + 1
        if not dry_run:
            crashpoint(f"rebase:patch:{i + 1}")
    return outcomes


def classify(git: Git, project_root: Path, old_base: str, old_commits: list[str], new_lock: Lock, onto: str, source: str) -> list[Outcome]:
    """Classify every patch of the project's series on `onto` (dry run; the watch calls this
    once per release with the old stack built once). git must hold all of these objects."""
    project = Project.load(project_root)
    plan = new_plan(project_root, project, source, new_lock, old_base, old_commits, onto)
    return run_steps(git, plan, dry_run=True, lenient=True)


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
            in_sync = in_sync_stack(dg, project)
            if in_sync is not None:
                objects = (Path(workdir) / ".git" / "objects").resolve()
                (scratch / "objects" / "info").mkdir(parents=True, exist_ok=True)
                (scratch / "objects" / "info" / "alternates").write_text(f"{objects}\n")
        plan = prepare(sg, project_root, onto, source, commit, url, in_sync, cached=True)
        outcomes = run_steps(sg, plan, dry_run=True)
    new_lock = Lock.parse(plan.new_lock, "target")
    if any(o.action == Action.STOP for o in outcomes):
        code, verdict = EXIT_HUMAN, "the series needs a human: conflicts without a recorded resolution"
    elif all(o.action == Action.KEEP for o in outcomes):
        code, verdict = EXIT_NOTHING, "every patch applies exactly: `sglpatch rebase` will only move the pin"
    else:
        code, verdict = EXIT_UNATTENDED, "the series needs work that `sglpatch rebase` does unattended"
    lines = [f"upstream watch: {project.lock.describe()} -> {new_lock.describe()} (dry run, nothing changed)"]
    lines += table(outcomes)
    lines.append(f"verdict: {verdict} (exit {code})")
    return DryRunResult(outcomes, new_lock.version, code, lines)
