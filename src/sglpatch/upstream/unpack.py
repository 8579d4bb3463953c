"""A registry sdist or wheel as a git tree: extracted into a folder (what ``git add`` then commits),
or the id of that tree worked out from the file alone, writing nothing.

Both read the tarball's members the same way (one top-level folder; no links and nothing leaving
it, refused; PKG-INFO and the top ``*.egg-info/`` left out, as build artifacts), so the id is the
id of the tree an extraction commits; a wheel's, its sglang/ files as ``artifacts.extract_wheel``
writes them. A tree of that id is this artifact's tree, wherever it comes from: git checks every
object it receives against its id. The tree cache (sglpatch.upstream.treecache) serves it to
workdirs that way instead of extracting the artifact again.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import Git
from sglpatch.upstream.artifacts import wheel_members
from sglpatch.workdir import scratch_dir

VERSION_COMMIT_RE = re.compile(r"commit_id\s*=\s*['\"]g?([0-9a-f]+)['\"]")
VERSION_PY = "sglang/_version.py"


def commits_match(a: str, b: str) -> bool:
    """Whether two commit ids (either may be abbreviated) name the same commit."""
    return bool(a) and bool(b) and (a.startswith(b) or b.startswith(a))


def version_commit(text: str) -> str:
    """The commit id an sdist's sglang/_version.py records ('' when none)."""
    m = VERSION_COMMIT_RE.search(text)
    return m.group(1) if m else ""


# a tarball decompressed to at most this many bytes is read from memory: listing its members and
# then reading them would otherwise decompress a .tar.gz twice (an sdist: 0.47 -> 0.3 CPU-s)
IN_MEMORY = 512 << 20


def _open(tarball: Path) -> tarfile.TarFile:
    """tarball (a .tar.gz) as a TarFile: from memory when it decompresses to IN_MEMORY or less,
    else read from the file (no bigger allocation for a hostile archive)."""
    with gzip.open(tarball, "rb") as f:
        data = f.read(IN_MEMORY + 1)
    if len(data) > IN_MEMORY:
        return tarfile.open(tarball, "r:gz")
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:")


def _members(tf: tarfile.TarFile, tarball: Path) -> list[tuple[tarfile.TarInfo, str]]:
    """(member, path under the top folder) of the folders and regular files to extract."""
    members = tf.getmembers()
    tops = {m.name.split("/", 1)[0] for m in members}
    if len(tops) != 1:
        raise SglpatchError(f"{tarball.name}: expected one top-level folder, found {sorted(tops)[:3]}")
    out = []
    for m in members:
        rel = m.name.split("/", 1)[1] if "/" in m.name else ""
        if not rel:
            continue
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts:
            raise SglpatchError(f"{tarball.name}: member {m.name!r} leaves the tree")
        if m.issym() or m.islnk():
            raise SglpatchError(f"{tarball.name}: member {m.name!r} is a link; refusing")
        if not (m.isfile() or m.isdir()):
            continue
        if rel == "PKG-INFO" or parts[0].endswith(".egg-info"):
            continue  # sdist build artifacts, not repository files (a build rewrites them)
        out.append((m, rel))
    return out


def safe_extract(tarball: Path, dest: Path) -> str:
    """Extract tarball's single top folder's content into dest; return the sdist's commit id."""
    with _open(tarball) as tf:
        for m, rel in _members(tf, tarball):
            out = dest / rel
            if m.isdir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tf.extractfile(m)
            with open(out, "wb") as f:
                shutil.copyfileobj(src, f)
            os.chmod(out, 0o755 if m.mode & 0o111 else 0o644)
    version_py = dest / VERSION_PY
    return version_commit(version_py.read_text()) if version_py.exists() else ""


def _object_id(kind: bytes, data: bytes) -> bytes:
    return hashlib.sha1(b"%s %d\0" % (kind, len(data)) + data).digest()


class _Tree:
    """A git tree built in memory from (path, executable, bytes), as `git add -A -f` of those files
    extracted would record it. broken: a shape the model does not cover (the caller extracts)."""

    def __init__(self) -> None:
        self.root: dict = {}
        self.broken = False

    def folder(self, parts: list[str]) -> dict | None:
        if any(p in ("", ".", ".git") for p in parts):
            self.broken = True
            return None
        node = self.root
        for p in parts:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                self.broken = True
                return None
        return node

    def file(self, parts: list[str], executable: bool, data: bytes) -> None:
        node = self.folder(parts[:-1])
        if node is None or parts[-1] in ("", ".", ".git") or isinstance(node.get(parts[-1]), dict):
            self.broken = True
            return
        node[parts[-1]] = (b"100755" if executable else b"100644", _object_id(b"blob", data))

    def id(self) -> str | None:
        def tree(node: dict) -> bytes | None:  # entries sorted as bytes, a folder as "name/"
            entries = []
            for name, v in node.items():
                raw = os.fsencode(name)
                if isinstance(v, dict):
                    sub = tree(v)
                    if sub is not None:  # git keeps no empty folder
                        entries.append((raw + b"/", b"40000 " + raw + b"\0" + sub))
                else:
                    entries.append((raw, v[0] + b" " + raw + b"\0" + v[1]))
            return _object_id(b"tree", b"".join(e for _, e in sorted(entries))) if entries else None

        top = None if self.broken else tree(self.root)
        return top.hex() if top else None


def sdist_tree(tarball: Path, subdir: str) -> tuple[str | None, str]:
    """(id of the tree an extraction under subdir/ commits, the sdist's commit id), reading the
    tarball only. Refuses what safe_extract refuses. The id is None for a tarball whose tree this
    model does not cover (a name git treats specially, a file and a folder of one name): the
    caller extracts it instead."""
    t = _Tree()
    commit = ""
    with _open(tarball) as tf:
        for m, rel in _members(tf, tarball):
            parts = [subdir, *rel.split("/")]
            if m.isdir():
                t.folder(parts)
                continue
            data = tf.extractfile(m).read()
            if rel == VERSION_PY:
                commit = version_commit(data.decode("utf-8", "replace"))
            t.file(parts, bool(m.mode & 0o111), data)
    return t.id(), commit


def wheel_tree(wheel: Path, subdir: str) -> str | None:
    """The id of the tree an extraction of the wheel's sglang/ under subdir/ commits, reading the
    wheel only (refusing what extract_wheel refuses); None for a shape the model does not cover."""
    t = _Tree()
    with zipfile.ZipFile(wheel) as zf:
        for info, executable in wheel_members(zf, wheel):
            t.file([subdir, *info.filename.split("/")], executable, zf.read(info))
    return t.id()


def commit_tree(git: Git, tree_root: Path, message: str) -> str:
    """The folder tree_root as a parentless commit with fixed identity and dates."""
    with git.temp_index(scratch=scratch_dir(git)) as (env, _):
        git.run("--work-tree", str(tree_root), "add", "-A", "-f", ".", env=env)
        tree = git.run("write-tree", env=env)
    return git.commit_tree(tree, message)
