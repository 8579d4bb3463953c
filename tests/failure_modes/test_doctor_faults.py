"""The doctor's rough edges: stale workers of another user, a worker that exits during the prompt, a
command line on one line, no GPU with a Python that lacks sglang.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from sglpatch import exitcodes
from sglpatch.gpu.doctor import gpu_holders as doctor_procs
from sglpatch.gpu.doctor import run as doctor
from failure_modes.world import TOOL_SRC


def _stale(proc: subprocess.Popen | int, cmdline: str = "sglang::scheduler_TP0") -> doctor_procs.GpuProc:
    pid = proc if isinstance(proc, int) else proc.pid
    return doctor_procs.GpuProc(pid, ["/dev/nvidia0"], cmdline=cmdline, worker="SGLang worker (sglang::scheduler_TP0)",
                                parent_gone=True, proc=psutil.Process(pid))


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (two uids)")


AS_OTHER = ["setpriv", "--reuid", "65533", "--regid", "65533", "--clear-groups"]


@pytest.fixture
def readable_tool():
    """(python, PYTHONPATH) that uid 65533 can run: the tool's package and psutil copied into a folder
    every user can read, wherever the checkout (and its test venv) lives, e.g. under a 0700 home."""
    base = Path(tempfile.mkdtemp(prefix="sglpatch-other-uid-", dir="/tmp"))
    try:
        for pkg in (Path(TOOL_SRC) / "sglpatch", Path(psutil.__file__).parent):
            shutil.copytree(pkg, base / pkg.name, ignore=shutil.ignore_patterns("__pycache__"))
        for d, _, files in os.walk(base):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644 if not f.endswith(".so") else 0o755)
        runs = [py for py in (sys.executable, "/usr/bin/python3") if Path(py).exists() and subprocess.run(
            [*AS_OTHER, py, "-c", "import psutil, sglpatch"], env={"PYTHONPATH": str(base)}, capture_output=True, cwd="/").returncode == 0]
        if not runs:
            pytest.skip("no Python that uid 65533 can run here")
        yield runs[0], str(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_kill_stale_on_another_users_worker_says_not_permitted_at_once(tmp_path, readable_tool):
    """A non-root doctor and a worker of another uid: EPERM named, no grace waited, no signal sent, never
    "stuck in the driver". Independent of where the checkout lives (a 0700 home: issue 52)."""
    worker = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "sleep", "120"])
    python, path = readable_tool
    try:
        time.sleep(0.2)
        code = (  # the mechanism, not the clock: no sleep (the grace) and no signal before the EPERM line
            "import json, sys, time, psutil\n"
            "from sglpatch.gpu.doctor import gpu_holders as dp\n"
            "waited, sent = [], []\n"
            "time.sleep = lambda s: waited.append(s)\n"
            "psutil.Process.send_signal = lambda self, sig: sent.append(sig)\n"
            f"gp = dp.GpuProc({worker.pid}, ['/dev/nvidia0'], cmdline='sglang::scheduler_TP0', worker='w', parent_gone=True,"
            f" proc=psutil.Process({worker.pid}))\n"
            "lines = dp.end_stale([gp], grace=600.0)\n"
            "print(json.dumps({'lines': lines, 'waited': waited, 'sent': sent}))\n"
        )
        env = dict(os.environ, PYTHONPATH=path, HOME=str(tmp_path))
        r = subprocess.run([*AS_OTHER, python, "-c", code], capture_output=True, text=True, env=env, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["lines"] == [f"pid {worker.pid} (sglang::scheduler_TP0) not ended: not permitted (EPERM: it belongs to "
                                "nobody, this doctor runs as uid 65533): run `sglpatch doctor --kill-stale` as root or as nobody"]
        assert got["waited"] == [] and got["sent"] == []  # before: SIGTERM, its grace, 5 s of SIGKILL, "stuck in the driver"
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


def test_a_worker_that_exits_during_the_prompt_is_named(monkeypatch):
    w = subprocess.Popen(["sleep", "120"])
    gp = _stale(w)
    monkeypatch.setattr(doctor_procs, "scan", lambda *a, **k: {"procs": [gp]})
    said = []

    def ask(_):
        w.kill()
        w.wait()  # it exits (and is reaped) while the user reads the list
        return "y"

    lines = doctor._kill_stale(doctor.Box(nvidia_smi="/nonexistent"), False, ask, said.append)
    want = f"pid {w.pid} (sglang::scheduler_TP0) exited by itself before it was signalled: nothing sent"
    assert lines == [want] and said[-1] == f"doctor: {want}"


def test_the_stale_summary_prints_a_command_line_on_one_line():
    w = subprocess.Popen(["sleep", "120"])
    try:
        gp = _stale(w, cmdline="evil\x1b[2J\nname --x")
        c = doctor.check_procs({"procs": [gp], "smi_only": {}, "devices": ["/dev/nvidia0"], "unreadable": 0}, [])
        assert c.state == "fail" and "pid %d (evil\\x1b[2J, ? MiB" % w.pid in c.text
        assert "\n" not in c.line() and "\x1b" not in c.line() and all("\x1b" not in d and "\n" not in d for d in c.details)
    finally:
        w.kill()
        w.wait()


def test_no_gpu_is_125_even_when_the_python_lacks_sglang(tmp_path):
    from test_doctor import doctor_cli, site

    path = os.pathsep.join([str(site(tmp_path / "s", sglang=None)), TOOL_SRC])  # the sglpatch under test
    r = doctor_cli(tmp_path, str(tmp_path / "no-nvidia-smi"), env_extra={"PYTHONPATH": path})
    assert "fail sglang: " in r.stdout
    assert r.returncode == exitcodes.CANNOT_RUN, r.stdout + r.stderr  # was 1
    assert r.stdout.splitlines()[-1].startswith("doctor: cannot_run (exit 125): ")
    assert r.stdout.splitlines()[-1].endswith("1 fail, 7 skip; no GPU visible here, the GPU checks did not run")
