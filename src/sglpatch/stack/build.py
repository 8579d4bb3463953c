"""The stack: build branch ``patched`` (one commit per series entry) and export it back.

apply:  upstream.lock + series + patches/  ->  DIR: branch upstream, branch patched
export: DIR: upstream..patched            ->  patches/ + series (byte-stable)

Safety rules (never lose anything of the user's):
* uncommitted edits to tracked files in DIR -> refuse, change nothing;
* HEAD detached or on a foreign branch -> refuse;
* commits on ``patched`` that did not come from the current series (unexported work)
  -> refuse unless --force, and even then the old branch is kept under refs/sglpatch/backup/;
* every new commit is built off to the side (temporary index), then one ref update and
  ``git reset --keep`` move DIR: a kill at any point leaves the old state or the new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from sglpatch import lineguard, lines
from sglpatch.upstream import materialize as up
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, private_tmpdir, remove, write_if_changed
from sglpatch.gitcmd import FIXED_DATE, Git, last_line
from sglpatch.project import Project
from sglpatch.series import (PATCH_DIR, REQUIRED_DEP3, SERIES_NAME, Entry, PatchFile, Series, hunks_by_path, parse_patch,
                             patch_path, read_patch, read_series, slug)
from sglpatch.workdir import (BACKUP_PREFIX, BUILT, PATCHED_BRANCH, UPSTREAM_BRANCH, Workdir, edits, guard_movable, guard_no_rebase,
                              move_patched, open_workdir, record, recorded, scratch_dir)

FORMAT_PATCH_FLAGS = (
    "--stdout", "--zero-commit", "--no-signature", "--full-index", "--find-renames", "--no-numbered", "--no-cover-letter",
    "--no-thread", "--no-notes", "--no-signoff", "--subject-prefix=PATCH", "--encoding=UTF-8", "--stat=72", "--summary", "--binary",
)


class ApplyError(SglpatchError):
    pass


# --------------------------------------------------------------------------------------
# applying one patch exactly


EXACT_ADVICE = "apply requires an exact fit to the pinned tree: refresh the patch, or use `sglpatch rebase` to move upstream"


def check_exact(git: Git, base: str, patch: PatchFile, strip: int, advice: str = EXACT_ADVICE) -> None:
    """Every hunk's old lines must sit exactly where the hunk says: no offset, no fuzz. advice: what
    the caller's user can do about a misfit (apply's by default)."""
    for path, hunks in hunks_by_path(patch, strip).items():
        content = git.blob_text(base, path)
        if content is None:
            raise ApplyError(
                f"patch {patch.name}: {path} does not exist in the tree it applies to; "
                f"check the patch's -p level in {SERIES_NAME} (it is -p{strip}) and that it was made against {base[:12]}'s release"
            )
        file_lines = content.split("\n")
        for n, h in enumerate(hunks, 1):
            at = h.old_start - 1
            if file_lines[at : at + len(h.old_lines)] == h.old_lines:
                continue
            where = None
            if h.old_lines:
                for k in range(len(file_lines) - len(h.old_lines) + 1):
                    if file_lines[k : k + len(h.old_lines)] == h.old_lines:
                        where = k
                        break
            if where is not None:
                why = f"needs an offset of {where - at:+d} lines"
            else:
                why = "does not apply (context differs; would need fuzz or a merge)"
            raise ApplyError(
                f"patch {patch.name}: {path} hunk #{n} ({h.header.split(' @@')[0]} @@) {why}; {advice}"
            )


_MESSAGES: dict[bytes, tuple[dict, str]] = {}  # patch bytes -> (mailinfo fields, commit message)


def commit_patch(git: Git, base: str, entry: Entry, patch: PatchFile, exact: bool = True, advice: str = EXACT_ADVICE) -> str:
    """Apply patch on top of base off to the side; return the new commit (git am's message and author)."""
    if exact:
        check_exact(git, base, patch, entry.strip, advice)
    with git.temp_index(base, scratch=scratch_dir(git), prefix="am") as (env, tmpd):
        pfile = tmpd / "patch"
        pfile.write_bytes(patch.data)
        rc, _, err = git.run(
            "apply", "--cached", f"-p{entry.strip}", "--whitespace=nowarn", "--", str(pfile), env=env, check=False
        )
        if rc != 0:
            raise ApplyError(f"patch {patch.name} does not apply: {last_line(err, 'git apply failed')}")
        tree = git.run("write-tree", env=env)
        if patch.data not in _MESSAGES:  # the same patch gives the same message (the watch applies it per release)
            info = git.run("mailinfo", "-u", str(tmpd / "msg"), str(tmpd / "diff"), input=patch.data)
            body = (tmpd / "msg").read_text(encoding="utf-8")
            fields = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line)
            subject = fields.get("Subject", patch.subject)
            _MESSAGES[patch.data] = (fields, git.run("stripspace", input=f"{subject}\n\n{body}", strip=False))
    fields, message = _MESSAGES[patch.data]
    env = {
        "GIT_AUTHOR_NAME": fields.get("Author", "unknown"),
        "GIT_AUTHOR_EMAIL": fields.get("Email", "unknown@localhost"),
        "GIT_AUTHOR_DATE": fields.get("Date", FIXED_DATE),
        "GIT_COMMITTER_DATE": fields.get("Date", FIXED_DATE),
    }
    return git.commit_tree(tree, message, [base], env=env)


def build_chain(git: Git, project: Project, base: str, progress: bool = True) -> list[str]:
    commits = []
    head = base
    n = len(project.patches)
    for k, (entry, patch) in enumerate(zip(project.series.entries, project.patches), 1):
        head = commit_patch(git, head, entry, patch)
        crashpoint(f"apply:patch:{k}")
        commits.append(head)
        if progress:
            say(f"[{k}/{n}] {entry.name}: {patch.subject}")
    return commits


# --------------------------------------------------------------------------------------
# apply


@dataclass
class ApplyResult:
    changed: bool
    head: str
    upstream: str
    message: str


def apply(
    project_root: Path,
    workdir: Path,
    source: str = "sdist",
    force: bool = False,
    python: str | None = None,
    url: str | None = None,
    sdist_fallback: bool = False,
    then=None,
) -> ApplyResult:
    """Build ``patched``; with sdist_fallback a failing git source (network, a tag that moved,
    a blob that differs) is reported and the registry sdist used instead (--source auto).
    then(result): what follows in the same transaction (the install), inside DIR's lock."""
    project = Project.load(project_root)
    with Workdir(workdir).transaction(create=True) as git:
        result = _apply_locked(git, project, project_root, source, force, python, url, sdist_fallback)
        if then is not None:
            then(result)
        return result


def _apply_locked(git: Git, project: Project, project_root: Path, source, force, python, url, sdist_fallback) -> ApplyResult:
    """apply, inside DIR's lock (apply's transaction)."""
    crashpoint("apply:locked")
    guard_no_rebase(git)
    guard_movable(git)
    lines.guard_move(git, project_root, project.lock)  # a tree a venv imports stays on its release
    try:
        base = up.materialize(git, project.lock, source, python=python, url=url)
    except SglpatchError as e:
        if not (sdist_fallback and source == "git"):
            raise
        say(f"the git source failed ({e}); using the registry sdist instead")
        base = up.materialize(git, project.lock, "sdist", python=python)
    digest = project.digest(base)
    old_head = git.rev(PATCHED_BRANCH)
    rec_digest, rec_head = recorded(git)
    if old_head and rec_digest == digest and rec_head == old_head:
        if git.current_branch() != PATCHED_BRANCH:
            git.run("checkout", "-q", PATCHED_BRANCH)
        return ApplyResult(False, old_head, base, f"{PATCHED_BRANCH} is up to date ({len(project.patches)} patches)")
    t0 = time.monotonic()
    unexported = bool(old_head) and old_head != rec_head
    # over commits that may be unexported work, build quietly first: a refusal must not
    # come after progress lines that look like a rebuild
    chain = build_chain(git, project, base, progress=not unexported)
    new_head = chain[-1] if chain else base
    if old_head == new_head:
        record(git, digest, new_head)
        if git.current_branch() != PATCHED_BRANCH:
            git.run("checkout", "-q", PATCHED_BRANCH)
        return ApplyResult(False, new_head, base, f"{PATCHED_BRANCH} is up to date ({len(project.patches)} patches)")
    if unexported:
        extra = _describe_unexported(git, old_head)
        if not force:
            raise ApplyError(
                f"{PATCHED_BRANCH} in {git.workdir} has work that is not in the series ({extra}); nothing was changed; "
                "run `sglpatch export` to save it into patches/, or re-run with --force to rebuild "
                f"(the old branch is kept under {BACKUP_PREFIX}/)"
            )
        for k, (entry, patch) in enumerate(zip(project.series.entries, project.patches), 1):
            say(f"[{k}/{len(chain)}] {entry.name}: {patch.subject}")
    if old_head:
        backup = f"{BACKUP_PREFIX}/{time.strftime('%Y%m%d-%H%M%S')}-{old_head[:12]}"
        git.update_ref(backup, old_head, message="sglpatch apply: previous patched")
        if old_head != rec_head:
            say(f"kept the previous {PATCHED_BRANCH} as {backup}")
    crashpoint("apply:backup")
    lineguard.drop_extensions(git, project.lock)  # another pin's extensions must not stay beside this tree
    move_patched(git, new_head, old_head)
    crashpoint("apply:moved")
    record(git, digest, new_head)
    return ApplyResult(
        True,
        new_head,
        base,
        f"{PATCHED_BRANCH} rebuilt: {len(chain)} patches on {project.lock.describe()} in {time.monotonic() - t0:.1f}s",
    )


def _describe_unexported(git: Git, head: str) -> str:
    base = git.rev(UPSTREAM_BRANCH)
    try:
        commits = git.commits(base, head) if base else []
    except SglpatchError:
        commits = []
    return f"{len(commits)} commits on {UPSTREAM_BRANCH}..{PATCHED_BRANCH}, head {head[:12]}, differ from the series"


# --------------------------------------------------------------------------------------
# export


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
