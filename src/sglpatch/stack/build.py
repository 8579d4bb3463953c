"""The stack's build: branch ``patched`` (one commit per series entry) on the pinned tree
(export.py writes it back, status.py reports and checks it).

apply:  upstream.lock + series + patches/  ->  DIR: branch upstream, branch patched

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

from sglpatch import extrecord, lines
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint
from sglpatch.gitcmd import FIXED_DATE, Git, last_line
from sglpatch.project import Project
from sglpatch.series import (
    SERIES_NAME,
    Entry,
    PatchFile,
    hunks_by_path,
)
from sglpatch.upstream import materialize as up
from sglpatch.workdir import (
    BACKUP_PREFIX,
    PATCHED_BRANCH,
    UPSTREAM_BRANCH,
    Workdir,
    guard_movable,
    guard_no_rebase,
    move_patched,
    record,
    recorded,
    scratch_dir,
)

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
        kind = project.lock.artifact_kind
        say(f"the git source failed ({e}); using the registry {kind} instead")
        base = up.materialize(git, project.lock, kind, python=python)
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
    move_patched(git, new_head, old_head)
    # another pin's extensions must not stay beside this tree: after the move, so that a move that fails keeps
    # the old tree's (a kill between the two: the next apply drops them)
    extrecord.drop_other_pins(git, project.lock.pin_digest())
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
