"""The workdir DIR: the one owner of what sglpatch keeps there and of every name it uses for it.

    branch upstream          the pinned tree (sglpatch.upstream.materialize builds it)
    branch patched           one commit per series entry (sglpatch.stack.build builds it)
    refs/sglpatch/backup/    earlier heads, kept by apply --force and by a rebase
    refs/sglpatch/rebase/    a rebase's commits while it runs
    config sglpatch.managed  "true": DIR was made by sglpatch (set last, when the set-up is complete)
    config sglpatch.applied  "<series digest> <patched head>" of the last apply / export
    config sglpatch.first-checkout   set while the first checkout into a fresh DIR runs
    config sglpatch.pin-<branch>     "<pin digest> <commit>" of a branch built from git
    config sglpatch.installed-python every interpreter apply installed the tree into (one value each,
                             recorded BEFORE the install runs: a kill after pip still leaves it named)
    .git/sglpatch.lock       DIR's lock: one command at a time
    .git/sglpatch-tmp/       scratch files, inside .git so that a kill leaves nothing outside DIR
    .git/sglpatch-rebase/    a rebase's state (sglpatch.rebase.state; its plan, state.json: sglpatch.rebase_plan_file)
    python/sglang/_version.py  BUILT: rewritten by every install's build; put back, never an edit, never exported

Everyone else asks this module for these names; nobody copies them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from sglpatch import rebase_plan_file
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, exclusive, no_link
from sglpatch.gitcmd import Git

UPSTREAM_BRANCH = "upstream"
PATCHED_BRANCH = "patched"
MANAGED_KEY = "sglpatch.managed"
APPLIED_KEY = "sglpatch.applied"
CHECKOUT_KEY = "sglpatch.first-checkout"  # set while the first checkout into a fresh workdir runs
BACKUP_PREFIX = "refs/sglpatch/backup"
INSTALLED_KEY = "sglpatch.installed-python"  # every interpreter the tree was installed into (sglpatch.pythonenv.install)
FLASHINFER_BACK_KEY = "sglpatch.flashinfer-way-back"  # the command that restores the flashinfer set --with-flashinfer replaced (sglpatch.pythonenv.flashinfer_set)
REBASE_REF_PREFIX = "refs/sglpatch/rebase"
SCRATCH = "sglpatch-tmp"
# written by the tree's build (setuptools-scm) whenever it is installed: build output, never an edit
BUILT = ("python/sglang/_version.py",)
REBASE_STATE_DIR = "sglpatch-rebase"
REBASE_STATE_FILE = "state.json"  # in REBASE_STATE_DIR: there while a rebase is in progress
_EXCLUDES = ("*.egg-info/", "__pycache__/", "*.pyc", "/python/build/", "*.so")


def pin_key(branch: str) -> str:
    """The config key that records the pin of a branch built from git."""
    return f"sglpatch.pin-{branch.replace('/', '-')}"


# --------------------------------------------------------------------------------------
# the workdir object: one lock and one scratch space for every change to DIR (StGit's transaction)


class Workdir:
    """DIR, with its lock and its scratch space. ``with Workdir(path).transaction(create=...) as git``
    is the one way to change DIR: the lock is taken before `git init` (a second command on a new DIR
    is told another one is working on it, not that DIR is foreign), the scratch a killed run left is
    cleared inside it, and everything done in the block (the install included) holds it."""

    def __init__(self, path: Path):
        self.path = Path(os.path.normpath(os.path.abspath(os.path.expanduser(str(path)))))

    @contextmanager
    def _dir_lock(self, create: bool):
        if create and not self.path.exists():
            self.path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(str(self.path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                yield  # open_workdir says what is wrong with it
                return
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SglpatchError(f"another sglpatch command is working on {self.path} (setting it up, installing, exporting, "
                                    "rebasing or bisecting it); wait for it to finish, then re-run") from None
            yield
        finally:
            os.close(fd)

    @contextmanager
    def transaction(self, create: bool = False):
        """DIR opened (made when create) and locked from before `git init` to the end of the block."""
        with self._dir_lock(create):
            git = open_workdir(self.path, create=create)
            with exclusive(lockfile(git), str(git.workdir)):
                clear_scratch(git)  # left by a killed run
                yield git

    @contextmanager
    def hold(self, git: Git):
        """DIR's lock, the same two a transaction takes, for a command that opened DIR and read it
        first (a rebase's state, a bisect's range): the scratch is the caller's to clear."""
        with self._dir_lock(create=False), exclusive(lockfile(git), str(git.workdir)):
            yield git


# --------------------------------------------------------------------------------------
# making and opening DIR


def open_workdir(workdir: Path, create: bool) -> Git:
    workdir = Path(workdir).expanduser().absolute()
    if workdir.exists() and not workdir.is_dir():
        raise SglpatchError(f"{workdir} exists and is not a directory; choose another --workdir")
    if not workdir.exists() or (workdir.is_dir() and not any(workdir.iterdir())):
        if not create:
            raise SglpatchError(f"{workdir} is not set up yet; run `sglpatch apply{line_opt(workdir)} --workdir {workdir} --no-install` "
                                "first (builds the tree, installs nothing)")
        workdir.mkdir(parents=True, exist_ok=True)
        git = Git(workdir)
        git.run("init", "-q", f"--initial-branch={PATCHED_BRANCH}")
        crashpoint("init")
        _finish_init(git)
        return git
    if (workdir / ".git").is_file():  # `git worktree add`: .git is a file naming the main repository's
        main = re.sub(r"/\.git/worktrees/[^/]+/?$", "", (workdir / ".git").read_text().partition("gitdir:")[2].strip())
        raise SglpatchError(f"{workdir} is a linked worktree (`git worktree add`), and sglpatch keeps its lock and state "
                            f"in the workdir's own .git folder: use --workdir {main or 'the main one'}, or make another "
                            "with `sglpatch apply --workdir NEW`")
    git = Git(workdir)
    if not git.is_repo():
        raise SglpatchError(f"{workdir} is not empty and not a git repository made by sglpatch; choose another --workdir")
    if git.config_get(MANAGED_KEY) != "true" and create and _is_bare_init(git):
        # an earlier run was stopped between `git init` and marking the repository as ours:
        # nothing is in it (no ref, no file), so finishing the set-up cannot lose anything
        _finish_init(git)
    if git.config_get(MANAGED_KEY) != "true":
        raise SglpatchError(
            f"{workdir} is a git repository not made by sglpatch; refusing to touch it (choose an empty --workdir)"
        )
    return git


def line_opt(workdir: Path) -> str:  # for advice: the line a workdir's name says
    """` --line R` when workdir is named as line R's (sglpatch.linepath), else ''."""
    from sglpatch import linepath

    rel = linepath.release_of(linepath.base(), workdir)
    return f" --line {rel}" if rel else ""


def _finish_init(git: Git) -> None:
    exclude = git.workdir / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    header = "# build outputs of the editable install (sglpatch)\n"
    if header not in (exclude.read_text() if exclude.exists() else ""):
        with open(exclude, "a") as f:
            f.write(header + "\n".join(_EXCLUDES) + "\n")
    git.config_set(MANAGED_KEY, "true")  # last: marks the set-up complete


def _is_bare_init(git: Git) -> bool:
    """A repository exactly as `git init` left it: no refs, HEAD unborn, no file beside .git."""
    if any(p.name != ".git" for p in git.workdir.iterdir()):
        return False
    return git.head_commit() is None and git.run("for-each-ref", "--count=1") == ""


def lockfile(git: Git) -> Path:
    """DIR's lock file (fsutil.exclusive on it: one sglpatch command at a time in DIR)."""
    return git.workdir / ".git" / "sglpatch.lock"


# --------------------------------------------------------------------------------------
# DIR's checkout: may it move, and moving it


def put_back_built(git: Git, quiet: bool = False) -> list[str]:
    """Check out from HEAD the files an install's build rewrote (BUILT: never the user's edits, never
    exported), saying so unless quiet (the install's own clean-up); returns them. Only on our own
    branches: on the user's branch or a detached HEAD the file is theirs, and nothing is touched."""
    ours = git.current_branch() in (PATCHED_BRANCH, UPSTREAM_BRANCH)
    built = [p for p in git.dirty_files() if p in BUILT] if ours and git.head_commit() else []
    if built:
        git.run("checkout", "-q", "HEAD", "--", *built)
        if not quiet:
            say(f"put back {', '.join(built)} (rewritten by an install's build, e.g. the install-deps command: not an edit of yours)")
    return built


def edits(git: Git, put_back: bool = False) -> tuple[list[str], list[str]]:
    """(the tracked files with uncommitted changes that are the user's, those that are build output);
    put_back: put the build output back first (put_back_built), inside DIR's lock."""
    if put_back:
        put_back_built(git)
    dirty = git.dirty_files()
    return [p for p in dirty if p not in BUILT], [p for p in dirty if p in BUILT]


def guard_movable(git: Git) -> None:
    """Refuse to move DIR's checkout (apply) while git works there, while it has uncommitted
    changes, or while HEAD is detached or on a branch that is not ours."""
    index_lock = git.workdir / ".git" / "index.lock"
    if index_lock.exists():
        raise SglpatchError(
            f"{index_lock} exists: a git command is running in {git.workdir}, or one was killed; "
            "if no git is running there, remove that file and re-run; nothing was changed"
        )
    branch = git.current_branch()  # refused first, before anything in DIR is touched
    if branch is None:
        raise SglpatchError(
            f"HEAD in {git.workdir} is detached at {git.head_commit()[:12]}; put your work on a branch, then "
            f"`git -C {git.workdir} checkout {PATCHED_BRANCH}` and re-run; nothing was changed"
        )
    if branch not in (PATCHED_BRANCH, UPSTREAM_BRANCH) and git.head_commit() is not None:
        raise SglpatchError(f"{git.workdir} is on branch {branch!r}; `git -C {git.workdir} checkout {PATCHED_BRANCH}` "
                            "and re-run; nothing was changed")
    dirty = edits(git, put_back=True)[0]
    if dirty and git.head_commit() is None and git.config_get(CHECKOUT_KEY):
        dirty = []  # the first checkout into this fresh workdir was interrupted; apply finishes it
    if dirty:
        shown = ", ".join(dirty[:3]) + (f" and {len(dirty) - 3} more" if len(dirty) > 3 else "")
        raise SglpatchError(
            f"{git.workdir} has uncommitted changes ({shown}); commit them on {PATCHED_BRANCH} and run "
            "`sglpatch export`, or `git stash` them; nothing was changed"
        )


def move_patched(git: Git, new_head: str, old_head: str | None) -> None:
    """Move branch patched (and DIR's checkout, when on it) from old_head to new_head; the first
    checkout into a fresh DIR is marked (CHECKOUT_KEY), so that a killed one is finished next time."""
    branch = git.current_branch()
    if branch == PATCHED_BRANCH and old_head is not None:
        git.run("reset", "-q", "--keep", new_head)
    elif branch == PATCHED_BRANCH:  # unborn: fresh workdir; refuses to overwrite untracked files
        if git.config_get(CHECKOUT_KEY):
            # our own first checkout was killed half-way (HEAD still unborn): finish it
            git.run("read-tree", "--reset", "-u", new_head)
        else:
            git.config_set(CHECKOUT_KEY, new_head)
            empty_tree = git.run("hash-object", "-t", "tree", "--stdin", input=b"")
            git.run("read-tree", "-m", "-u", empty_tree, new_head)
        crashpoint("apply:checkout")
        git.update_ref(f"refs/heads/{PATCHED_BRANCH}", new_head, message="sglpatch apply")
        git.run("config", "--local", "--unset", CHECKOUT_KEY)
    else:
        git.update_ref(f"refs/heads/{PATCHED_BRANCH}", new_head, old_head, message="sglpatch apply")
        git.run("checkout", "-q", PATCHED_BRANCH)


# --------------------------------------------------------------------------------------
# what the last apply / export recorded


def recorded(git: Git) -> tuple[str | None, str | None]:
    """(series digest, patched head) of the last apply / export; (None, None) if none."""
    val = (git.config_get(APPLIED_KEY) or "").split()
    return (val[0], val[1]) if len(val) == 2 else (None, None)


def record(git: Git, digest: str, head: str) -> None:
    git.config_set(APPLIED_KEY, f"{digest} {head}")


# --------------------------------------------------------------------------------------
# scratch files


def _scratch_hint(git: Git) -> str:
    return f"sglpatch keeps its scratch files inside {git.workdir / '.git'}: remove the link and re-run"


def clear_scratch(git: Git) -> None:
    """Remove the scratch files a killed run left (the caller holds DIR's lock)."""
    d = no_link(git.workdir / ".git" / SCRATCH, _scratch_hint(git))
    shutil.rmtree(d, ignore_errors=True)


def scratch_dir(git: Git) -> str | None:
    """Where temporary files for this workdir go: inside its .git, so that a kill cannot leave
    anything outside the workdir (stale ones are removed by the next apply, under its lock)."""
    dotgit = git.workdir / ".git"
    if not dotgit.is_dir():
        return None
    d = no_link(dotgit / SCRATCH, _scratch_hint(git))
    d.mkdir(exist_ok=True)
    return str(d)


# --------------------------------------------------------------------------------------
# a rebase in progress


def rebase_state_dir(git: Git) -> Path:
    return no_link(git.workdir / ".git" / REBASE_STATE_DIR,
                   f"sglpatch keeps a rebase's state inside {git.workdir / '.git'}: remove the link and re-run")


def rebase_in_progress(git: Git) -> str:
    """'' when no rebase is in progress in DIR; else where it is, in a few words (a damaged
    state raises the line that says how to get out)."""
    f = rebase_state_dir(git) / REBASE_STATE_FILE
    if not f.exists():
        return ""
    if (f.parent / "abort.started").is_file():  # sglpatch.rebase.state.ABORT_MARK
        return f"an --abort of it was interrupted: `sglpatch rebase --workdir {git.workdir} --abort` finishes it"
    plan = rebase_plan_file.load(f, git.workdir)
    if plan.stopped:
        i = plan.stopped["index"]
        return f"stopped at patch {i + 1}/{len(plan.names)} ({plan.names[i]}) for you"
    return "its process was interrupted (killed?) before it finished"


def guard_no_rebase(git: Git) -> None:
    """Refuse to read or write the stack while a rebase is in progress in DIR (stopped for the
    user, or killed half-way: its branches and the project may be half moved)."""
    detail = rebase_in_progress(git)
    if detail:
        wd = git.workdir
        raise SglpatchError(
            f"a rebase is in progress in {wd} ({detail}); finish it with `sglpatch rebase --workdir {wd} --continue`, "
            "or undo it with `--abort`, then re-run"
        )
