"""The tool's cache: a poisoned or damaged tree cache, a repack killed half way, a facts file of the
wrong shape, an entry linked to /dev/zero.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SDIST_0510_SHA256, git, loosen
from sglpatch.upstream import treecache
from failure_modes.world import Case, P2_FILE, TOOL_SRC
from failure_modes.faults import T, no_timing, private_cache, rebase_args


@pytest.mark.parametrize("how", ["dry-run", "watch"])
def test_poisoned_tree_cache_is_unpacked_again(tmp_path, rb_golden, how):
    """refs/sglpatch/trees/<sha256 of 0.5.10.post1> pointed at the 0.5.9 tree (a shared CI cache):
    the tree is unpacked again, with one line, and the answer is the honest one."""
    c = Case(tmp_path, rb_golden)
    cache = private_cache(c)
    env = {"SGLPATCH_CACHE": str(cache)}
    if how == "dry-run":
        cmd = rebase_args(c, "--dry-run", "--onto", T, "--source", "sdist")
    else:
        cmd = ("watch", "--project", str(c.project), "--releases", T)
    honest = c.run(*cmd, env=env)
    assert honest.returncode in (0, 2), honest.stdout + honest.stderr
    cg = cache / "trees.git"
    ref = f"refs/sglpatch/trees/{SDIST_0510_SHA256}"
    tree = git(cg, "rev-parse", f"{ref}^{{tree}}")
    git(cg, "fetch", "-q", str(c.fork), "refs/heads/upstream:refs/poison")  # the 0.5.9 tree, as a commit
    git(cg, "update-ref", ref, "refs/poison")
    again = c.run(*cmd, env=env)
    assert again.returncode == honest.returncode, again.stdout + again.stderr
    assert no_timing(again.stdout) == no_timing(honest.stdout)
    lines = [line for line in again.stderr.splitlines() if "tree cache" in line and "again" in line]
    assert len(lines) == 1 and f"sglang-{T}.tar.gz" in lines[0], again.stderr
    assert git(cg, "rev-parse", f"{ref}^{{tree}}") == tree
    c.outside_clean()


@pytest.mark.parametrize("where", ["loose", "pack"])
def test_damaged_object_in_the_tree_cache_is_healed(tmp_path, rb_golden, where):
    """A cached tree's object cut in half, loose or in its pack: the damaged object (or pack) and
    the trees holding it are dropped and unpacked again (one line), the answer is the same."""
    c = Case(tmp_path, rb_golden)
    cache = private_cache(c)
    env = {"SGLPATCH_CACHE": str(cache)}
    cmd = rebase_args(c, "--dry-run", "--onto", T, "--source", "sdist")
    honest = c.run(*cmd, env=env)
    assert honest.returncode in (0, 2), honest.stdout + honest.stderr
    cg = cache / "trees.git"
    packs = sorted((cg / "objects" / "pack").glob("pack-*.pack"))
    assert packs and git(cg, "count-objects").startswith("0 objects"), packs  # the unpack packed its objects
    blob = git(cg, "rev-parse", f"refs/sglpatch/trees/{SDIST_0510_SHA256}:{P2_FILE}")  # a file patch 2 changes
    if where == "loose":
        loosen(cg)
        target, needle = cg / "objects" / blob[:2] / blob[2:], blob
    else:
        idx = {p: subprocess.run(["git", "show-index"], input=p.with_suffix(".idx").read_bytes(), capture_output=True,
                                 check=True).stdout.decode() for p in packs}
        target = next(p for p in packs if f" {blob} " in idx[p])
        needle = target.stem
    data = target.read_bytes()
    target.chmod(0o644)
    target.write_bytes(data[: len(data) // 2])
    again = c.run(*cmd, env=env)
    assert again.returncode == honest.returncode, again.stdout + again.stderr
    assert no_timing(again.stdout) == no_timing(honest.stdout)
    assert "Traceback" not in again.stderr
    assert [line for line in again.stderr.splitlines() if "damaged" in line and needle in line], again.stderr
    assert git(cg, "cat-file", "-t", blob) == "blob" and len(git(cg, "cat-file", "-p", blob)) > 0
    assert subprocess.run(["git", "fsck", "--no-dangling"], cwd=cg, capture_output=True).returncode == 0
    c.outside_clean()


def test_a_repack_killed_in_the_tree_cache_leaves_no_tmp_pack_for_ever(tmp_path, monkeypatch):
    """A real `git repack -d --window=0` of the cache (as tree_commit runs it), its process group
    SIGKILLed while it writes its pack, leaves tmp_pack_*. The next use of the cache removes such a
    file once it is older than a live repack's (an hour); a young one, which a repack running now may
    be writing, stays."""
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    cg = treecache.cache_repo()
    files = tmp_path / "files"
    files.mkdir()
    for i in range(1500):
        (files / f"f{i}").write_bytes(os.urandom(16384))
    genv = dict(os.environ, GIT_DIR=str(cg.workdir), GIT_WORK_TREE=str(files), GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    subprocess.run(["git", "add", "-A"], env=genv, check=True)
    tree = subprocess.run(["git", "write-tree"], env=genv, check=True, capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit-tree", "-m", "t", tree], env=genv, check=True,
                            capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "update-ref", f"{treecache.TREE_REF}/t", commit], env=genv, check=True)
    pack = cg.workdir / "objects" / "pack"
    r = subprocess.Popen(["git", "repack", "-d", "-q", "--window=0"], cwd=cg.workdir, start_new_session=True)
    deadline = time.monotonic() + 60
    while r.poll() is None and not list(pack.glob("tmp_pack_*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.killpg(r.pid, signal.SIGKILL)
    r.wait()
    left = list(pack.glob("tmp_pack_*"))
    assert left, "the repack finished before it could be killed"
    young = pack / "tmp_pack_young"
    young.write_bytes(b"a live repack's")
    old = time.time() - 2 * 3600
    for p in left:
        os.utime(p, (old, old))
    treecache.cache_repo()
    assert [p.name for p in pack.glob("tmp_pack_*")] == ["tmp_pack_young"]


def test_a_facts_file_of_the_wrong_shape_is_worked_out_again(tmp_path, monkeypatch):
    from sglpatch.upstream import treecache

    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    sha = "a" * 64
    f = treecache._facts_path("artifact-tree", sha)
    f.parent.mkdir(parents=True)
    for text in ("[1, 2]", '"commit"', "null"):
        f.write_text(text)
        assert treecache.load_facts("artifact-tree", sha) == {}  # was the list: rec.get() raised AttributeError
    f.write_text('{"commit": "c"}')
    assert treecache.load_facts("artifact-tree", sha) == {"commit": "c"}


LIMITED = "import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"


@pytest.mark.parametrize("what", ["artifact", "facts"])
def test_a_cache_entry_linked_to_dev_zero_is_one_line_not_a_hang(tmp_path, what):
    """A cached artifact linked to /dev/zero was hashed forever (the watch hung); a facts file so
    linked was read into memory. Now: one line for the artifact, the facts worked out again."""
    cache = tmp_path / "cache"
    link = cache / "sdist" / "sglang-0.5.9.tar.gz" if what == "artifact" else cache / "trees.git" / "facts" / "artifact" / f"{'b' * 64}.json"
    link.parent.mkdir(parents=True)
    link.symlink_to("/dev/zero")
    code = LIMITED + ("from sglpatch.upstream.pin import sha256_file\nprint(sha256_file(sys.argv[1]))\n" if what == "artifact" else
                      "from sglpatch.upstream import treecache\nprint(treecache.load_facts('artifact', 'b' * 64))\n")
    env = dict(os.environ, PYTHONPATH=TOOL_SRC, SGLPATCH_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-c", code, str(link)], capture_output=True, text=True, env=env, timeout=20)
    if what == "facts":
        assert r.returncode == 0 and r.stdout == "{}\n", r.stderr[-300:]
    else:
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
            f"sglpatch.errors.SglpatchError: {link} is a symbolic link (to /dev/zero), not a file: refusing to read it; "
            "delete it and re-run")
