"""git helpers for the rebase: fixed commits, 3-way merges, conflict regions, failing hunks."""

from __future__ import annotations

from sglpatch.gitcmd import Git, last_line
from sglpatch.series import PatchFile, hunks_by_path, parse_patch
from sglpatch.rebase_plan_file import RebaseError
from sglpatch.workdir import scratch_dir


# --------------------------------------------------------------------------------------
# git helpers (all through gitcmd.Git)


def _fixed_commit(git: Git, tree: str, parents: list[str], message: str) -> str:
    key = (str(git.workdir), tree, tuple(parents), message)  # fixed identity and dates: the same id every time
    if key not in _FIXED:
        _FIXED[key] = git.commit_tree(tree, message, parents)
    return _FIXED[key]


_FIXED: dict[tuple, str] = {}


_LIKE: dict[tuple, tuple[str, str, str, str]] = {}  # (repository, commit) -> author name, email, date, message


def commit_like(git: Git, tree: str, parent: str, like: str) -> str:
    """A commit of tree on parent with the message and author of commit `like` (as git am would)."""
    key = (str(git.workdir), like)
    if key not in _LIKE:
        fmt = git.run("log", "-1", "--format=%an%x00%ae%x00%aI", like)
        _LIKE[key] = (*fmt.split("\0"), git.run("log", "-1", "--format=%B", like, strip=False))
    name, email, date, message = _LIKE[key]
    env = {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_DATE": date,
    }
    return git.commit_tree(tree, message, [parent], env=env)


def three_way(git: Git, head: str, old_parent: str, old_commit: str) -> tuple[bool, str, list[str]]:
    """3-way merge of old_parent..old_commit onto head, off to the side (no worktree, no refs).

    Synthetic commits give `git merge-tree --write-tree` the old parent as merge base
    (git < 2.40 has no --merge-base). Returns (clean, tree, conflicting paths).
    """
    base = _fixed_commit(git, git.tree_of(old_parent), [], "merge base\n")
    ours = _fixed_commit(git, git.tree_of(head), [base], "ours\n")
    theirs = _fixed_commit(git, git.tree_of(old_commit), [base], "theirs\n")
    rc, out, err = git.run("merge-tree", "--write-tree", "--name-only", "--no-messages", ours, theirs, check=False)
    lines = out.strip().splitlines()
    if rc not in (0, 1) or not lines:
        raise RebaseError(f"git merge-tree failed: {last_line(err, f'exit {rc}')}")
    tree = lines[0].strip()
    files = []
    for x in lines[1:]:
        if not x.strip():
            break
        if x not in files:
            files.append(x)
    return rc == 0, tree, files


def new_sides_present(git: Git, head: str, patch: PatchFile, strip: int) -> bool:
    """Whether every hunk's new side (context and added lines) is somewhere in head's file:
    without that, the patch cannot reverse-apply (git apply takes no fuzz), and git need not
    be asked."""
    diffs = patch.diffs if strip == patch.strip else parse_patch(patch.name, patch.data, strip).diffs
    for d in diffs:
        if d.new is None:
            continue  # a deleted file: git decides
        text = git.blob_text(head, d.new)
        if text is None:
            return False
        lines = text.split("\n")
        for h in d.hunks:
            k = len(h.new_lines)
            if k and not any(lines[i : i + k] == h.new_lines for i in range(len(lines) - k + 1)):
                return False
    return True


def reverse_applies(git: Git, head: str, data: bytes, strip: int) -> bool:
    with git.temp_index(head, scratch=scratch_dir(git), prefix="rb") as (env, tmp):
        pf = tmp / "patch"
        pf.write_bytes(data)
        rc, _, _ = git.run("apply", "--cached", "-R", "--check", f"-p{strip}", "--", str(pf), env=env, check=False)
        return rc == 0


def conflict_regions(git: Git, tree: str, path: str) -> list[str]:
    text = git.blob_text(tree, path)
    if text is None:
        return [f"{path}: deleted on one side, changed on the other"]
    regions, start = [], None
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("<<<<<<<"):
            start = n
        elif line.startswith(">>>>>>>") and start is not None:
            regions.append(f"{path}: lines {start}-{n} of the merged file")
            start = None
    return regions


def failing_hunks(git: Git, head: str, patch: PatchFile, strip: int) -> list[str]:
    """Hunks of the patch whose old lines are nowhere in the new tree."""
    out = []
    for path, hunks in hunks_by_path(patch, strip).items():
        text = git.blob_text(head, path)
        if text is None:
            out.append(f"{path}: file is gone from the new upstream")
            continue
        lines = text.split("\n")
        for n, h in enumerate(hunks, 1):
            k = len(h.old_lines)
            if not any(lines[i : i + k] == h.old_lines for i in range(len(lines) - k + 1)):
                out.append(f"{path}: hunk #{n} {h.header.split(' @@')[0]} @@ (context not found)")
    return out
