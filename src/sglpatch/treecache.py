"""Registry trees, unpacked once: ``$SGLPATCH_CACHE/trees.git``.

Each verified registry artifact (sdist or wheel) is unpacked once into a bare cache repository
as a commit, ref ``refs/sglpatch/trees/<artifact sha256>``; the watch and dry runs borrow its
objects read-only (``objects/info/alternates``) instead of extracting tens of thousands of
files again. The tree is the one ``upstream.build_registry`` commits (same extraction), so a
dry run classifies exactly what a real rebase would see.

Facts about a tree or a blob that are costly to find and never change (git objects are
immutable) are kept next to it, in ``facts/<kind>/<object id>.json`` under the cache repo.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

from sglpatch import artifacts
from sglpatch import upstream as up
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint
from sglpatch.gitcmd import Git
from sglpatch.lock import UNKNOWN_COMMIT, Lock, LockError

TREE_REF = "refs/sglpatch/trees"


def cache_repo() -> Git:
    path = up.cache_dir() / "trees.git"
    if not (path / "HEAD").exists():
        path.mkdir(parents=True, exist_ok=True)
        Git(path).run("init", "-q", "--bare")
    return Git(path)


def tree_commit(cg: Git, kind: str, path: Path, sha256: str, subdir: str = "python") -> str:
    """The artifact's tree as a commit in the cache repository (built once per sha256; path
    must already be verified against sha256)."""
    ref = f"{TREE_REF}/{sha256}"
    have = cg.rev(ref)
    if have:
        return have
    t0 = time.monotonic()
    say(f"unpacking {path.name} into the tree cache (once)")
    try:
        with tempfile.TemporaryDirectory(prefix="sglpatch-tree-") as tmp:
            dest = Path(tmp) / subdir
            dest.mkdir(parents=True)
            crashpoint("treecache:unpack")
            if kind == "wheel":
                artifacts.extract_wheel(path, dest)
            else:
                up._safe_extract(path, dest)
            commit = up._commit_tree(cg, Path(tmp), f"{path.name}\n\nsha256 {sha256}, unpacked under {subdir}/\n")
    except OSError as e:
        raise SglpatchError(f"cannot unpack {path.name} into the tree cache: {e.strerror or e}; free space and re-run") from None
    cg.update_ref(ref, commit, message="sglpatch: tree cache")
    say(f"cached the tree of {path.name} in {time.monotonic() - t0:.1f}s")
    return commit


def borrow(git: Git, cg: Git) -> None:
    """Let git (a bare scratch repository) read the cache repository's objects."""
    gitdir = git.workdir if (git.workdir / "objects").is_dir() else git.workdir / ".git"
    info = gitdir / "objects" / "info"
    info.mkdir(parents=True, exist_ok=True)
    alt = info / "alternates"
    objects = str((cg.workdir / "objects").resolve())
    lines = alt.read_text().split("\n") if alt.exists() else []
    if objects not in lines:
        alt.write_text("".join(f"{x}\n" for x in lines if x) + objects + "\n")


def registry_commit(git: Git, lock: Lock, python: str | None = None) -> str:
    """The lock's registry artifact as a commit git can read (through borrow): the artifact is
    fetched and verified exactly as build_registry does, its tree comes from the cache.
    For dry runs (the commit carries the cache's message, not the upstream branch's)."""
    if lock.artifact_kind == "wheel":
        _, path = artifacts.fetch(lock.name, lock.version, "wheel", python, expect_sha256=lock.sdist_sha256)
    else:
        path = up.fetch_sdist(lock, python)
    cg = cache_repo()
    commit = tree_commit(cg, lock.artifact_kind, path, lock.sdist_sha256, lock.sdist_subdir)
    rc, text, _ = cg.run("cat-file", "blob", f"{commit}:{lock.sdist_subdir}/sglang/_version.py", check=False, strip=False)
    recorded = artifacts._version_py_commit(text) if rc == 0 else ""
    if recorded and lock.commit != UNKNOWN_COMMIT and not up._commits_match(recorded, lock.commit):
        raise LockError(
            f"upstream.lock: field upstream.commit ({lock.commit}) does not match the {lock.artifact_kind}'s _version.py commit ({recorded})"
        )
    borrow(git, cg)
    return commit


def release_tree(cg: Git, name: str, version: str, kind: str, subdir: str = "python",
                 expect_sha256: str | None = None) -> tuple[artifacts.Artifact, str, dict]:
    """(artifact, cached tree commit, metadata) of a release, for the watch. Warm, nothing is
    read from the artifact: its tree and metadata are the ones cached under the sha256 the
    index publishes now (they were made from a file verified against it). Otherwise the
    artifact is fetched and verified (artifacts.fetch), unpacked and its metadata kept.
    metadata: requires_dist, requires_python, commit (what _version.py records, or '')."""
    art = artifacts.choose(name, version, kind)
    if art is None or not re.fullmatch(r"[0-9a-f]{64}", art.sha256) or (expect_sha256 and expect_sha256 != art.sha256):
        art, path = artifacts.fetch(name, version, kind, expect_sha256=expect_sha256)  # raises the one-line error
    commit = cg.rev(f"{TREE_REF}/{art.sha256}")
    meta = load_facts("artifact", art.sha256)
    if commit and {"requires_dist", "requires_python", "commit"} <= meta.keys():
        return art, commit, meta
    art, path = artifacts.fetch(name, version, kind, expect_sha256=expect_sha256)
    commit = tree_commit(cg, kind, path, art.sha256, subdir)
    m = artifacts.metadata(path)
    meta = {"requires_dist": m.get_all("Requires-Dist") or [], "requires_python": m.get("Requires-Python", "") or "",
            "commit": artifacts.recorded_commit(path)}
    save_facts("artifact", art.sha256, meta)
    return art, commit, meta


# --------------------------------------------------------------------------------------
# facts about immutable objects


def _facts_path(kind: str, oid: str) -> Path:
    return up.cache_dir() / "trees.git" / "facts" / kind / f"{oid}.json"


def load_facts(kind: str, oid: str) -> dict:
    try:
        return json.loads(_facts_path(kind, oid).read_text())
    except (OSError, ValueError):
        return {}


def save_facts(kind: str, oid: str, facts: dict) -> None:
    """Best effort (a read-only or full cache only costs speed)."""
    p = _facts_path(kind, oid)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}")
        tmp.write_text(json.dumps(facts, sort_keys=True))
        os.replace(tmp, p)
    except OSError:
        pass
