"""Refs and the repository's own config: resolving names, HEAD, moving a ref, .git/config.

Names are checked (sglpatch.gitcmd.validate) before git sees them, so no ref reads as an option.
"""

from __future__ import annotations

import configparser

from sglpatch.gitcmd.runner import Runner
from sglpatch.gitcmd.validate import validate_ref


class Refs(Runner):
    """Refs, HEAD and local config: rev, current_branch, head_commit, update_ref, config_get/set."""

    def rev(self, ref: str) -> str | None:
        """Full commit id of ref, or None when it does not exist."""
        validate_ref(ref)
        rc, out, _ = self.run("rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}", check=False)
        return out.strip() if rc == 0 else None

    def current_branch(self) -> str | None:
        """Branch HEAD points at (also when unborn), or None when detached."""
        head = self.repo.head
        return None if head.is_detached else head.reference.name

    def head_commit(self) -> str | None:
        try:
            return self.repo.head.commit.hexsha
        except ValueError:  # unborn branch
            return None

    def update_ref(self, ref: str, new: str, old: str | None = None, message: str = "sglpatch") -> None:
        args = ["update-ref", "-m", message, ref, new]
        if old is not None:
            args.append(old)
        self.run(*args)

    def config_get(self, key: str) -> str | None:
        """A value of the repository's own config (.git/config), as text."""
        section, _, option = key.rpartition(".")
        try:
            return self.repo.config_reader("repository").get(section, option)
        except (configparser.NoSectionError, configparser.NoOptionError):
            return None

    def config_set(self, key: str, value: str) -> None:
        section, _, option = key.rpartition(".")
        with self.repo.config_writer("repository") as cfg:
            cfg.set_value(section, option, value)
