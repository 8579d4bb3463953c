"""Issue 28, fault 3, with a real rebase that stops on a real conflict (0.5.9 -> 0.5.10.post1):

- an `--abort` killed after it reset the workdir but before it removed the state is finished by
  the next `--abort`; `--continue`, `--skip`, a new rebase and export refuse with one line that
  says so (before: `--continue` exited 0, committing the old tree as the "resolution" and
  dropping the remaining patches as "already upstream");
- `--continue` / `--skip` after the tree was moved from the stop (`git checkout -f patched`)
  take nothing as a resolution and say how to get back."""

from __future__ import annotations

import pytest

from conftest import git
from failure_modes import world as fm
from failure_modes.world import REBASE_TARGET, Case, _exact, _rebase, ok, refused, snapshot

golden, rb_golden, rb_conflict = fm.golden, fm.rb_golden, fm.rb_conflict
KILLED = -9


@pytest.mark.parametrize("step", ["rebase:abort:marked", "rebase:abort:reset"])
def test_an_interrupted_abort_is_finished_by_the_next_abort_and_never_continued(tmp_path, rb_conflict, step):
    c = Case(tmp_path, rb_conflict)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    assert _rebase(c).returncode == 3
    assert _rebase(c, "--abort", env={"SGLPATCH_CRASH_AT": step}).returncode == KILLED
    assert (c.fork / ".git" / "sglpatch-rebase" / "state.json").exists()
    how = f"`sglpatch rebase --workdir {c.fork} --abort` finishes it"
    for args in (("--continue",), ("--skip",), ("--onto", REBASE_TARGET, "--source", "sdist")):
        refused(_rebase(c, *args), "--abort", "was interrupted", how)
    refused(c.export(), "--abort", how)
    assert snapshot(c.project) == before  # nothing exported, nothing recorded
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd and snapshot(c.project) == before
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("args", [("--continue",), ("--skip",)])
def test_continue_refuses_a_tree_that_is_not_where_the_rebase_stopped(tmp_path, rb_conflict, args):
    c = Case(tmp_path, rb_conflict)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    assert _rebase(c).returncode == 3
    stop = git(c.fork, "rev-parse", "HEAD")
    patched = git(c.fork, "rev-parse", "patched")
    git(c.fork, "checkout", "-q", "-f", "patched")
    msg = refused(_rebase(c, *args), f"{c.fork} is not where the rebase stopped (detached at {stop[:12]}",
                  "but on branch patched: nothing taken as a resolution",
                  f"`git -C {c.fork} checkout -f --detach {stop[:12]}`", "--abort")
    assert "\n" not in msg
    assert git(c.fork, "rev-parse", "patched") == patched and snapshot(c.project) == before
    git(c.fork, "checkout", "-q", "-f", "--detach", stop)  # the way back it names
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd and snapshot(c.project) == before
