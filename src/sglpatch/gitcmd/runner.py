"""How git is run: the fixed flags, environment and identity every call gets, and run().

:class:`Runner` runs the git binary through GitPython's ``Git.execute`` (commands that change
things, and plumbing whose output we parse) or hands out GitPython's object model (``repo``:
refs, HEAD, commit messages, blobs, the repository's own config), in both cases with

* the user's global/system configuration ignored for local operations, so a
  ``diff.noprefix``, ``format.signature`` or ``core.autocrlf`` on the container
  cannot change what we apply or export (network operations keep the user's
  configuration: proxies and credential helpers live there);
* a fixed identity and fixed committer dates, so the same series on the same
  upstream gives the same commit ids on every machine;
* hooks disabled, the ``ext::`` transport disabled, no terminal prompts.

This module owns all of that; the other parts of sglpatch.gitcmd (refs, objects, worktree)
only call run() and repo.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import git as gitpython  # GitPython

from sglpatch.errors import SglpatchError

IDENTITY_NAME = "sglpatch"
IDENTITY_EMAIL = "sglpatch@localhost"
# Commits we create (upstream snapshots) carry this date; commits made from a patch carry
# the patch's author date as committer date (``git am --committer-date-is-author-date``).
FIXED_DATE = "2000-01-01T00:00:00+00:00"

_FIXED_CONFIG = [
    "core.autocrlf=false",
    "core.safecrlf=false",
    "core.eol=lf",
    "core.hooksPath=/dev/null",
    "core.quotepath=false",
    "core.fsmonitor=false",
    "commit.gpgsign=false",
    "advice.detachedHead=false",
    "protocol.ext.allow=never",
    "protocol.file.allow=always",
    "diff.noprefix=false",
    "diff.mnemonicprefix=false",
    "diff.renames=true",
    "diff.algorithm=myers",
    "format.signature=",
    "format.coverLetter=false",
    "i18n.commitEncoding=UTF-8",
    "i18n.logOutputEncoding=UTF-8",
    "gc.auto=0",
    "maintenance.auto=false",
]


def last_line(text: str, default: str = "") -> str:
    """The last non-blank line of a command's output, stripped (what it says went wrong), or default."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else default


class GitError(SglpatchError):
    """A git command failed; the message names the command and git's own last line."""


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_AUTHOR_NAME": IDENTITY_NAME,
            "GIT_AUTHOR_EMAIL": IDENTITY_EMAIL,
            "GIT_COMMITTER_NAME": IDENTITY_NAME,
            "GIT_COMMITTER_EMAIL": IDENTITY_EMAIL,
            "LC_ALL": "C",
            "LANG": "C",
            "GIT_ALLOW_PROTOCOL": "https:ssh:file",
            "GIT_EDITOR": "true",
            "GIT_PAGER": "cat",
        }
    )
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_NAMESPACE"):
        env.pop(k, None)
    return env


class Runner:
    """git in one directory, with the fixed flags above: run() and the object model (repo)."""

    def __init__(self, workdir: Path | str):
        # absolute: git runs with cwd=workdir, so every path we hand it must not be relative
        self.workdir = Path(workdir).expanduser().absolute()
        self._runner = gitpython.Git(str(self.workdir))

    # -- running ------------------------------------------------------------
    def run(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        input: bytes | str | None = None,
        check: bool = True,
        network: bool = False,
        strip: bool = True,
        binary: bool = False,
        timeout: float | None = None,
        progress: bool = False,
    ):
        """Run ``git <args>`` and return stdout (str, or bytes with binary=True).

        With check=False return (returncode, stdout, stderr) instead. With progress=True git's
        stderr (its progress meter, for a long clone or fetch) is shown live as well as kept.
        """
        if not self.workdir.is_dir():
            raise SglpatchError(f"{self.workdir} does not exist or is not a directory")
        cmd = [gitpython.Git.GIT_PYTHON_GIT_EXECUTABLE or "git"]
        for item in _FIXED_CONFIG:
            cmd += ["-c", item]
        cmd += list(args)
        # local operations ignore the user's global/system config entirely
        full_env = _base_env() if network else self._local_env()
        if env:
            full_env.update(env)
        if isinstance(input, str):
            input = input.encode()
        if progress:
            return self._run_with_progress(cmd, full_env, args, check)
        with tempfile.TemporaryFile() as stdin:
            if input is not None:
                stdin.write(input)
                stdin.seek(0)
            try:
                rc, raw_out, raw_err = self._runner.execute(
                    cmd,
                    istream=stdin,
                    env=full_env,
                    with_extended_output=True,
                    with_exceptions=False,
                    stdout_as_string=False,
                    strip_newline_in_stdout=False,
                    kill_after_timeout=timeout,
                )
            except gitpython.exc.GitCommandNotFound as e:
                raise GitError(f"git is not installed or not on PATH ({e})") from None
        out = raw_out if binary else raw_out.decode("utf-8", "surrogateescape")
        err = raw_err.decode("utf-8", "replace") if isinstance(raw_err, bytes) else str(raw_err)
        if not check:
            return rc, out, err
        if rc != 0:
            raise GitError(f"git {args[0] if args else ''} failed in {self.workdir}: {last_line(err, f'exit {rc}')}")
        if strip and not binary:
            out = out.strip()
        return out

    def _run_with_progress(self, cmd: list[str], env: dict[str, str], args, check: bool):
        proc = subprocess.Popen(cmd, cwd=str(self.workdir), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        tail = b""
        while True:
            chunk = proc.stderr.read1(4096) if hasattr(proc.stderr, "read1") else proc.stderr.read(4096)
            if not chunk:
                break
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail = (tail + chunk)[-8192:]
        out = proc.stdout.read().decode("utf-8", "surrogateescape")
        rc = proc.wait()
        err = tail.decode("utf-8", "replace").replace("\r", "\n")
        if not check:
            return rc, out, err
        if rc != 0:
            raise GitError(f"git {args[0] if args else ''} failed in {self.workdir}: {last_line(err, f'exit {rc}')}")
        return out.strip()

    # -- environment and object model -----------------------------------------
    def _local_env(self) -> dict[str, str]:
        """The environment of every local operation (run() and the object model's git processes)."""
        return {**_base_env(), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}

    @functools.cached_property
    def repo(self) -> gitpython.Repo:
        """GitPython's object model of this repository (refs, commits, blobs, local config); the
        git processes it starts (``cat-file --batch``) get run()'s fixed local environment."""
        try:
            repo = gitpython.Repo(self.workdir)
        except (gitpython.exc.InvalidGitRepositoryError, gitpython.exc.NoSuchPathError):
            raise GitError(f"{self.workdir} is not a git repository") from None
        repo.git.update_environment(**self._local_env())
        return repo
