"""Registry trees, unpacked once: ``$SGLPATCH_CACHE/trees.git``.

Each verified registry artifact (sdist or wheel) is unpacked once into a bare cache repository
as a commit, ref ``refs/sglpatch/trees/<artifact sha256>``; the watch and dry runs borrow its
objects read-only (``objects/info/alternates``) instead of extracting tens of thousands of
files again. The tree is the one ``materialize.build_registry`` commits (same extraction), so a
dry run classifies exactly what a real rebase would see. An apply or a real rebase fetches an
sdist's or a wheel's tree from here into its workdir (``lend``) when it is the tree the file
makes, its id worked out from the verified file (``sglpatch.upstream.unpack``).

Facts about a tree or a blob that are costly to find and never change (git objects are
immutable) are kept next to it, in ``facts/<kind>/<object id>.json`` under the cache repo.

The cache is not trusted blindly (a shared CI cache, a ref moved by hand or by a bug): a cached
commit is used for an artifact only when its message names that artifact's sha256 and it is the
commit (and tree) recorded when that very artifact was unpacked (``facts/artifact-tree/``);
otherwise it is unpacked again, with one line. A damaged object (a cut file) is removed with
the cached trees that hold it, which are then unpacked again (``healing``).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from sglpatch.upstream import artifacts, pkgindex
from sglpatch.upstream.cachedir import cache_dir, cache_subdir
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import clean_stale_tmp, crashpoint, open_regular, private_tmpdir
from sglpatch.gitcmd import Git, GitError, last_line
from sglpatch.upstream.pin import UNKNOWN_COMMIT, Lock, LockError
from sglpatch.upstream.unpack import commit_tree as _commit_tree
from sglpatch.upstream.unpack import commits_match, safe_extract

TREE_REF = "refs/sglpatch/trees"


STALE_PACK_S = 3600  # a repack's temporary file this old is a killed one's (a live repack writes it in seconds)


def cache_repo() -> Git:
    clean_stale_tmp()  # what a killed watch or dry run left in TMPDIR
    path = cache_dir() / "trees.git"
    if not (path / "HEAD").exists():
        cache_subdir("trees.git")
        Git(path).run("init", "-q", "--bare")
    _sweep_killed_repacks(path / "objects" / "pack")
    return Git(path)


def _sweep_killed_repacks(pack: Path) -> None:
    """A repack killed while it wrote (tree_commit's) leaves tmp_pack_* / tmp_idx_* / .tmp-*-pack-*
    for ever: remove those older than STALE_PACK_S (a repack running now may be writing a young one)."""
    now = time.time()
    for p in [*pack.glob("tmp_pack_*"), *pack.glob("tmp_idx_*"), *pack.glob(".tmp-*-pack-*")]:
        try:
            if p.is_file() and not p.is_symlink() and now - p.stat().st_mtime > STALE_PACK_S:
                p.unlink()
        except OSError:
            pass


def cached(cg: Git, sha256: str, name: str) -> str | None:
    """The cached commit of the artifact with this sha256, when it is bound to it: its message
    names the sha256, and it is the commit and tree recorded when that artifact was unpacked.
    Anything else is dropped, with one line, so that the caller unpacks the artifact again."""
    ref = f"{TREE_REF}/{sha256}"
    have = cg.rev(ref)
    if not have:
        if cg.run("rev-parse", "--verify", "--quiet", "--end-of-options", ref, check=False)[0] == 0 and not _heal_packs(cg):
            say(f"the tree cache's {ref} cannot be read (a damaged object); unpacking {name} again")
        return None
    rc, body, _ = cg.run("cat-file", "commit", have, check=False)
    rec = load_facts("artifact-tree", sha256)
    if rc == 0 and f"\nsha256 {sha256}, " in body and (not rec or (rec.get("commit") == have and rec.get("tree") == cg.tree_of(have))):
        return have
    named = re.search(r"sha256 ([0-9a-f]{64})", body)
    why = f"it names the artifact {named.group(1)[:12]}" if named and named.group(1) != sha256 else "it is not the one unpacked from it"
    say(f"the tree cache's {ref} does not hold the tree of {name} ({why}); unpacking {name} again")
    cg.run("update-ref", "-d", ref)
    return None


def tree_commit(cg: Git, kind: str, path: Path, sha256: str, subdir: str = "python") -> str:
    """The artifact's tree as a commit in the cache repository (built once per sha256; path
    must already be verified against sha256)."""
    ref = f"{TREE_REF}/{sha256}"
    have = cached(cg, sha256, path.name)
    if have:
        return have
    t0 = time.monotonic()
    say(f"unpacking {path.name} into the tree cache (once)")
    try:
        with private_tmpdir("tree") as tmp, artifacts.readable(path):
            dest = Path(tmp) / subdir
            dest.mkdir(parents=True)
            crashpoint("treecache:unpack")
            if kind == "wheel":
                artifacts.extract_wheel(path, dest)
            else:
                safe_extract(path, dest)
            commit = _commit_tree(cg, Path(tmp), f"{path.name}\n\nsha256 {sha256}, unpacked under {subdir}/\n")
    except OSError as e:
        raise SglpatchError(f"cannot unpack {path.name} into the tree cache: {e.strerror or e}; free space and re-run") from None
    save_facts("artifact-tree", sha256, {"commit": commit, "tree": cg.tree_of(commit), "file": path.name})
    cg.update_ref(ref, commit, message="sglpatch: tree cache")
    crashpoint("treecache:pack")
    # packed without deltas, a lend sends the objects as stored instead of compressing each one
    # again (measured: an sdist's tree 0.6 -> 0.2 CPU-s a lend, a wheel's 4.4 -> 1.9); zlib's
    # fastest level, as a lend's pack has (0.5.23's tree: 4.2 -> 2.1 CPU-s, 37 -> 41 MB); best
    # effort: loose objects serve as well, only slower, and the next unpack packs them
    cg.run("-c", "pack.compression=1", "repack", "-d", "-q", "--window=0", check=False)
    say(f"cached the tree of {path.name} in {time.monotonic() - t0:.1f}s")
    return commit


def heal(e: GitError) -> bool:
    """When e names objects of the cache repository that git cannot read (a cut or damaged
    file), remove them and the cached trees that hold them (unpacked again on the next use).
    Whether anything was removed."""
    cg = cache_repo()
    objects = cg.workdir / "objects"
    bad = []
    for oid in dict.fromkeys(re.findall(r"\b[0-9a-f]{40}\b", str(e))):
        f = objects / oid[:2] / oid[2:]
        if f.is_file() and cg.run("cat-file", "-p", oid, check=False)[0] != 0:
            bad.append((oid, f))
    if not bad:
        return _heal_packs(cg)
    refs = cg.run("for-each-ref", "--format=%(refname)", TREE_REF).split()
    for oid, f in bad:
        f.unlink()
        dropped = _drop_trees(cg, refs, oid)
        say(f"the tree cache {cg.workdir} had a damaged object {oid} (a cut file): removed it and the {dropped} "
            "cached tree(s) holding it; unpacking them again")
    return True


def _heal_packs(cg: Git) -> bool:
    """A pack of the cache that git cannot read in full (cut, overwritten) is removed, with the
    cached trees that cannot be read without it. Whether any was."""
    packs = cg.workdir / "objects" / "pack"
    bad = [idx for idx in sorted(packs.glob("pack-*.idx")) if cg.run("verify-pack", str(idx), check=False)[0] != 0]
    for idx in bad:
        for f in packs.glob(f"{idx.stem}.*"):
            f.unlink()
    if not bad:
        return False
    dropped = _drop_trees(cg, cg.run("for-each-ref", "--format=%(refname)", TREE_REF).split())
    names = ", ".join(idx.stem for idx in bad)
    say(f"the tree cache {cg.workdir} had a damaged pack {names}: removed it and the {dropped} cached tree(s) "
        "it held; unpacking them again")
    return True


def _drop_trees(cg: Git, refs: list[str], oid: str | None = None) -> int:
    """Remove the cached trees among refs that hold oid, or (no oid) that git can no longer read
    in full; how many."""
    dropped = [r for r in refs if _holds(cg, r, oid)]
    for r in dropped:
        cg.run("update-ref", "-d", r)
    return len(dropped)


def _holds(cg: Git, ref: str, oid: str | None) -> bool:
    rc, out, _ = cg.run("rev-list", "--objects", ref, check=False)
    return rc != 0 or (oid is not None and oid in out)


def healing(fn, *args, **kwargs):
    """fn(...), once more after heal() when it fails on a damaged object of the tree cache."""
    try:
        return fn(*args, **kwargs)
    except GitError as e:
        if not heal(e):
            raise
    return fn(*args, **kwargs)


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
        path = artifacts.fetch_sdist(lock, python)
    cg = cache_repo()
    commit = tree_commit(cg, lock.artifact_kind, path, lock.sdist_sha256, lock.sdist_subdir)
    rc, text, _ = cg.run("cat-file", "blob", f"{commit}:{lock.sdist_subdir}/sglang/_version.py", check=False, strip=False)
    recorded = artifacts.version_py_commit(text) if rc == 0 else ""
    if recorded and lock.commit != UNKNOWN_COMMIT and not commits_match(recorded, lock.commit):
        raise LockError(
            f"upstream.lock: field upstream.commit ({lock.commit}) does not match the {lock.artifact_kind}'s _version.py commit ({recorded})"
        )
    borrow(git, cg)
    return commit


# the cache's side of a fetch into a workdir: no delta search, light compression (the objects
# are loose in the cache; a tree is a few thousand files)
UPLOAD_PACK = "git -c pack.window=0 -c pack.compression=1 upload-pack"


def lend(git: Git, kind: str, path: Path, sha256: str, subdir: str, tree: str) -> bool:
    """Put the tree of the verified artifact at path into git's objects from the cache (unpacked
    into it first when missing), when the cached tree is `tree`, the id worked out from the
    artifact itself (sglpatch.upstream.unpack). git fetch checks each object it receives against its id,
    so nothing but that tree's files can come in, whatever the cache holds. Whether it did;
    False (one line when the cache was there but unusable): the caller extracts the artifact."""
    try:
        cg = cache_repo()
        commit = healing(tree_commit, cg, kind, path, sha256, subdir)
    except (SglpatchError, GitError, OSError):
        return False  # no usable cache (read-only, full, damaged beyond healing): costs speed only
    if cg.tree_of(commit) != tree:
        say(f"the tree cache's tree of {path.name} is not the one the file makes; extracting it instead")
        return False
    say(f"taking the tree of {path.name} from the tree cache")
    rc, _, err = git.run("fetch", "-q", "--no-tags", "--no-write-fetch-head", f"--upload-pack={UPLOAD_PACK}",
                         "--end-of-options", str(cg.workdir), commit, check=False)
    if rc != 0 or git.run("cat-file", "-t", tree, check=False)[1].strip() != "tree":
        say(f"could not fetch the tree of {path.name} from the tree cache ({last_line(err, f'exit {rc}')}); extracting it instead")
        try:  # a damaged object or pack is removed, so that the next run unpacks it again
            heal(GitError(err))
        except (SglpatchError, OSError):
            pass
        return False
    return True


def release_tree(cg: Git, name: str, version: str, kind: str, subdir: str = "python",
                 expect_sha256: str | None = None) -> tuple[pkgindex.Artifact, str, dict]:
    """(artifact, cached tree commit, metadata) of a release, for the watch. Warm, nothing is
    read from the artifact: its tree and metadata are the ones cached under the sha256 the
    index publishes now (they were made from a file verified against it). Otherwise the
    artifact is fetched and verified (artifacts.fetch), unpacked and its metadata kept.
    metadata: requires_dist, requires_python, commit (what _version.py records, or '')."""
    art = pkgindex.choose(name, version, kind)
    if art is None or not re.fullmatch(r"[0-9a-f]{64}", art.sha256) or (expect_sha256 and expect_sha256 != art.sha256):
        art, path = artifacts.fetch(name, version, kind, expect_sha256=expect_sha256)  # raises the one-line error
    commit = cached(cg, art.sha256, art.filename)
    meta = load_facts("artifact", art.sha256)
    if commit and isinstance(meta.get("requires_dist"), list) and isinstance(meta.get("requires_python"), str) \
            and isinstance(meta.get("commit"), str):
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
    return cache_dir() / "trees.git" / "facts" / kind / f"{oid}.json"


def load_facts(kind: str, oid: str) -> dict:
    """The facts kept, or {} (worked out again) when the file is missing, not a regular file (a
    link to /dev/zero would be read forever), not JSON or not a JSON object (a damaged one)."""
    try:
        with open_regular(_facts_path(kind, oid)) as f:
            data = json.loads(f.read())
    except (OSError, ValueError, SglpatchError):
        return {}
    return data if isinstance(data, dict) else {}


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
