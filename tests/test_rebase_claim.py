"""Two workdirs of one checkout rebase onto the same release (issue 52 item 3): A is killed while it
finishes, B completes; A's --abort then deleted B's series, patches/, upstream.lock and report and
said "back as they were". Now the finishing step claims the line's folder under a project lock, and
an --abort undoes its writes only while its claim stands: here it refuses in one line, nothing
changed, and its advice aborts the workdir alone. Real rebases onto 0.5.10.post1, a real SIGKILL."""

from __future__ import annotations

import os
import signal

from conftest import copy_project, git, sglpatch

LINE = "0.5.10.post1"


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_abort_never_undoes_another_rebases_finished_line(tmp_path):
    project = copy_project(tmp_path / "project")
    a, b = tmp_path / "a", tmp_path / "b"
    for wd in (a, b):
        res = sglpatch("apply", "--workdir", str(wd), "--project", str(project), "--source", "sdist", "--no-install")
        assert res.returncode == 0, res.stderr[-2000:]
    onto = ["rebase", "--onto", LINE, "--project", str(project), "--source", "sdist"]
    killed = sglpatch(*onto, "--workdir", str(a), env=dict(os.environ, SGLPATCH_CRASH_AT="rebase:finish:export"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done = sglpatch(*onto, "--workdir", str(b))
    assert done.returncode == 0 and f"the line {LINE} is in lines/{LINE}/" in done.stdout, done.stderr[-2000:]
    before = _tree(project)
    res = sglpatch("rebase", "--abort", "--workdir", str(a), "--project", str(project))
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "another rebase has claimed or finished that folder since" in res.stderr and "nothing was changed" in res.stderr
    assert _tree(project) == before and (project / "lines" / LINE / "series").is_file()
    # its advice: abort the workdir alone, the project as it is
    state = a / ".git" / "sglpatch-rebase"
    (state / "finishing-id").unlink()
    (state / "written.json").unlink()
    res = sglpatch("rebase", "--abort", "--workdir", str(a), "--project", str(project))
    assert res.returncode == 0 and res.stdout.startswith("rebase aborted: "), res.stderr[-2000:]
    assert _tree(project) == before and git(a, "rev-parse", "--abbrev-ref", "HEAD") == "patched"


def test_an_abort_of_the_only_rebase_that_finished_part_of_a_line_undoes_it(tmp_path):
    project = copy_project(tmp_path / "project")
    before = _tree(project)
    a = tmp_path / "a"
    assert sglpatch("apply", "--workdir", str(a), "--project", str(project), "--source", "sdist", "--no-install").returncode == 0
    killed = sglpatch("rebase", "--onto", LINE, "--project", str(project), "--source", "sdist", "--workdir", str(a),
                      env=dict(os.environ, SGLPATCH_CRASH_AT="rebase:finish:lock"))
    assert killed.returncode == -signal.SIGKILL and (project / "lines" / LINE).exists()
    res = sglpatch("rebase", "--abort", "--workdir", str(a), "--project", str(project))
    assert res.returncode == 0, res.stderr[-2000:]
    assert _tree(project) == before  # nothing of the tool's left in the checkout either
    from sglpatch.rebase import claim

    assert claim._read(project) == {}  # the claim went with the abort
