"""The file system under the tool: a disk that fills up during export or apply (a real tmpfs, and
simulated), a read-only HOME.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import git
from failure_modes.world import Case, DEP3, DEV, P1_FILE, P2_FILE, _mount_tmpfs, _umount, ok, patch_names, refused, snapshot
from failure_modes.faults import ReadOnly, T


def _fill(path: Path) -> Path:
    filler = path / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def _grow_last_patch(c: Case) -> None:
    f = c.fork / P2_FILE
    f.write_text(f.read_text() + "".join(f"# long experiment line {i}\n" for i in range(400)))
    git(c.fork, *DEV, "commit", "-qa", "--amend", "--no-edit")


def test_disk_full_during_export_real_tmpfs(case):
    mnt = case.tmp / "project"
    saved = case.tmp / "t" / "saved"
    shutil.copytree(mnt, saved)
    shutil.rmtree(mnt)
    if not _mount_tmpfs(mnt, "256k"):
        shutil.rmtree(saved)
        pytest.skip("cannot mount a tmpfs here (the monkeypatched variant covers the case)")
    try:
        shutil.copytree(saved, mnt, dirs_exist_ok=True)
        shutil.rmtree(saved)
        _grow_last_patch(case)
        before_proj = snapshot(mnt)
        before = case.state()
        filler = _fill(mnt)
        refused(case.export(), "no space left on device", "free space and re-run")
        after = snapshot(mnt)
        after.pop(".filler")
        assert after == before_proj, "export left a partial file"
        assert case.state() == before
        filler.unlink()
        ok(case.export())
        assert b"long experiment line 399" in (mnt / "patches" / patch_names(case)[1]).read_bytes()
        assert not [p for p in mnt.rglob("*.tmp")]
        ok(case.apply())
        case.in_sync()
        kept = snapshot(mnt)
    finally:
        _umount(mnt)
    shutil.rmtree(mnt, ignore_errors=True)
    assert kept
    case.outside_clean()


def test_disk_full_during_export_simulated(case, monkeypatch, capsys):
    """In-process CLI with os.replace failing with ENOSPC on the second file: each file old or new."""
    from sglpatch import cli, fsutil

    _grow_last_patch(case)
    f = case.fork / P1_FILE
    f.write_text(f.read_text() + "# another\n")
    git(case.fork, *DEV, "commit", "-qam", f"third\n\n{DEP3}")
    before_proj = snapshot(case.project)
    calls = {"n": 0}
    real_replace = os.replace

    def replace(src, dst):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", replace)
    rc = cli.main(["export", "--project", str(case.project), "--workdir", str(case.fork)])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip().splitlines()[-1].startswith("sglpatch: error: no space left on device"), err
    now = snapshot(case.project)
    assert not [k for k in now if k.endswith(".tmp")]
    assert now["series"] == before_proj["series"]
    monkeypatch.setattr(fsutil.os, "replace", real_replace)
    assert cli.main(["export", "--project", str(case.project), "--workdir", str(case.fork)]) == 0
    assert len(patch_names(case)) == 3
    ok(case.apply())
    case.in_sync()


def test_disk_full_during_apply_real_tmpfs(fresh):
    c = fresh
    if not _mount_tmpfs(c.fork, "2m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        msg = refused(c.apply(), "No space left on device")
        assert "\n" not in msg
        subprocess.run(["mount", "-o", "remount,size=512m", str(c.fork)], check=True)
        ok(c.apply())
        c.in_sync()
        c.outside_clean()
    finally:
        _umount(c.fork)


def test_read_only_home_without_a_cache_setting(fresh):
    """No SGLPATCH_CACHE, no XDG_CACHE_HOME, and HOME read-only: one line naming SGLPATCH_CACHE."""
    c = fresh
    ro = ReadOnly(c.home, "1m")
    try:
        ro.ro()
        env = {"SGLPATCH_CACHE": "", "XDG_CACHE_HOME": ""}
        refused(c.apply(env=env), "SGLPATCH_CACHE", str(c.home))
        refused(c.run("watch", "--project", str(c.project), "--releases", T, env=env), "SGLPATCH_CACHE")
    finally:
        ro.close()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()
