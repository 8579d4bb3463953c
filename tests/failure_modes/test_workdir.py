"""The workdir: dirty, detached, another branch, not ours, unexported commits, a stale index.lock, a
hostile local git config, a linked worktree, one inside the checkout, the version file a build writes.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, copy_project, git, make_venv, terminal_sigint
from sglpatch import exitcodes
from failure_modes import world as fm
from failure_modes.world import DEP3, DEV, P1_FILE, P2_FILE, ok, refused, snapshot


@pytest.mark.inproc
def test_dirty_workdir(case):
    f = case.fork / P1_FILE
    f.write_text(f.read_text() + "# my experiment\n")
    g = case.fork / P2_FILE
    g.write_text(g.read_text() + "# staged experiment\n")
    git(case.fork, "add", P2_FILE)
    before = case.state()
    with open(case.project / "series", "a") as s:
        s.write("# a series change that would make apply rebuild\n")
    for extra in ((), ("--force",)):
        refused(case.apply(*extra), "uncommitted changes", "nothing was changed")
        assert case.state() == before
    for cmd in ("status", "check"):
        case.run(cmd, "--project", str(case.project), "--workdir", str(case.fork))
    ok(case.export())  # export warns, and keeps the edits
    assert case.state() == before
    git(case.fork, "stash", "-q")
    ok(case.apply())
    git(case.fork, "stash", "pop", "-q")
    assert case.state()["diff"] == before["diff"]
    case.outside_clean()


@pytest.mark.inproc
def test_detached_head(case):
    git(case.fork, "checkout", "-q", "--detach", "patched~1")
    before = case.state()
    refused(case.apply(), "detached", "checkout patched")
    assert case.state() == before
    git(case.fork, "checkout", "-q", "patched")
    ok(case.apply())
    case.outside_clean()


@pytest.mark.inproc
def test_foreign_branch_checked_out(case):
    git(case.fork, "checkout", "-q", "-b", "my-experiment")
    before = case.state()
    refused(case.apply(), "my-experiment", "checkout patched")
    assert case.state() == before
    # an uncommitted edit of the version file on the user's own branch is theirs: refused first, nothing touched
    edited = _as_a_build_writes_it(case)
    before = case.state()
    refused(case.apply(), "my-experiment", "checkout patched")
    bis = case.run("bisect", "--project", str(case.project), "--workdir", str(case.fork), "--", "true")
    assert bis.returncode == exitcodes.ERROR and "is on my-experiment, not patched" in bis.stderr, bis.stderr
    assert case.state() == before and (case.fork / VERSION_PY).read_text() == edited
    git(case.fork, "checkout", "-q", "--", VERSION_PY)
    git(case.fork, "checkout", "-q", "patched")
    ok(case.apply())
    case.outside_clean()


@pytest.mark.inproc
@pytest.mark.parametrize("kind", ["plain-dir", "foreign-repo", "a-file", "subdir-of-workdir", "not-applied-export"])
def test_workdir_not_ours(case, kind):
    other = case.tmp / "other"
    case.allowed.add("other")
    if kind == "plain-dir":
        other.mkdir()
        (other / "thesis.tex").write_text("mine")
    elif kind == "foreign-repo":
        other.mkdir()
        git(other, "init", "-q")
        (other / "app.py").write_text("mine")
        git(other, "add", "app.py")
        git(other, *DEV, "commit", "-qm", "mine")
    elif kind == "a-file":
        other.write_text("mine")
    elif kind == "subdir-of-workdir":
        other = case.fork / "python"
    before = snapshot(other) if other.is_dir() and kind != "subdir-of-workdir" else None
    if kind == "not-applied-export":
        other.mkdir()
        msg = refused(case.run("export", "--project", str(case.project), "--workdir", str(other)), "not set up yet", "sglpatch apply")
    else:
        msg = refused(case.apply(workdir=other), "choose")
    assert "\n" not in msg
    if before is not None:
        assert snapshot(other) == before
    if kind == "a-file":
        assert other.read_text() == "mine"
    case.outside_clean()
    ok(case.apply())


@pytest.mark.inproc
def test_unexported_commit(case):
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# tuned\n")
    git(case.fork, *DEV, "commit", "-qam", f"environ: tuned\n\n{DEP3}")
    before = case.state()
    with open(case.project / "series", "a") as s:
        s.write("# edited\n")
    refused(case.apply(), "not in the series", "sglpatch export", "--force")
    assert case.state() == before
    ok(case.export())
    ok(case.apply())
    assert case.state()["heads"] == before["heads"]
    case.outside_clean()


@pytest.mark.inproc
def test_stale_index_lock(case):
    (case.fork / ".git" / "index.lock").write_text("")
    with open(case.project / "series", "a") as s:
        s.write("# edited\n")
    before = case.state()
    refused(case.apply(), "index.lock", "remove that file")
    assert case.state() == before
    (case.fork / ".git" / "index.lock").unlink()
    ok(case.apply())
    case.outside_clean()


@pytest.mark.inproc
def test_hostile_local_git_config_does_not_run(case):
    """The workdir's own .git/config and hooks are the user's; sglpatch never runs them."""
    pwn = f"touch {case.sentinel}/ran"
    for key, value in (("core.fsmonitor", pwn), ("core.pager", pwn), ("diff.external", pwn), ("core.sshCommand", pwn)):
        git(case.fork, "config", key, value)
    hook = case.fork / ".git" / "hooks" / "post-checkout"
    hook.write_text(f"#!/bin/sh\n{pwn}\n")
    hook.chmod(0o755)
    (case.fork / ".git" / "hooks" / "reference-transaction").write_text(f"#!/bin/sh\n{pwn}\n")
    (case.fork / ".git" / "hooks" / "reference-transaction").chmod(0o755)
    case.restore("series")
    (case.project / "series").write_text((case.project / "series").read_text() + "# rebuild\n")
    ok(case.apply())
    ok(case.export())
    ok(case.run("status", "--project", str(case.project), "--workdir", str(case.fork)))
    assert list(case.sentinel.iterdir()) == []
    case.outside_clean()


@pytest.mark.inproc
def test_a_linked_worktree_as_workdir_names_the_main_one(case):
    wt = case.tmp / "t" / "wt2"
    git(case.fork, "worktree", "add", "-q", "--detach", str(wt), "patched")
    for proc in (case.apply(workdir=wt), case.run("export", "--project", str(case.project), "--workdir", str(wt))):
        fm.refused(proc, f"{wt} is a linked worktree (`git worktree add`), and sglpatch keeps its lock and state in the "
                   f"workdir's own .git folder: use --workdir {case.fork}, or make another with `sglpatch apply --workdir NEW`")
    git(case.fork, "worktree", "remove", "--force", str(wt))


def test_a_workdir_inside_the_checkout_is_refused_in_one_line(tmp_path):
    """`apply --workdir fork` run in the checkout made a git repository inside it."""
    project = copy_project(tmp_path / "co")
    for wd, cwd in (("fork", project), (str(project / "lines" / "w"), tmp_path)):
        r = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--workdir", wd, "--project", str(project), "--no-install",
                            "--source", "sdist"], cwd=cwd, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
        assert r.returncode == exitcodes.USAGE, r.stdout + r.stderr
        assert r.stderr.strip().splitlines() == [
            f"sglpatch: error: --workdir {wd} is inside the sglpatch checkout {project} (a git repository inside it): "
            "pass a folder outside it, e.g. --workdir ~/sglang-fork; nothing was changed"]
        assert not (project / "fork").exists() and not (project / "lines" / "w").exists()


# --------------------------------------------------------------------------------------
# the version file a build writes


VERSION_PY = "python/sglang/_version.py"


def _as_a_build_writes_it(c) -> str:
    """_version.py as setuptools-scm rewrites it when the tree is built without the pinned version
    (the install-deps command apply prints, run in a shell without its variable): the workdir's
    commit and a dev version."""
    f = c.fork / VERSION_PY
    text = f.read_text()
    built = text.replace("__version__ = version = '0.5.9'", "__version__ = version = '0.5.10.dev3+g1a2b3c4'")
    assert built != text
    f.write_text(built)
    return built


@pytest.mark.inproc
def test_the_builds_version_file_never_blocks_apply_nor_is_exported(case):
    _as_a_build_writes_it(case)
    with open(case.project / "series", "a") as s:
        s.write("# a series change that makes apply rebuild\n")
    proc = ok(case.apply())
    assert "uncommitted" not in proc.stderr
    assert f"put back {VERSION_PY}" in proc.stderr  # said, not silent
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    # status does not count it as an edit; export never writes it, alone or next to a real edit
    _as_a_build_writes_it(case)
    st = ok(case.run("status", "--project", str(case.project), "--workdir", str(case.fork)))
    assert "dirty:    0 uncommitted file(s)" in st.stdout and "build output" in st.stdout
    git(case.fork, *DEV, "commit", "-qam", "wip")  # the advice a user followed before: commit, then export
    proc = ok(case.export())
    assert "(wip)" in proc.stderr and "build output, never exported" in proc.stderr and "run `sglpatch apply`" in proc.stderr
    assert not list((case.project / "patches").glob("0003-*")) and "wip" not in (case.project / "series").read_text()
    ok(case.apply())  # the series without it: patched is built again without the commit (kept under refs/sglpatch/backup/)
    assert git(case.fork, "log", "-1", "--format=%s", "patched") != "wip"
    _as_a_build_writes_it(case)
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# tuned\n")
    git(case.fork, *DEV, "commit", "-qam", f"environ: tuned\n\n{DEP3}")
    ok(case.export())
    data = (case.project / "patches" / "0003-environ-tuned.patch").read_text()  # numbered among what is exported
    assert "environ.py" in data and "_version.py" not in data
    ok(case.apply())
    case.in_sync()
    case.outside_clean()


def test_ctrl_c_after_the_build_wrote_the_version_file_leaves_the_tree_clean(case):
    """A real SIGINT to the process group of a real `apply` once pip's build has rewritten
    _version.py (held there by the SGLPATCH_PAUSE_AT barrier): exit 130, and the tree clean."""
    py = make_venv(case.tmp / "t" / "venv")
    barrier = case.tmp / "t" / "pause"
    env = case.env({"SGLPATCH_PAUSE_AT": "install:built", "SGLPATCH_PAUSE_FILE": str(barrier), "PIP_NO_BUILD_ISOLATION": "0",
                    "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG": "0.5.10.dev3"})  # what a build without the pin writes
    env.pop("PYTHONUNBUFFERED", None)  # a minimal shell's: stdout to a pipe is block-buffered
    p = subprocess.Popen([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(case.project), "--workdir", str(case.fork),
                          "--source", "sdist", "--python", str(py), "--installer", "pip"],
                         cwd=case.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                         preexec_fn=terminal_sigint)  # Ctrl-C as from a terminal
    try:
        reached = Path(f"{barrier}.reached")
        deadline = time.monotonic() + 300
        while not reached.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reached.exists(), p.communicate()
        assert VERSION_PY in git(case.fork, "status", "--porcelain", "--untracked-files=no")  # the build rewrote it
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, out
    # one pipe for both streams, as `| tee` sees them: stdout's "patched is up to date" comes before
    # the install, not after "interrupted" (stdout was block-buffered when piped)
    lines = out.rstrip().splitlines()
    assert lines[-1] == "sglpatch: interrupted" and "Traceback" not in out, out
    assert [ln for ln in lines if ln.startswith("patched ")] and lines.index(next(ln for ln in lines if ln.startswith("patched "))) < \
        lines.index(next(ln for ln in lines if ln.startswith("sglpatch: installing")))
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    for f in case.tmp.joinpath("t").glob("pause*"):
        f.unlink()
    shutil.rmtree(case.tmp / "t" / "venv")
    case.runs_pip = True
    case.outside_clean()
