"""`kill PID` (SIGTERM) of a real `sglpatch apply` while its installer runs (issue 52): before, the
lock was released while pip went on as an orphan. Now pip and what it started end first, then the
command unwinds as after Ctrl-C: one line, exit 130, the workdir's lock free, the tree clean."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import psutil

from conftest import git, make_venv, wait_pid


def _hanging_pip(tmp_path):
    """A venv whose `python -m pip install` hangs (a grandchild too), writing both pids; the rest is the venv's python."""
    py = make_venv(tmp_path / "venv")
    real = py.with_name("python-real")
    py.rename(real)
    py.write_text(f"""#!/bin/bash
if [[ "$1" == "-m" && "$2" == "pip" && "$3" == "install" ]]; then
  sleep 300 & echo $! > {tmp_path / "grandchild.pid"}
  echo $$ > {tmp_path / "pip.pid"}
  wait
fi
exec {real} "$@"
""")
    py.chmod(0o755)
    return py


def test_sigterm_during_the_install_ends_pip_first_then_unwinds(project_copy, tmp_path):
    py = _hanging_pip(tmp_path)
    wd = tmp_path / "fork"
    p = subprocess.Popen([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--workdir", str(wd),
                          "--source", "sdist", "--python", str(py), "--installer", "pip"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        pip, grandchild = wait_pid(tmp_path / "pip.pid", 300), wait_pid(tmp_path / "grandchild.pid", 60)
        os.kill(p.pid, signal.SIGTERM)  # sglpatch alone, as `kill PID` does
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, out
    assert out.rstrip().splitlines()[-1].startswith("sglpatch: terminated (SIGTERM); what it had started was stopped first")
    assert "Traceback" not in out
    for pid in (pip, grandchild):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"{pid} outlived sglpatch"
    with open(wd / ".git" / "sglpatch.lock", "a") as f:  # free: nothing holds it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert git(wd, "status", "--porcelain", "--untracked-files=no") == ""
