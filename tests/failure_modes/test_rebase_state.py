"""A rebase's own files: recorded resolutions that are malformed or point out of the project, damaged
state that --abort checks before it moves anything, a read-only project during a real rebase.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import git
from sglpatch import exitcodes
from failure_modes import world as fm
from failure_modes.world import Case, _exact, _heads, _rebase, ok, refused, snapshot
from failure_modes.faults import KILLED, ReadOnly, T


BAD_TOML = {
    "patch-not-a-table": b'patch = "x"\n',
    "entry-not-a-table": b'[patch]\n"0001-x.patch" = 3\n',
    "not-utf8": b'[patch."0001-x.patch"]\nwhy = "caf\xe9"\n',
}


@pytest.mark.parametrize("kind", list(BAD_TOML))
def test_malformed_resolutions_toml(tmp_path, rb_golden, kind):
    """A real rebase refuses it with one line; the watch classifies the release anyway and says
    in one line that this folder's records are not used."""
    c = Case(tmp_path, rb_golden)
    f = c.project / "resolutions" / T / "resolutions.toml"
    f.write_bytes(BAD_TOML[kind])
    before_wd = _exact(c.fork)
    refused(_rebase(c), f"resolutions/{T}/resolutions.toml")
    assert _exact(c.fork) == before_wd
    for _ in ("classified", "taken from the tree cache"):  # the second run reuses the first's outcomes
        w = c.run("watch", "--project", str(c.project), "--releases", T)
        assert w.returncode == 0 and "Traceback" not in w.stderr, w.stdout + w.stderr
        assert [line for line in w.stderr.splitlines() if "resolutions.toml" in line and "not used" in line], w.stderr
        assert re.search(rf"^{re.escape(T)} ", w.stdout, re.M), w.stdout
    f.unlink()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "proc-self-mem", "symlinked-file", "symlinked-toml"])
def test_resolution_names_and_links_are_checked(tmp_path, rb_golden, kind):
    c = Case(tmp_path, rb_golden)
    d = c.project / "resolutions" / T
    leak = c.sentinel / "leak.patch"
    leak.write_bytes(b"a file outside the project\n")
    name = {"dotdot": "../../../sentinel/leak.patch", "absolute": str(leak), "proc-self-mem": "/proc/self/mem"}.get(kind, "0001-x.patch")
    toml = f'[patch."{name}"]\naction = "replace"\npatch_sha256 = "{"0" * 64}"\nwhy = "planted"\n'
    if kind == "symlinked-file":
        (d / name).symlink_to(leak)
    if kind == "symlinked-toml":
        (c.sentinel / "r.toml").write_text(toml)
        (d / "resolutions.toml").symlink_to(c.sentinel / "r.toml")
    else:
        (d / "resolutions.toml").write_text(toml)
    needle = {"dotdot": "must be a plain relative path without '..'", "absolute": "absolute paths are not allowed",
              "proc-self-mem": "absolute paths are not allowed"}.get(kind, "symbolic link")
    before_wd = _exact(c.fork)
    refused(_rebase(c), f"resolutions/{T}/", needle)
    assert _exact(c.fork) == before_wd
    for p in (d / "resolutions.toml", d / "0001-x.patch", leak, c.sentinel / "r.toml"):
        if p.is_symlink() or p.exists():
            p.unlink()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("kind", ["corrupt", "empty", "extra-key", "wrong-type", "no-format", "format-2"])
def test_damaged_rebase_state_says_how_to_get_out(tmp_path, rb_conflict, kind):
    """A state.json that is damaged, or of a format this sglpatch does not read (an older one
    without "format", a newer one), is refused with one line naming --abort, which still works."""
    c = Case(tmp_path, rb_conflict)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    assert _rebase(c).returncode == 3
    f = c.fork / ".git" / "sglpatch-rebase" / "state.json"
    data = json.loads(f.read_text())
    if kind == "corrupt":
        f.write_text(f.read_text()[:40])
    elif kind == "empty":
        f.write_text("")
    elif kind == "extra-key":
        f.write_text(json.dumps(dict(data, bogus=1)))
    elif kind == "wrong-type":
        f.write_text(json.dumps(dict(data, names=3)))
    elif kind == "no-format":
        assert data.pop("format") == 1
        f.write_text(json.dumps(data))
    else:
        f.write_text(json.dumps(dict(data, format=2)))
    why = {"no-format": "no format number", "format-2": "format 2"}.get(kind, "damaged")
    for args in (("--continue",), ("--skip",), ("--onto", T, "--source", "sdist")):
        refused(_rebase(c, *args), "state.json", why, f"sglpatch rebase --workdir {c.fork} --abort")
    refused(c.export(), "--abort")
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd
    assert snapshot(c.project) == before
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    c.in_sync()
    c.outside_clean()


def test_abort_checks_a_damaged_state_before_it_moves_anything(tmp_path, rb_conflict):
    """One real stop (0.5.9 -> 0.5.10.post1, a conflict); each damage is refused with the workdir
    still at the stop and the project untouched; then an orig.json without `head` falls back on
    the plan's record and the abort restores everything (was a KeyError)."""
    c = fm.Case(tmp_path, rb_conflict)
    before_wd, before = fm._exact(c.fork), fm.snapshot(c.project)
    assert fm._rebase(c).returncode == exitcodes.HUMAN
    sdir = c.fork / ".git" / "sglpatch-rebase"
    stop, saved = git(c.fork, "rev-parse", "HEAD"), tmp_path / "saved-state"
    shutil.copytree(sdir, saved)
    other = tmp_path / "other-project"
    shutil.copytree(c.project, other)
    orig = json.loads((sdir / "orig.json").read_text())

    def damage(how, *needles, args=(), absent=()):
        how()
        msg = fm.refused(c.run("rebase", "--workdir", str(c.fork), *args, "--abort"), *needles)
        assert git(c.fork, "rev-parse", "HEAD") == stop and fm.snapshot(c.project) == before  # nothing moved
        assert fm.snapshot(other) == fm.snapshot(c.project)
        for word in absent:
            assert word not in msg, msg
        shutil.rmtree(sdir)
        shutil.copytree(saved, sdir)
        return msg

    def both_corrupt():
        (sdir / "orig.json").write_text("{not json")
        (sdir / "state.json").write_text("[]")

    damage(both_corrupt, f"cannot abort the rebase in {c.fork}", "orig.json is damaged", "state.json is damaged too",
           f"git -C {c.fork} reflog", f"then delete {sdir}", args=("--project", str(c.project)), absent=("--abort",))
    damage(lambda: shutil.rmtree(sdir / "project"), "the snapshot of the project's files", "is damaged or gone",
           "nothing was changed", args=("--project", str(c.project)))  # was FileNotFoundError after the reset
    damage(lambda: (sdir / "written.json").write_text('{"../outside/x": null}'), "written.json is damaged",
           "its entry '../outside/x' is not a path inside the project", args=("--project", str(c.project)),
           absent=("symbolic link",))
    damage(lambda: (sdir / "orig.json").write_text(json.dumps(orig | {"project": str(other)})),
           f"was started from the project {other}, not {c.project}", args=("--project", str(c.project)))
    damage(lambda: (sdir / "orig.json").write_text(json.dumps(orig | {"project": str(tmp_path / "outside")})),
           f"names {tmp_path / 'outside'} as the project, which is not an sglpatch project")  # run outside any project
    (sdir / "orig.json").write_text(json.dumps({"orig": {k: v for k, v in orig["orig"].items() if k != "head"},
                                                "project": orig["project"]}))
    fm.ok(fm._rebase(c, "--abort"))
    assert fm._exact(c.fork) == before_wd and fm.snapshot(c.project) == before and not sdir.exists()


@pytest.mark.parametrize("when", ["start", "continue"])
def test_read_only_project_during_a_real_rebase(tmp_path, rb_golden, rb_after, when):
    """The project is on a read-only file system: the rebase says so before it moves a branch."""
    c = Case(tmp_path, rb_golden)
    ro = ReadOnly(c.project)
    try:
        args = ("--continue",) if when == "continue" else ()
        if when == "continue":
            assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:progress"}).returncode == KILLED
        heads = _heads(c.fork)
        ro.ro()
        refused(_rebase(c, *args), "read-only", str(c.project))
        assert _heads(c.fork) == heads
        if when == "start":
            assert not (c.fork / ".git" / "sglpatch-rebase").exists()
        ro.rw()
        ok(_rebase(c, *args))
        assert snapshot(c.project) == rb_after["project"]
        assert _heads(c.fork) == rb_after["heads"]
        c.in_sync()
    finally:
        ro.close()
    c.outside_clean()
