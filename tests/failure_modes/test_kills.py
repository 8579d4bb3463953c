"""SIGKILL at each named step (``SGLPATCH_CRASH_AT=step``) of apply, export and a rebase onto
0.5.10.post1, and from outside, then a re-run or the documented recovery; the leftovers of a killed
run; rerecord.sh replacing a folder in one step.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, git
from failure_modes.world import Case, DEP3, DEV, GATE, P1_FILE, P2_FILE, _exact, _heads, _new_file_diff, _rebase, _users_work_kept, mkpatch, ok, patch_names, refused, snapshot
from failure_modes.faults import Barrier, KILLED, T, popen, private_cache, rebase_args


FRESH_STEPS = ["init", "apply:locked", "materialize:extract", "materialize:built", "materialize:ref",
               "apply:patch:1", "apply:patch:2", "apply:checkout", "apply:moved"]


@pytest.mark.parametrize("step", FRESH_STEPS)
def test_sigkill_during_first_apply(fresh, golden, step):
    c = fresh
    proc = c.apply(env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ok(c.apply())
    c.in_sync()
    assert git(c.fork, "rev-parse", "patched^{tree}") == git(golden["fork"], "rev-parse", "patched^{tree}")
    assert git(c.fork, "rev-list", "--count", "upstream..patched") == "2"
    c.outside_clean()


REBUILD_STEPS = ["apply:locked", "apply:patch:1", "apply:patch:3", "apply:backup", "apply:moved"]


@pytest.mark.parametrize("step", REBUILD_STEPS)
def test_sigkill_during_rebuild(case, step):
    """apply over an existing workdir whose series grew a patch (and with --force over unexported work)."""
    diff = _new_file_diff("python/sglang/srt/fm_third.py")
    case.append_patch("0003-third.patch", mkpatch("third", diff))
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# my unexported work\n")
    git(case.fork, *DEV, "commit", "-qam", "wip")
    mine = git(case.fork, "rev-parse", "patched")
    proc = case.apply("--force", env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # the unexported commit is on patched or in a backup ref, never lost
    assert mine in git(case.fork, "for-each-ref", "--format=%(objectname)", "refs/heads/patched", "refs/sglpatch/backup/")
    assert (case.fork / "my-notes.txt").exists()
    ok(case.apply("--force"))
    case.in_sync()
    assert mine in git(case.fork, "for-each-ref", "--format=%(objectname)", "refs/sglpatch/backup/")
    assert git(case.fork, "log", "--format=%s", "-1", "patched") == "third"
    case.outside_clean()


EXPORT_STEPS = ["export:patch:1", "export:patch:2", "export:patch:3", "export:removed", "export:series"]


@pytest.fixture(scope="session")
def export_expected(golden, tmp_path_factory):
    """What a clean export of the edited stack below writes."""
    c = Case(tmp_path_factory.mktemp("fm-export"), golden)
    _edit_stack_for_export(c)
    ok(c.export())
    return snapshot(c.project)


def _edit_stack_for_export(c: Case) -> None:
    # a new patch 3, an amended patch 2... (patch 3 amended with a new file), a stale series entry to remove
    f = c.fork / P1_FILE
    f.write_text(f.read_text() + "# stage 3\n")
    git(c.fork, *DEV, "commit", "-qam", f"version: a third patch\n\n{DEP3}")
    (c.fork / "python" / "sglang" / "fm_edit.txt").write_text("edited\n")
    git(c.fork, "add", "python/sglang/fm_edit.txt")
    git(c.fork, *DEV, "commit", "-q", "--amend", "--no-edit")
    with open(c.project / "series", "a") as s:
        s.write("# trailing comment\n")
    (c.project / "patches" / "0009-stale.patch").write_bytes((c.project / "patches" / patch_names(c)[0]).read_bytes())
    with open(c.project / "series", "a") as s:
        s.write("0009-stale.patch\n")


@pytest.mark.parametrize("step", EXPORT_STEPS)
def test_sigkill_during_export(case, export_expected, step):
    _edit_stack_for_export(case)
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# uncommitted edit\n")
    before = case.state()
    proc = case.export(env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert case.state() == before
    assert not [p for p in case.project.rglob("*.tmp")]
    ok(case.export())
    assert snapshot(case.project) == export_expected
    assert case.state() == before
    case.outside_clean()


def test_sigkill_from_outside_mid_apply(fresh):
    """A real kill -9 of the whole process group (sglpatch and its git) as soon as the first patch lands."""
    c = fresh
    p = subprocess.Popen(
        [sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(c.project), "--workdir", str(c.fork), "--no-install", "--source", "sdist"],
        cwd=c.tmp, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=c.env(), start_new_session=True,
    )
    for line in p.stderr:
        if "[1/2]" in line:
            os.killpg(p.pid, signal.SIGKILL)
            break
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    lock = c.fork / ".git" / "index.lock"
    if lock.exists():  # the kill landed while git held its index: the documented refusal, then its advice
        refused(c.apply(), "index.lock", "remove that file")
        lock.unlink()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# SIGKILL at each step of a rebase onto 0.5.10.post1 (the real sdist), then the documented recovery


# (step, recovery): "rerun" = the same command again (no rebase state saved yet);
# "continue" = the re-run is refused with one line naming --continue, which completes the rebase
REBASE_STEPS = [
    ("materialize:extract", "rerun"),  # extracting the new upstream's sdist
    ("rebase:upstream", "rerun"),  # the new upstream commit built, nothing else
    ("rebase:snapshot", "rerun"),  # project snapshot taken, state.json not written yet
    ("rebase:saved", "continue"),  # state.json written, no patch done
    ("rebase:patch:2", "continue"),  # mid-series (every rebase:patch:K leaves the same state)
    ("rebase:progress", "continue"),  # every patch done and saved, nothing moved yet
    ("rebase:finish:backup", "continue"),  # pre-rebase backup refs written
    ("rebase:finish:upstream", "continue"),  # `upstream` moved
    ("rebase:finish:patched", "continue"),  # `patched` moved and checked out
    ("rebase:finish:report", "continue"),  # rebase-reports/ written
    ("rebase:finish:export", "continue"),  # patches/ + series written, P3 removed
    ("rebase:finish:lock", "continue"),  # upstream.lock written
    ("rebase:finish:changelog", "continue"),  # CHANGELOG.md written
    ("rebase:finish:recorded", "continue"),  # the workdir recorded as in sync, state not yet removed
]


@pytest.mark.parametrize("step, recovery", REBASE_STEPS, ids=[s for s, _ in REBASE_STEPS])
def test_sigkill_during_rebase(tmp_path, rb_golden, rb_after, step, recovery):
    c = Case(tmp_path, rb_golden)
    orig = {b: git(c.fork, "rev-parse", b) for b in ("patched", "upstream")}
    before = snapshot(c.project)
    proc = _rebase(c, env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    _users_work_kept(c, orig)
    for rel, data in snapshot(c.project).items():  # each project file is the old one or the new one, never half
        assert data in (before.get(rel), rb_after["project"].get(rel)), f"{rel} is neither as before nor as after the rebase"
    if recovery == "rerun":
        ok(_rebase(c))
    else:
        refused(_rebase(c), "already in progress", "interrupted", f"sglpatch rebase --workdir {c.fork} --continue", "--abort")
        ok(_rebase(c, "--continue"))
    assert snapshot(c.project) == rb_after["project"]
    assert _heads(c.fork) == rb_after["heads"]
    _users_work_kept(c, orig)
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    assert git(c.fork, "for-each-ref", "refs/sglpatch/rebase/") == ""
    c.in_sync()
    c.outside_clean()


def test_sigkill_late_in_rebase_then_abort(tmp_path, rb_golden, rb_after):
    """--abort also works after a kill in the finishing step (project half rewritten, branches moved)."""
    c = Case(tmp_path, rb_golden)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    proc = _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:finish:changelog"})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert snapshot(c.project) != before and _heads(c.fork) == rb_after["heads"]
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd
    assert snapshot(c.project) == before
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    c.in_sync()  # back on the old pin, in sync: a new rebase starts from here (as in rebase:snapshot above)
    c.outside_clean()


STOP_STEPS = ["rebase:stop:checkout", "rebase:stop:applied", "rebase:stop:saved"]


@pytest.mark.parametrize("step", STOP_STEPS)
def test_sigkill_at_rebase_conflict_stop_then_abort(tmp_path, rb_conflict, step):
    """A series whose last patch conflicts on 0.5.10.post1 with no recorded resolution: killed while
    stopping for the user (detached at the new stack, the patch 3-way applied); --abort restores all."""
    c = Case(tmp_path, rb_conflict)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    proc = _rebase(c, env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert (c.fork / "my-notes.txt").read_text() == "the user's untracked notes\n"
    assert _heads(c.fork) == _heads(rb_conflict["fork"])  # no branch moved
    assert snapshot(c.project) == before  # the project is written only at the very end
    msg = refused(_rebase(c), "already in progress", "--continue", "--abort")
    if step == "rebase:stop:saved":
        assert "stopped at patch 4/4" in msg
    if step == "rebase:stop:applied":  # --continue redoes the interrupted stop properly
        res = _rebase(c, "--continue")
        assert res.returncode == 3 and "rebase stopped at patch 4/4" in res.stdout, res.stdout + res.stderr
        assert "<<<<<<<" in (c.fork / GATE).read_text() and git(c.fork, "ls-files", "-u")
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd
    assert snapshot(c.project) == before
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    c.in_sync()
    c.outside_clean()


def test_stale_temporary_folders_of_a_killed_run_are_removed(tmp_path, rb_golden):
    """A dry run killed while unpacking leaves its folders in TMPDIR; the next run removes them
    (their process is gone), never those of a run that is still going."""
    c = Case(tmp_path, rb_golden)
    cache = private_cache(c)
    env = {"SGLPATCH_CACHE": str(cache)}
    cmd = rebase_args(c, "--dry-run", "--onto", T, "--source", "sdist")
    assert c.run(*cmd, env=dict(env, SGLPATCH_CRASH_AT="treecache:unpack")).returncode == KILLED
    stale = {p.name for p in c.tmpdir.iterdir()}
    assert {n.split("-")[1] for n in stale} == {"watch", "tree"}, stale
    bar = Barrier(c)
    live = popen(c, *cmd, env=dict(env, **bar.env("treecache:unpack")))
    bar.reached(live)
    theirs = {p.name for p in c.tmpdir.iterdir()} - stale
    assert len(theirs) == 2
    third = c.run(*cmd, env=env)
    assert third.returncode in (0, 2), third.stdout + third.stderr
    assert {p.name for p in c.tmpdir.iterdir()} == theirs  # the killed run's are gone, the live run's are not
    bar.go()
    out, err = live.communicate(timeout=300)
    assert live.returncode == third.returncode, out + err
    c.outside_clean()


# --------------------------------------------------------------------------------------
# rerecord.sh: resolutions/R replaced in one step


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("step", ["replace_dir:copied", "replace_dir:swapped", None])
def test_rerecord_replaces_a_folder_in_one_step(tmp_path, step):
    """A real SIGKILL at each step of fsutil.replace_dir (what rerecord.sh now replaces resolutions/R and
    lines/R with): the folder is the old one or the new one, whole; the next call leaves no copy behind.
    rerecord.sh did `rm -rf R; cp -r NEW R`: a kill between left R missing or half copied."""
    dest, new = tmp_path / "resolutions" / "0.5.23", tmp_path / "new"
    for d, v in ((dest, "old"), (new, "new")):
        (d / "sub").mkdir(parents=True)
        (d / "resolutions.toml").write_text(v)
        (d / "sub" / "0001.patch").write_text(v * 1000)
    code = "import sys; from sglpatch.fsutil import replace_dir; replace_dir(sys.argv[1], sys.argv[2])"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), SGLPATCH_TEST_HOOKS="1", **({"SGLPATCH_CRASH_AT": step} if step else {}))
    r = subprocess.run([sys.executable, "-c", code, str(new), str(dest)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == (-signal.SIGKILL if step else 0), r.stderr
    assert _tree(dest) in (_tree(new), {"resolutions.toml": "old", "sub/0001.patch": "old" * 1000})
    assert _tree(dest) == (_tree(new) if step != "replace_dir:copied" else {"resolutions.toml": "old", "sub/0001.patch": "old" * 1000})
    env.pop("SGLPATCH_CRASH_AT", None)
    subprocess.run([sys.executable, "-c", code, str(new), str(dest)], env=env, check=True, timeout=60)
    assert _tree(dest) == _tree(new) and sorted(p.name for p in dest.parent.iterdir()) == ["0.5.23"]
    script = (ROOT / "scripts" / "rerecord.sh").read_text()
    assert 'replace_dir "$new" "$res"' in script and 'rm -rf "$res"' not in script and 'rm -rf "$line"' not in script
