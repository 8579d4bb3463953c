"""Materialize the pinned upstream tree as branch ``upstream`` of a workdir.

Three sources, all verified against every field of upstream.lock:

* ``sdist``: the registry sdist (downloaded by ``artifacts.fetch_sdist``, the one module that
  downloads release files, through the user's own pip configuration), sha256-checked, extracted
  under ``python/`` (the sdist is the repository's ``python/`` folder) and committed with fixed
  identity and dates, so the commit id is the same everywhere. When the tree cache holds the
  very tree the sdist makes (``sglpatch.upstream.unpack`` works its id out from the file), the workdir
  fetches it from there instead of extracting the sdist again: the same commit.
* ``wheel``: for wheel-only releases, the wheel's ``sglang/`` (``artifacts.fetch``, checked
  against the index's sha256 and the lock's).
* ``git``: a clone cache of the upstream URL (``git fetch`` of the tag, here); the tag must
  resolve to the locked commit.

The commit is built with a temporary index, so the user's checkout is never touched here. The
pin a rebase moves to (``--onto``: which release, its lock) is ``sglpatch.rebase.target``'s.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, tmp_prefix
from sglpatch.gitcmd import Git, last_line, validate_ref, validate_url
from sglpatch.upstream import artifacts, pkgindex, treecache
from sglpatch.upstream.cachedir import cache_dir
from sglpatch.upstream.pin import UNKNOWN_COMMIT, Lock, LockError
from sglpatch.upstream.unpack import commit_tree, commits_match, safe_extract, sdist_tree, wheel_tree
from sglpatch.workdir import UPSTREAM_BRANCH, pin_key, scratch_dir

PIN_TRAILER = "Sglpatch-Pin"


def _registry_message(lock: Lock, kind: str, extracted: str) -> str:
    """The message of a registry artifact's upstream commit: it names the artifact and the pin."""
    return (
        f"{lock.name} {lock.version} from the registry {kind}\n\n"
        f"{kind} {lock.sdist_filename} sha256 {lock.sdist_sha256}, {extracted} under {lock.sdist_subdir}/;\n"
        f"upstream {lock.url} {lock.tag} ({lock.commit}).\n\n"
        f"Sglpatch-Source: {kind}\n{PIN_TRAILER}: {lock.pin_digest()}\n"
    )


def _registry_commit(git: Git, root: Path, lock: Lock, kind: str, extracted: str) -> str:
    """The upstream commit of a registry artifact's tree, extracted under root."""
    return commit_tree(git, root, _registry_message(lock, kind, extracted))


def build_from_sdist(git: Git, lock: Lock, python: str | None = None) -> str:
    """The sdist's tree as the upstream commit: from the tree cache when it holds the very tree
    the sdist makes (its id worked out from the verified file, every object checked by git as it
    arrives), else extracted here. The same commit either way."""
    tarball = artifacts.fetch_sdist(lock, python)
    scratch = scratch_dir(git)
    with artifacts.readable(tarball):  # a vouched-for file that is no tar.gz: one line
        tree, sdist_commit = sdist_tree(tarball, lock.sdist_subdir)
    if sdist_commit and not commits_match(sdist_commit, lock.commit):
        raise LockError(
            f"upstream.lock: field upstream.commit ({lock.commit}) does not match the sdist's _version.py commit ({sdist_commit})"
        )
    crashpoint("materialize:extract")
    if tree and treecache.lend(git, "sdist", tarball, lock.sdist_sha256, lock.sdist_subdir, tree):
        return git.commit_tree(tree, _registry_message(lock, "sdist", "extracted"))
    with tempfile.TemporaryDirectory(prefix=tmp_prefix("sdist"), dir=scratch) as tmp:
        root = Path(tmp)
        dest = root / lock.sdist_subdir
        dest.mkdir(parents=True)
        say(f"extracting {tarball.name} under {lock.sdist_subdir}/")
        try:
            with artifacts.readable(tarball):
                safe_extract(tarball, dest)
        except OSError as e:
            raise SglpatchError(
                f"cannot extract {tarball.name} into {git.workdir}: {e.strerror}; free space there and re-run"
            ) from None
        return _registry_commit(git, root, lock, "sdist", "extracted")


def build_from_wheel(git: Git, lock: Lock, python: str | None = None) -> str:
    """The wheel's sglang/ under python/sglang/: exactly the files the wheel ships, minus dist-info.
    From the tree cache when it holds the very tree the wheel makes (as for an sdist), else
    extracted here. The same commit either way."""
    art, path = artifacts.fetch(lock.name, lock.version, "wheel", python, expect_sha256=lock.sdist_sha256)
    if art.filename != lock.sdist_filename:
        raise LockError(f"upstream.lock: field sdist.filename is {lock.sdist_filename} but the index's wheel is {art.filename}")
    recorded = artifacts.recorded_commit(path)
    if recorded and lock.commit != UNKNOWN_COMMIT and not commits_match(recorded, lock.commit):
        raise LockError(f"upstream.lock: field upstream.commit ({lock.commit}) does not match the wheel's _version.py commit ({recorded})")
    with artifacts.readable(path):
        tree = wheel_tree(path, lock.sdist_subdir)
    if tree and treecache.lend(git, "wheel", path, lock.sdist_sha256, lock.sdist_subdir, tree):
        return git.commit_tree(tree, _registry_message(lock, "wheel", "sglang/ extracted"))
    with tempfile.TemporaryDirectory(prefix=tmp_prefix("wheel"), dir=scratch_dir(git)) as tmp:
        root = Path(tmp)
        say(f"extracting sglang/ of {path.name} under {lock.sdist_subdir}/")
        try:
            artifacts.extract_wheel(path, root / lock.sdist_subdir)
        except OSError as e:
            raise SglpatchError(f"cannot extract {path.name} into {git.workdir}: {e.strerror}; free space there and re-run") from None
        return _registry_commit(git, root, lock, "wheel", "sglang/ extracted")


def build_registry(git: Git, lock: Lock, python: str | None = None) -> str:
    """The lock's registry artifact (sdist, or the wheel for wheel-only releases) as a commit."""
    return build_from_wheel(git, lock, python) if lock.artifact_kind == "wheel" else build_from_sdist(git, lock, python)


def build_from_git(git: Git, lock: Lock, url: str | None = None) -> str:
    url = validate_url(url or lock.url)
    tag = validate_ref(lock.tag, "tag")
    if lock.commit == UNKNOWN_COMMIT:
        raise SglpatchError(f"upstream.lock records no commit for {tag} (the release records none); use --source sdist or wheel")
    mirror = cache_dir() / "git" / (re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/"))[-80:] + ".git")
    if not (mirror / "HEAD").exists():
        mirror.mkdir(parents=True, exist_ok=True)
        Git(mirror).run("init", "--bare", "-q")
    mg = Git(mirror)
    have = mg.rev(f"refs/tags/{tag}")
    if not have or not commits_match(have, lock.commit):
        say(f"fetching {tag} from {url}")
        rc, _, err = mg.run(
            # --depth=1: the pinned tree is all we need, not SGLang's whole history (minutes, GBs)
            "fetch", "--no-tags", "--depth=1", "--progress", "--end-of-options", url, f"+refs/tags/{tag}:refs/tags/{tag}",
            check=False, network=True, progress=True,
        )
        if rc != 0:
            raise SglpatchError(f"cannot fetch {tag} from {url}: {last_line(err, 'git fetch failed')}; try --source sdist")
    commit = mg.rev(f"refs/tags/{tag}")
    if not commit or not commits_match(commit, lock.commit):
        raise LockError(f"upstream.lock: field upstream.commit ({lock.commit}) does not match tag {tag} at {url} ({commit})")
    git.run("fetch", "--no-tags", "--depth=1", "-q", f"file://{mirror}", f"refs/tags/{tag}")
    got = git.rev("FETCH_HEAD")
    if got != commit:
        raise SglpatchError(f"fetched {got} from the clone cache, expected {commit}")
    return commit


def verify_blobs(git: Git, commit: str, lock: Lock, source: str) -> None:
    for path, blob in sorted(lock.blobs.items()):
        have = git.blob_id(commit, path)
        if have is None:
            raise LockError(f"upstream.lock: field blobs.{path!r}: file missing from the {source} tree")
        if have != blob:
            raise LockError(f"upstream.lock: field blobs.{path!r} is {blob[:12]} but the {source} tree has {have[:12]}")


def upstream_pin(git: Git, branch: str = UPSTREAM_BRANCH) -> str | None:
    """The pin digest recorded on the existing upstream branch (None if absent / not ours)."""
    validate_ref(branch)
    rc, out, _ = git.run("log", "-1", "--format=%H%n%B", "--end-of-options", branch, "--", check=False)  # one git run
    if rc != 0:
        return None  # no such branch
    commit, _, msg = out.partition("\n")
    m = re.search(rf"^{PIN_TRAILER}: ([0-9a-f]{{64}})$", msg, re.M)
    if m:
        return m.group(1)
    recorded = (git.config_get(pin_key(branch)) or "").split()
    if len(recorded) == 2 and recorded[1] == commit:
        return recorded[0]
    return None


def holds_pin(workdir: Path, lock: Lock) -> bool:
    """Whether workdir's upstream branch is lock's pinned tree already (read only; no lock taken:
    materialize checks it again inside the workdir's lock)."""
    if not (Path(workdir) / ".git").is_dir():
        return False
    return upstream_pin(Git(Path(workdir))) == lock.pin_digest()


def source_reachable(url: str, tag: str, timeout: float = 8.0) -> tuple[bool, str]:
    """Whether the git URL answers for tag within timeout; (ok, reason)."""
    url = validate_url(url)
    validate_ref(tag, "tag")
    with tempfile.TemporaryDirectory() as tmp:
        g = Git(tmp)
        try:
            rc, out, err = g.run("ls-remote", "--exit-code", "--end-of-options", url, f"refs/tags/{tag}", check=False, network=True, timeout=timeout)
        except Exception as e:  # GitPython raises on kill_after_timeout
            return False, f"{url} did not answer within {timeout:.0f}s ({type(e).__name__})"
        if rc == 0 and out.strip():
            return True, f"{url} answered"
        return False, f"{url} is not reachable ({last_line(err, f'exit {rc}')})"


def choose_source(url: str, tag: str, name: str, version: str, timeout: float = 8.0, pinned: str | None = None) -> tuple[str, str]:
    """--source auto, the one rule (sglpatch.context asks it once per command): git when the URL
    answers for tag, else the registry: the artifact a lock pins (pinned: its file name; named by its
    kind, sdist or wheel), else the sdist, else a wheel the index offers; (source, why)."""
    ok, why = source_reachable(url, tag, timeout=timeout)
    if ok:
        return "git", why
    if pinned:
        return "wheel" if pinned.endswith(".whl") else "sdist", f"{why}; the registry's {pinned}, as the lock pins it"
    offered = pkgindex.kinds_offered(name, version)
    if "sdist" in offered:
        return "sdist", f"{why}; the registry has the sdist of {version}"
    if "wheel" in offered:
        return "wheel", f"{why}; the registry has no sdist of {version}, only wheels"
    raise pkgindex.no_release(name, version, f"{why}, and the registry offers neither an sdist nor a usable wheel of {name} {version}")


def materialize(
    git: Git, lock: Lock, source: str, python: str | None = None, url: str | None = None, branch: str = UPSTREAM_BRANCH
) -> str:
    """Make ``branch`` the verified pinned tree; returns its commit id. Reuses a matching branch."""
    if source not in ("git", "sdist", "wheel"):
        raise SglpatchError(f"unknown source {source!r}; use git, sdist or wheel")
    validate_ref(branch, "branch")
    current = git.rev(branch)
    if current and upstream_pin(git, branch) == lock.pin_digest():
        verify_blobs(git, current, lock, "upstream branch")
        return current
    t0 = time.monotonic()
    if source in ("sdist", "wheel"):
        if source != lock.artifact_kind:
            say(f"upstream.lock pins the registry {lock.artifact_kind} ({lock.sdist_filename}); using it")
            source = lock.artifact_kind
        commit = build_registry(git, lock, python)
    else:
        commit = build_from_git(git, lock, url)
    verify_blobs(git, commit, lock, source)
    crashpoint("materialize:built")
    git.update_ref(f"refs/heads/{branch}", commit, message=f"sglpatch: upstream {lock.describe()} from {source}")
    crashpoint("materialize:ref")
    if source == "git":
        git.config_set(pin_key(branch), f"{lock.pin_digest()} {commit}")
    say(f"upstream {lock.describe()} ready from {source} in {time.monotonic() - t0:.1f}s")
    return commit


def resolve_commit(project: Path) -> str:
    """Replace upstream.commit by the full 40-hex id the tag points at (git ls-remote)."""
    from sglpatch.upstream.pin import read_lock, write_lock

    lock = read_lock(project)
    url = validate_url(lock.url)
    tag = validate_ref(lock.tag, "tag")
    with tempfile.TemporaryDirectory() as tmp:
        rc, out, err = Git(tmp).run(
            "ls-remote", "--end-of-options", url, f"refs/tags/{tag}", f"refs/tags/{tag}^{{}}", check=False, network=True, timeout=60
        )
    if rc != 0:
        raise SglpatchError(f"cannot reach {url} ({last_line(err, 'git ls-remote failed')}); upstream.commit left as {lock.commit}")
    refs = dict(reversed(line.split("\t", 1)) for line in out.splitlines() if "\t" in line)
    full = refs.get(f"refs/tags/{tag}^{{}}") or refs.get(f"refs/tags/{tag}")
    if not full:
        raise SglpatchError(f"{url} has no tag {tag}")
    if not commits_match(full, lock.commit):
        raise LockError(f"upstream.lock: field upstream.commit ({lock.commit}) does not match {tag} at {url} ({full})")
    lock.commit = full
    write_lock(project, lock)
    return f"upstream.commit = {full}"
