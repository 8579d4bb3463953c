"""The object database: reading commits, trees and blobs, and writing commits (no ref moves).

Reads go through GitPython's long-running ``git cat-file --batch`` (cat(), one process for
many objects) or its object model; a damaged object is one line naming it, not a traceback.
commit_tree() writes a commit with the fixed identity and date unless told otherwise, so the
same tree and message give the same id everywhere.
"""

from __future__ import annotations

import git as gitpython  # GitPython

from sglpatch.errors import SglpatchError
from sglpatch.gitcmd.runner import FIXED_DATE, GitError, Runner


class Objects(Runner):
    """Objects of the repository: cat, tree_of, blob_text, blob_id, commits, subject, commit_tree."""

    def cat(self, spec: str) -> tuple[str, str, bytes] | None:
        """(object id, type, content) of spec ("COMMIT:PATH", an object id), None when there is no
        such object: GitPython's long-running ``git cat-file --batch`` (``repo``) instead of a
        process per object. A "missing" answer for an object git itself now resolves (it appeared
        after the batch started) is asked again of a fresh batch."""
        if "\n" in spec or not spec:
            raise GitError(f"cannot look up {spec!r}")
        for fresh in (False, True):
            try:
                sha, kind, size, data = self.repo.git.get_object_data(spec)
            except ValueError:  # GitPython: "SHA ... could not be resolved"
                rc, oid, _ = self.run("rev-parse", "--verify", "--quiet", "--end-of-options", spec, check=False)
                if rc != 0:
                    return None
                if fresh:  # git resolves it, but cannot read it: a damaged object
                    self._damaged(spec, oid.strip())
                self.repo.git.clear_cache()  # ends the old batch process
                continue
            except OSError:  # the batch process died on a damaged object
                self.repo.git.clear_cache()
                self._damaged(spec)
            if len(data) != int(size):  # cut short: a damaged object (the batch process is gone)
                self.repo.git.clear_cache()
                self._damaged(spec, sha.decode())
            return sha.decode(), kind.decode(), data
        return None

    def _damaged(self, spec: str, oid: str | None = None) -> None:
        """Raise the one line for an object git names but cannot read (a cut or damaged file)."""
        if oid is None:
            rc, out, _ = self.run("rev-parse", "--verify", "--quiet", "--end-of-options", spec, check=False)
            oid = out.strip() if rc == 0 else spec
        rc, _, err = self.run("cat-file", "-p", oid, check=False)
        why = "; ".join(line.strip() for line in err.splitlines() if line.strip()) or "its content is cut short"
        raise GitError(f"git object {oid} ({spec}) in {self.workdir} is damaged: {why}")

    def tree_of(self, commit: str) -> str:
        """The tree id of a commit (or of a tree), through cat()."""
        got = self.cat(commit)
        if got is not None and got[1] == "tree":
            return got[0]
        if got is not None and got[1] == "commit" and got[2].startswith(b"tree "):
            return got[2][5:45].decode()
        return self.run("rev-parse", "--verify", "--end-of-options", f"{commit}^{{tree}}")

    def blob_text(self, commit: str, path: str) -> str | None:
        """The file at path in commit (None when it is not a file there), through cat()."""
        got = self.cat(f"{commit}:{path}")
        return got[2].decode("utf-8", "surrogateescape") if got is not None and got[1] == "blob" else None

    def blob_id(self, commit: str, path: str) -> str | None:
        try:
            return (self.repo.commit(commit).tree / path).hexsha
        except (KeyError, ValueError, gitpython.exc.BadName):
            return None

    def commits(self, base: str, tip: str) -> list[str]:
        """Commit ids of base..tip, oldest first; refuses merges."""
        out = self.run("rev-list", "--reverse", "--parents", f"{base}..{tip}")
        result = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 2:
                raise SglpatchError(f"{tip} contains merge commit {parts[0][:12]}; the stack must be linear (rebase it)")
            result.append(parts[0])
        return result

    def subject(self, commit: str) -> str:
        """What ``git log --format=%s`` shows: the message's first paragraph on one line."""
        first = self.repo.commit(commit).message.strip().split("\n\n", 1)[0]
        return " ".join(line.strip() for line in first.splitlines())

    def commit_tree(self, tree: str, message: str, parents: tuple[str, ...] | list[str] = (), env: dict[str, str] | None = None) -> str:
        """A commit of tree on parents, no ref moved. env sets author and dates; by default the
        fixed identity and FIXED_DATE, so the same tree and message give the same id everywhere."""
        if env is None:
            env = {"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE}
        args = [x for p in parents for x in ("-p", p)]
        return self.run("commit-tree", tree, *args, input=message, env=env)
