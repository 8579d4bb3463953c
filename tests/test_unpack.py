"""An sdist's tree id worked out from the tarball (sglpatch.upstream.unpack) and the workdir fetching that
tree from the tree cache instead of extracting the sdist (sglpatch.upstream.treecache.lend), on the real
0.5.9 and 0.5.10.post1 sdists (and the 0.5.23 line's wheel) with real git: the same commit as an extraction, and a cache that
lies (another tree bound to the sdist, an object whose content is not its id) changes nothing."""

from __future__ import annotations

import io
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest

from conftest import ROOT, cache_lock, git, lock_0510, loosen
from sglpatch.upstream import artifacts, treecache, unpack
from sglpatch.upstream import materialize as up
from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import Git
from sglpatch.upstream.pin import read_lock

P2_FILE = "python/sglang/srt/distributed/device_communicators/custom_all_reduce.py"


def extracted(tarball: Path, tmp: Path) -> tuple[str, str]:
    """(tree id, recorded commit) of the sdist extracted and committed the way apply did always."""
    repo = Git(tmp / "repo")
    repo.workdir.mkdir()
    repo.run("init", "-q")
    commit = unpack.safe_extract(tarball, tmp / "tree" / "python")
    return repo.tree_of(unpack.commit_tree(repo, tmp / "tree", "x\n")), commit


@pytest.mark.parametrize("which", ["0.5.9", "0.5.10.post1"])
def test_sdist_tree_is_the_tree_an_extraction_commits(which, sdist_059, sdist_0510, tmp_path):
    tarball = sdist_059 if which == "0.5.9" else sdist_0510
    tree, commit = unpack.sdist_tree(tarball, "python")
    assert (tree, commit) == extracted(tarball, tmp_path)
    assert (commit == read_lock(ROOT).commit[: len(commit)]) if which == "0.5.9" else commit == ""


def tarball(tmp: Path, members: list) -> Path:
    """A .tar.gz of (name, bytes or 'dir' or ('sym', target), mode)."""
    path = tmp / "t.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if data == "dir":
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif isinstance(data, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, data[1]
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def test_modes_empty_folders_duplicates_and_left_out_files_as_git_commits_them(tmp_path):
    t = tarball(tmp_path, [
        ("s-1/run.sh", b"#!/bin/sh\n", 0o750), ("s-1/a.py", b"x\n", 0o600), ("s-1/empty", "dir", 0o755),
        ("s-1/deep/er/est", "dir", 0o755), ("s-1/PKG-INFO", b"v\n", 0o644), ("s-1/s.egg-info/SOURCES.txt", b"a\n", 0o644),
        ("s-1/a.py", b"the later one wins\n", 0o644), ("s-1/a-b", b"sorts before a/\n", 0o644), ("s-1/a/x", b"x", 0o644),
        ("s-1/sglang/_version.py", b"commit_id = 'gabc1234'\n", 0o644),
    ])
    tree, commit = unpack.sdist_tree(t, "python")
    assert (tree, commit) == extracted(t, tmp_path) and commit == "abc1234"
    listing = git(tmp_path / "repo", "ls-tree", "-r", tree)
    assert "100755 blob" in next(line for line in listing.splitlines() if line.endswith("python/run.sh"))
    assert "PKG-INFO" not in listing and "egg-info" not in listing and "empty" not in listing


@pytest.mark.parametrize("member, why", [
    (("s-1/../evil", b"x", 0o644), "leaves the tree"),
    (("s-1/sglang/evil", ("sym", "/etc"), 0o777), "is a link; refusing"),
    (("t-1/other", b"x", 0o644), "expected one top-level folder"),
])
def test_the_tree_id_refuses_what_extraction_refuses(tmp_path, member, why):
    t = tarball(tmp_path, [("s-1/sglang/__init__.py", b"", 0o644), member])
    for fn in (lambda: unpack.sdist_tree(t, "python"), lambda: unpack.safe_extract(t, tmp_path / "x")):
        with pytest.raises(SglpatchError, match=why):
            fn()


@pytest.mark.parametrize("members", [
    [("s-1/a", b"a file", 0o644), ("s-1/a/b", b"and a folder of that name", 0o644)],
    [("s-1/a", "dir", 0o755), ("s-1/a", b"a folder, then a file of that name", 0o644)],
    [("s-1/x/.git/config", b"a name git does not take", 0o644)],
])
def test_trees_the_model_does_not_cover_have_no_id(tmp_path, members):
    """...but the commit _version.py records, which upstream.lock is checked against, all the same."""
    version = ("s-1/sglang/_version.py", b"commit_id = 'gabc1234'\n", 0o644)
    assert unpack.sdist_tree(tarball(tmp_path, [version, *members]), "python") == (None, "abc1234")


# --------------------------------------------------------------------------------------
# a workdir takes the tree from the cache


def build(tmp: Path, lock) -> tuple[Git, str]:
    repo = Git(tmp)
    tmp.mkdir()
    repo.run("init", "-q")
    return repo, up.build_registry(repo, lock)


def loose_and_packed(repo: Git) -> tuple[int, int]:
    stats = dict(line.split(": ") for line in repo.run("count-objects", "-v").splitlines())
    return int(stats["count"]), int(stats["in-pack"])


def test_the_workdir_fetches_the_tree_once_the_cache_holds_it(tmp_path, monkeypatch, sdist_059, sdist_0510, capfd):
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "sdist").mkdir(parents=True)
    for f in (sdist_059, sdist_0510):
        (tmp_path / "cache" / "sdist" / f.name).write_bytes(f.read_bytes())
    for lock in (read_lock(ROOT), lock_0510()):
        capfd.readouterr()
        repo, commit = build(tmp_path / f"w-{lock.version}", lock)
        err = capfd.readouterr().err
        assert f"unpacking {lock.sdist_filename} into the tree cache (once)" in err
        assert f"taking the tree of {lock.sdist_filename} from the tree cache" in err and "extracting" not in err
        repo2, commit2 = build(tmp_path / f"w2-{lock.version}", lock)
        err = capfd.readouterr().err
        assert "unpacking" not in err and f"taking the tree of {lock.sdist_filename} from the tree cache" in err
        assert loose_and_packed(repo2)[0] == 1  # the commit; the tree's files came in one pack
        monkeypatch.setattr(treecache, "lend", lambda *a: False)
        repo3, commit3 = build(tmp_path / f"w3-{lock.version}", lock)
        monkeypatch.undo()
        monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
        assert f"extracting {lock.sdist_filename} under python/" in capfd.readouterr().err
        assert commit == commit2 == commit3  # the commit an extraction makes
        assert repo2.tree_of(commit2) == unpack.sdist_tree(tmp_path / "cache" / "sdist" / lock.sdist_filename, "python")[0]
        assert repo2.run("fsck", "--no-dangling", "--connectivity-only") == ""


def poisoned_cache(tmp_path: Path, monkeypatch, sdist_059) -> tuple[Git, str, str]:
    """A private cache holding the 0.5.9 tree; (cache repo, cached commit, honest commit)."""
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "sdist").mkdir(parents=True)
    (tmp_path / "cache" / "sdist" / sdist_059.name).write_bytes(sdist_059.read_bytes())
    _, honest = build(tmp_path / "honest", read_lock(ROOT))
    cg = treecache.cache_repo()
    loosen(cg.workdir)  # loose objects, as an earlier sglpatch left them: a file per object to poison
    return cg, cg.rev(f"{treecache.TREE_REF}/{read_lock(ROOT).sdist_sha256}"), honest


def test_a_cache_bound_to_another_tree_is_not_taken(tmp_path, monkeypatch, sdist_059, capfd):
    """The ref, its message and the recorded facts all agree on a tree with one file changed (a
    poisoned shared cache): the workdir gets the sdist's own tree, with one line."""
    cg, cached, honest = poisoned_cache(tmp_path, monkeypatch, sdist_059)
    sha = read_lock(ROOT).sdist_sha256
    with cg.temp_index(base=cached) as (env, _):
        blob = cg.run("hash-object", "-w", "--stdin", input="import os; os.system('pwn')\n")
        cg.run("update-index", "--cacheinfo", f"100644,{blob},{P2_FILE}", env=env)
        evil_tree = cg.run("write-tree", env=env)
    evil = cg.commit_tree(evil_tree, cg.run("log", "-1", "--format=%B", cached) + "\n")
    cg.update_ref(f"{treecache.TREE_REF}/{sha}", evil)
    treecache.save_facts("artifact-tree", sha, {"commit": evil, "tree": evil_tree, "file": sdist_059.name})
    assert treecache.cached(cg, sha, sdist_059.name) == evil  # the cache's own checks pass
    capfd.readouterr()
    repo, commit = build(tmp_path / "w", read_lock(ROOT))
    err = capfd.readouterr().err
    assert commit == honest and "pwn" not in repo.run("show", f"{commit}:{P2_FILE}")
    assert [line for line in err.splitlines() if "tree cache" in line] == [
        f"sglpatch: the tree cache's tree of {sdist_059.name} is not the one the file makes; extracting it instead"
    ]


def test_a_cached_object_whose_content_is_not_its_id_never_reaches_the_workdir(tmp_path, monkeypatch, sdist_059, capfd):
    """A loose blob of the cached tree rewritten with other, well-formed content under the same
    name: git fetch refuses it (the id is checked), the workdir extracts the sdist, one line."""
    cg, cached, honest = poisoned_cache(tmp_path, monkeypatch, sdist_059)
    blob = cg.run("rev-parse", f"{cached}:{P2_FILE}")
    obj = cg.workdir / "objects" / blob[:2] / blob[2:]
    lie = b"import os; os.system('pwn')\n"
    obj.chmod(0o644)
    obj.write_bytes(zlib.compress(b"blob %d\0" % len(lie) + lie))
    assert cg.run("cat-file", "-p", blob) == lie.decode().strip()  # git reads the lie without complaint
    capfd.readouterr()
    repo, commit = build(tmp_path / "w", read_lock(ROOT))
    err = capfd.readouterr().err
    assert commit == honest and "pwn" not in repo.run("show", f"{commit}:{P2_FILE}")
    lines = [line for line in err.splitlines() if "tree cache" in line]
    assert len(lines) == 2 and lines[0].endswith(f"taking the tree of {sdist_059.name} from the tree cache"), err
    assert lines[1].startswith(f"sglpatch: could not fetch the tree of {sdist_059.name} from the tree cache (")
    assert lines[1].endswith("); extracting it instead") and f"extracting {sdist_059.name} under python/" in err


def test_sdist_facts_read_from_the_head_of_the_real_sdists(sdist_059, sdist_0510):
    """recorded_commit, metadata and release_metadata read only as far as their file: still the real
    sdists' answers (0.5.9's _version.py is its 14th member, past any short cut; 0.5.10.post1
    records no commit)."""
    from sglpatch.upstream import artifacts
    from sglpatch.pythonenv import new_venv

    assert artifacts.recorded_commit(sdist_059) == read_lock(ROOT).commit == "bbe9c7eeb"
    assert artifacts.recorded_commit(sdist_0510) == ""
    assert [artifacts.metadata(p)["Version"] for p in (sdist_059, sdist_0510)] == ["0.5.9", "0.5.10.post1"]
    name, version, reqs = new_venv.release_metadata(sdist_059)
    assert (name, version) == ("sglang", "0.5.9") and any(r.startswith("torch") for r in reqs)


@pytest.mark.parametrize("cap", [64 << 20, 1 << 20])  # the real sdist under the in-memory cap, and over it
def test_the_tree_id_is_the_same_read_from_memory_or_from_the_file(sdist_059, monkeypatch, cap):
    monkeypatch.setattr(unpack, "IN_MEMORY", cap)
    assert unpack.sdist_tree(sdist_059, "python") == ("faf9cae5fbecdc275bdf060400e08ccaf0ec04d2", "bbe9c7eeb")


@pytest.mark.parametrize("damage", ["junk", "cut"])
def test_an_sdist_that_is_no_gzipped_tar_is_one_line(tmp_path, sdist_059, damage):
    from sglpatch.upstream import artifacts

    bad = tmp_path / sdist_059.name
    data = sdist_059.read_bytes()
    bad.write_bytes(b"not a tarball\n" * 100 if damage == "junk" else data[: len(data) // 2])
    with pytest.raises(artifacts.ArtifactError, match=r"not a readable sdist \(gzip'd tar file\)"):
        with artifacts.readable(bad):
            unpack.sdist_tree(bad, "python")


# --------------------------------------------------------------------------------------
# a wheel (the 0.5.23 line's upstream): the same, its sglang/ files as extract_wheel writes them

LINE_0523 = read_lock(ROOT / "lines" / "0.5.23")


def wheel_0523() -> Path:
    with cache_lock():
        return artifacts.fetch(LINE_0523.name, LINE_0523.version, "wheel", expect_sha256=LINE_0523.sdist_sha256)[1]


def wheel(tmp: Path, members: list) -> Path:
    """A zip of (name, bytes, mode) members, a wheel's dist-info and a file beside sglang/."""
    path = tmp / "sglang-1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data, mode in [*members, ("sglang-1.dist-info/RECORD", b"r\n", 0o644), ("other.py", b"o\n", 0o644)]:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


def wheel_extracted(whl: Path, tmp: Path) -> str:
    repo = Git(tmp / "repo")
    repo.workdir.mkdir()
    repo.run("init", "-q")
    artifacts.extract_wheel(whl, tmp / "tree" / "python")
    return repo.tree_of(unpack.commit_tree(repo, tmp / "tree", "x\n"))


def test_wheel_modes_duplicates_and_left_out_files_as_git_commits_them(tmp_path, recwarn):
    whl = wheel(tmp_path, [("sglang/run.sh", b"#!/bin/sh\n", 0o100750), ("sglang/a.py", b"x\n", 0o100600),
                           ("sglang/sub/", b"", 0o40755), ("sglang/a.py", b"the later one wins\n", 0o100644),
                           ("sglang/a-b", b"sorts before a/\n", 0o100644), ("sglang/a/x", b"x", 0o100644)])
    tree = unpack.wheel_tree(whl, "python")
    assert tree == wheel_extracted(whl, tmp_path)
    listing = git(tmp_path / "repo", "ls-tree", "-r", tree)
    assert "100755 blob" in next(line for line in listing.splitlines() if line.endswith("python/sglang/run.sh"))
    assert "dist-info" not in listing and "other.py" not in listing and "sub" not in listing


@pytest.mark.parametrize("member, why", [
    (("sglang/../evil", b"x", 0o100644), "leaves the tree"),
    (("sglang/evil", b"/etc", 0o120777), "is a link; refusing"),
])
def test_the_wheel_tree_id_refuses_what_extraction_refuses(tmp_path, member, why):
    whl = wheel(tmp_path, [("sglang/__init__.py", b"", 0o100644), member])
    for fn in (lambda: unpack.wheel_tree(whl, "python"), lambda: artifacts.extract_wheel(whl, tmp_path / "x")):
        with pytest.raises(SglpatchError, match=why):
            fn()


def test_a_wheel_shape_the_model_does_not_cover_has_no_id(tmp_path):
    whl = wheel(tmp_path, [("sglang/a", b"a file", 0o100644), ("sglang/a/b", b"and a folder of that name", 0o100644)])
    assert unpack.wheel_tree(whl, "python") is None


def test_a_wheel_workdir_fetches_the_tree_once_the_cache_holds_it(tmp_path, monkeypatch, capfd):
    """A wheel-only release (the 0.5.23 line): unpacked into the cache, then fetched from it (a
    second apply fetches only: the sdist's test above); the same commit as an extraction, whose
    tree is the id worked out from the wheel."""
    whl = wheel_0523()
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "wheel").mkdir(parents=True)
    (tmp_path / "cache" / "wheel" / whl.name).write_bytes(whl.read_bytes())
    name = LINE_0523.sdist_filename
    capfd.readouterr()
    repo, commit = build(tmp_path / "w", LINE_0523)
    err = capfd.readouterr().err
    assert f"unpacking {name} into the tree cache (once)" in err
    assert f"taking the tree of {name} from the tree cache" in err and "extracting" not in err
    assert loose_and_packed(repo)[0] == 1  # the commit; the tree's files came in one pack
    monkeypatch.setattr(treecache, "lend", lambda *a: False)
    _, commit2 = build(tmp_path / "w2", LINE_0523)
    assert f"extracting sglang/ of {name} under python/" in capfd.readouterr().err
    assert commit == commit2 and repo.tree_of(commit) == unpack.wheel_tree(whl, "python")
    assert repo.run("fsck", "--no-dangling", "--connectivity-only") == ""
