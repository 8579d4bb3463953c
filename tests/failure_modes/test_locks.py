"""The workdir lock between real processes: two applies at once, every state-changing command while a
rebase finishes, stack commands while a rebase is in progress or half-finished, and what --abort
restores.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from failure_modes.world import Case, _exact, _heads, _rebase, ok, refused, snapshot
from failure_modes.faults import Barrier, KILLED, T, popen, rebase_args, workdir_state


def test_two_applies_at_once(fresh):
    """Two real apply processes on one workdir: the second is refused by the lock file."""
    c = fresh
    env = c.env()
    first = subprocess.Popen(
        [sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(c.project), "--workdir", str(c.fork), "--no-install", "--source", "sdist"],
        cwd=c.tmp, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    for line in first.stderr:
        if "sglang-0.5.9.tar.gz" in line:  # "extracting ..." or "taking the tree of ... from the tree cache": the lock is held
            break
    # held there with a real SIGSTOP: a tree from the tree cache makes the rest of the apply fast
    # enough to finish before the other two start (CI saw the export pass, stop 33)
    first.send_signal(signal.SIGSTOP)
    try:
        second = c.apply()
        export = c.export()
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    refused(second, "another sglpatch command", "wait for it")
    refused(export, "another sglpatch command")
    c.in_sync()
    ok(c.apply())
    c.outside_clean()


# --------------------------------------------------------------------------------------
# the workdir lock covers every state-changing command, all of it


@pytest.mark.parametrize("first", ["start", "continue"])
def test_abort_while_a_rebase_finishes_is_refused(tmp_path, rb_golden, rb_after, first):
    """A rebase (or its --continue) paused in its finishing step, `upstream` already moved: an
    --abort, another --continue and an export from a second shell are refused by the lock; the
    rebase then completes exactly as an undisturbed one."""
    c = Case(tmp_path, rb_golden)
    bar = Barrier(c)
    if first == "continue":
        assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:progress"}).returncode == KILLED
        args = rebase_args(c, "--continue")
    else:
        args = rebase_args(c)
    proc = popen(c, *args, env=bar.env("rebase:finish:upstream"))
    bar.reached(proc)
    refused(_rebase(c, "--abort"), "another sglpatch command is working on", str(c.fork))
    refused(_rebase(c, "--continue"), "another sglpatch command is working on")
    refused(c.export(), "another sglpatch command is working on")
    bar.go()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert snapshot(c.project) == rb_after["project"]
    assert _heads(c.fork) == rb_after["heads"]
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# no stack command while a rebase is in progress or half-finished


@pytest.mark.parametrize("when", ["killed-in-finish", "stopped-for-you"])
def test_stack_commands_refuse_while_a_rebase_is_in_progress(tmp_path, rb_golden, rb_conflict, rb_after, when):
    if when == "killed-in-finish":  # `upstream` moved, `patched` not yet: an export would write the whole tree
        c = Case(tmp_path, rb_golden)
        assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:finish:upstream"}).returncode == KILLED
    else:
        c = Case(tmp_path, rb_conflict)
        assert _rebase(c).returncode == 3
    before_wd, before = workdir_state(c.fork), snapshot(c.project)
    where = ("--project", str(c.project), "--workdir", str(c.fork))
    for args in (("export",), ("apply", "--no-install", "--source", "sdist"), ("status",), ("lock", "--update-blobs"), ("check",)):
        refused(c.run(*args, *where), "a rebase is in progress", f"sglpatch rebase --workdir {c.fork} --continue", "--abort")
    assert workdir_state(c.fork) == before_wd
    assert snapshot(c.project) == before
    if when == "killed-in-finish":
        ok(_rebase(c, "--continue"))
        assert snapshot(c.project) == rb_after["project"]
    else:
        ok(_rebase(c, "--abort"))
        assert snapshot(c.project) == before
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# --abort restores what the rebase wrote, nothing else


@pytest.mark.parametrize("when", ["stopped-for-you", "killed-late"])
def test_abort_keeps_what_you_added_during_the_rebase(tmp_path, rb_golden, rb_conflict, when):
    c = Case(tmp_path, rb_conflict if when == "stopped-for-you" else rb_golden)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    if when == "stopped-for-you":
        assert _rebase(c).returncode == 3
    else:  # patches/, series, lock, CHANGELOG and the report written by the rebase
        assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:finish:changelog"}).returncode == KILLED
    mine = {"patches/0099-my-experiment.patch": b"my next patch, not in the series yet\n",
            f"resolutions/{T}/NOTES.md": b"what I tried on the conflict\n"}
    for rel, data in mine.items():
        (c.project / rel).write_bytes(data)
    changelog = (c.project / "CHANGELOG.md").read_bytes() + b"- my note, written during the rebase\n"
    (c.project / "CHANGELOG.md").write_bytes(changelog)
    res = ok(_rebase(c, "--abort"))
    for rel in (*mine, "CHANGELOG.md"):
        assert rel in res.stdout, res.stdout
    expected = dict(before, **mine)
    expected["CHANGELOG.md"] = changelog
    assert snapshot(c.project) == expected
    assert _exact(c.fork) == before_wd
    c.in_sync()
    c.outside_clean()
