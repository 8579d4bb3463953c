"""The only place that runs git: fixed flags, validated refs and URLs.

Every call goes through :class:`Git`, which runs the git binary through GitPython's
``Git.execute`` (commands that change things, and plumbing whose output we parse) or reads
through GitPython's object model (``Git.repo``: refs, HEAD, commit messages, blobs, the
repository's own config), in both cases with

* the user's global/system configuration ignored for local operations, so a
  ``diff.noprefix``, ``format.signature`` or ``core.autocrlf`` on the container
  cannot change what we apply or export (network operations keep the user's
  configuration: proxies and credential helpers live there);
* a fixed identity and fixed committer dates, so the same series on the same
  upstream gives the same commit ids on every machine;
* hooks disabled, the ``ext::`` transport disabled, no terminal prompts.
"""

from __future__ import annotations

import configparser
import functools
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import git as gitpython  # GitPython

from sglpatch.errors import SglpatchError
from sglpatch.fsutil import tmp_prefix

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

_SHA_RE = re.compile(r"^[0-9a-f]{7,40}$")
_REF_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/+@^~-]*$")
_SCP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9.-]*:[A-Za-z0-9._/~-]+$")


def last_line(text: str, default: str = "") -> str:
    """The last non-blank line of a command's output, stripped (what it says went wrong), or default."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else default


class GitError(SglpatchError):
    """A git command failed; the message names the command and git's own last line."""


def validate_ref(ref: str, what: str = "ref") -> str:
    """Refuse refs that git could read as options or that are not plain names/ids."""
    if not isinstance(ref, str) or not ref:
        raise SglpatchError(f"invalid {what}: empty")
    if ref.startswith("-"):
        raise SglpatchError(f"invalid {what} {ref!r}: must not start with '-'")
    if not _REF_RE.match(ref) or ".." in ref or "@{" in ref or ref.endswith((".lock", "/", ".")):
        raise SglpatchError(f"invalid {what} {ref!r}: use a tag, branch or commit id")
    return ref


def validate_sha(sha: str, what: str = "commit") -> str:
    if not isinstance(sha, str) or not _SHA_RE.match(sha):
        raise SglpatchError(f"invalid {what} {sha!r}: expected 7-40 lowercase hex digits")
    return sha


def validate_url(url: str) -> str:
    """Only https://, ssh://, scp-like git@host:path and file:// (or a local path) are accepted."""
    if not isinstance(url, str) or not url.strip():
        raise SglpatchError("invalid upstream url: empty")
    if url != url.strip() or any(c.isspace() for c in url):
        raise SglpatchError(f"invalid upstream url {url!r}: contains whitespace")
    if url.startswith("-"):
        raise SglpatchError(f"invalid upstream url {url!r}: must not start with '-'")
    if "::" in url:
        raise SglpatchError(f"invalid upstream url {url!r}: transport helpers (ext::, fd::) are not allowed")
    lowered = url.lower()
    if lowered.startswith(("https://", "ssh://", "file://")):
        # ssh://-oProxyCommand=... style: a host or user that ssh would read as an option
        authority = url.split("://", 1)[1].split("/", 1)[0]
        if any(part.startswith("-") for part in re.split(r"[@:\[]", authority)):
            raise SglpatchError(f"invalid upstream url {url!r}: host or user must not start with '-'")
        return url
    if _SCP_RE.match(url):
        return url
    if url.startswith("/"):
        return url
    raise SglpatchError(f"invalid upstream url {url!r}: only https://, ssh://, git@host:path and file:// are accepted")


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


class Git:
    """git in one directory, with the fixed flags above."""

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

    # -- queries ------------------------------------------------------------
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

    def is_repo(self) -> bool:
        if not (self.workdir / ".git").exists():
            return False
        rc, out, _ = self.run("rev-parse", "--show-toplevel", check=False)
        return rc == 0 and Path(out.strip()).resolve() == self.workdir.resolve()

    def rev(self, ref: str) -> str | None:
        """Full commit id of ref, or None when it does not exist."""
        validate_ref(ref)
        rc, out, _ = self.run("rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}", check=False)
        return out.strip() if rc == 0 else None

    def blob_id(self, commit: str, path: str) -> str | None:
        try:
            return (self.repo.commit(commit).tree / path).hexsha
        except (KeyError, ValueError, gitpython.exc.BadName):
            return None

    def current_branch(self) -> str | None:
        """Branch HEAD points at (also when unborn), or None when detached."""
        head = self.repo.head
        return None if head.is_detached else head.reference.name

    def head_commit(self) -> str | None:
        try:
            return self.repo.head.commit.hexsha
        except ValueError:  # unborn branch
            return None

    def dirty_files(self) -> list[str]:
        """Tracked files with uncommitted changes (staged or not)."""
        out = self.run("status", "--porcelain=v1", "--untracked-files=no", "-z", strip=False)
        return [entry[3:] for entry in out.split("\0") if entry]

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

    def update_ref(self, ref: str, new: str, old: str | None = None, message: str = "sglpatch") -> None:
        args = ["update-ref", "-m", message, ref, new]
        if old is not None:
            args.append(old)
        self.run(*args)

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

    def commit_tree(self, tree: str, message: str, parents: tuple[str, ...] | list[str] = (), env: dict[str, str] | None = None) -> str:
        """A commit of tree on parents, no ref moved. env sets author and dates; by default the
        fixed identity and FIXED_DATE, so the same tree and message give the same id everywhere."""
        if env is None:
            env = {"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE}
        args = [x for p in parents for x in ("-p", p)]
        return self.run("commit-tree", tree, *args, input=message, env=env)


def patch_paths(patch: bytes, strip: int = 1) -> tuple[list[str], list[str]]:
    """How git apply itself reads a patch's file headers (quoting, renames, copies, -pN).

    Returns, per file of the patch and in its order, (written, read): the path git apply
    writes (the new side; the old one for a deletion) and the path it reads (the old side;
    the new one for a creation). Runs in / with no repository around it, so that no
    checkout's subdirectory prefixes the paths; nothing is applied (``--numstat``).
    """
    written, read = _patch_paths(patch, strip)
    return list(written), list(read)


@functools.lru_cache(maxsize=256)
def _patch_paths(patch: bytes, strip: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """patch_paths, once per patch text in a process (errors are not kept: they raise again)."""
    git = Git("/")
    env = {"GIT_CEILING_DIRECTORIES": "/"}
    out = []
    for extra in ((), ("-R",)):
        rc, text, err = git.run("apply", "--numstat", "-z", f"-p{strip}", *extra, "-", input=patch, env=env, check=False)
        if rc != 0:
            errors = [line for line in err.strip().splitlines() if line.strip()]  # the first says what
            raise GitError(errors[0].removeprefix("error: ") if errors else f"git apply --numstat: exit {rc}")
        out.append([entry.split("\t", 2)[2] for entry in text.split("\0") if entry])
    written, read = out
    return tuple(written), tuple(read[::-1])  # with -R git applies (and lists) the files last to first
