"""The working tree and the index: is the workdir a repository, what is dirty, a private index.

temp_index() gives an index file of our own (GIT_INDEX_FILE) under a scratch folder, so that
building a tree never touches the user's index or worktree.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

from sglpatch.fsutil import tmp_prefix
from sglpatch.gitcmd.runner import Runner


class Worktree(Runner):
    """The workdir's checkout and index: is_repo, dirty_files, temp_index."""

    def is_repo(self) -> bool:
        if not (self.workdir / ".git").exists():
            return False
        rc, out, _ = self.run("rev-parse", "--show-toplevel", check=False)
        return rc == 0 and Path(out.strip()).resolve() == self.workdir.resolve()

    def dirty_files(self) -> list[str]:
        """Tracked files with uncommitted changes (staged or not)."""
        out = self.run("status", "--porcelain=v1", "--untracked-files=no", "-z", strip=False)
        return [entry[3:] for entry in out.split("\0") if entry]

    @contextmanager
    def temp_index(self, base: str | None = None, scratch: str | None = None, prefix: str = "idx"):
        """A private index file in a temporary folder under scratch (the workdir's scratch folder,
        so that a kill leaves nothing outside it), read from base's tree when given; yields
        (env, folder) with GIT_INDEX_FILE set in env. The user's index and worktree stay untouched."""
        with tempfile.TemporaryDirectory(prefix=tmp_prefix(prefix), dir=scratch) as tmp:
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            if base is not None:
                self.run("read-tree", base, env=env)
            yield env, Path(tmp)
