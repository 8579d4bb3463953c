"""Nothing read or written through a symbolic link: a series entry through a linked folder, a linked
resolutions folder, the workdir lock, scratch and state as links, a series that is a link.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import shutil

import pytest

from conftest import git
from failure_modes import world as fm
from failure_modes.world import Case, DEV, GATE, P2_FILE, _exact, _heads, _rebase, ok, patch_names, refused, snapshot
from failure_modes.faults import T


@pytest.mark.inproc
def test_series_entry_through_a_symlinked_folder(case):
    """patches/sub is a link to a folder outside: its patch is neither read nor rewritten nor deleted."""
    c = case
    names = patch_names(c)
    outside = c.sentinel / "elsewhere"
    outside.mkdir()
    shutil.move(c.project / "patches" / names[1], outside / names[1])
    (c.project / "patches" / "sub").symlink_to(outside)
    (c.project / "series").write_text((c.project / "series").read_text().replace(names[1], f"sub/{names[1]}"))
    planted = snapshot(c.sentinel)
    f = c.fork / P2_FILE  # changed work on patch 2: an export would rewrite its file
    f.write_text(f.read_text() + "# changed\n")
    git(c.fork, *DEV, "commit", "-qa", "--amend", "--no-edit")
    refused(c.export(), f"patches/sub/{names[1]}", "outside")
    refused(c.apply("--force"), f"patches/sub/{names[1]}", "outside")
    assert snapshot(c.sentinel) == planted
    (c.project / "patches" / "sub").unlink()  # the fix: a real folder
    shutil.move(outside, c.project / "patches" / "sub")
    ok(c.export())
    assert b"# changed" in (c.project / "patches" / "sub" / names[1]).read_bytes()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("when", ["before-the-rebase", "during-the-stop"])
def test_resolutions_folder_linked_outside(tmp_path, rb_conflict, when):
    """resolutions/<version> is a link to a folder outside: refused before anything is moved."""
    c = Case(tmp_path, rb_conflict)
    res = c.project / "resolutions" / T
    outside = c.sentinel / "res"

    def link():
        shutil.move(res, outside)
        res.symlink_to(outside)

    before_wd = _exact(c.fork)
    if when == "before-the-rebase":
        link()
        planted = snapshot(c.sentinel)
        refused(_rebase(c), f"resolutions/{T}", "outside")
        assert _exact(c.fork) == before_wd
    else:
        assert _rebase(c).returncode == 3
        link()
        planted = snapshot(c.sentinel)
        git(c.fork, "checkout", "--ours", "--", GATE)  # resolved by hand: keep the new upstream's gate
        heads = _heads(c.fork)
        refused(_rebase(c, "--continue"), f"resolutions/{T}", "outside")
        assert _heads(c.fork) == heads  # nothing moved
    assert snapshot(c.sentinel) == planted
    res.unlink()
    shutil.move(outside, res)
    if when == "during-the-stop":
        ok(_rebase(c, "--continue"))
        assert "[patch." in (res / "resolutions.toml").read_text()  # recorded in the real folder
    else:
        assert _rebase(c).returncode == 3
        ok(_rebase(c, "--abort"))
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("name", ["sglpatch.lock", "sglpatch-tmp", "sglpatch-rebase"])
def test_workdir_lock_scratch_and_state_links_are_refused(tmp_path, rb_golden, name):
    """DIR/.git/NAME is a link to something outside: the lock file is not truncated through it,
    no scratch file and no rebase state goes through it (the rebase would be killed mid-extraction)."""
    c = Case(tmp_path, rb_golden)
    victim = c.sentinel / "victim"
    if name == "sglpatch.lock":
        victim.write_text("precious\n")
    else:
        victim.mkdir()
        (victim / "precious").write_text("precious\n")
    link = c.fork / ".git" / name
    link.unlink(missing_ok=True)  # the lock file of the earlier apply
    link.symlink_to(victim)
    planted = snapshot(c.sentinel)
    before_wd = _exact(c.fork)
    refused(_rebase(c, env={"SGLPATCH_CRASH_AT": "materialize:extract"}), f"{link}", "symbolic link")
    assert snapshot(c.sentinel) == planted
    assert _exact(c.fork) == before_wd
    link.unlink()
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


@pytest.mark.inproc
def test_a_series_that_is_a_symbolic_link_is_refused_not_read_through(case):
    outside = case.sentinel / "series"
    outside.write_bytes((case.project / "series").read_bytes())
    (case.project / "series").unlink()
    (case.project / "series").symlink_to(outside)
    before = case.state()
    for proc in (case.apply(), case.export()):
        fm.refused(proc, f"{case.project / 'series'} is a symbolic link (to {outside}); the series must be a regular file "
                   "in the project, as the patch files are: replace the link by the file")
    assert (case.project / "series").is_symlink() and case.state() == before  # export did not replace it by a file
    (case.project / "series").unlink()
    outside.rename(case.project / "series")
    fm.ok(case.apply())
