"""tests/zygote.py, which runs the patch tests' code (conftest's run_patched): each piece of code
behaves as under `python -c` in a fresh process (exit status, a signal, an uncaught exception,
output, environment, working folder, stdin, atexit, a timeout), and the zygote keeps serving."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest

import zygote

CASES = {
    "exit-3": ("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)", 3),
    "exit-message": ("raise SystemExit('bye')", 1),
    "raises": ("def f():\n    raise ValueError('boom')\nf()", 1),
    "signal": ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15),
    "env-cwd-stdin-argv": ("import os, sys; print(os.environ.get('ZYG'), 'PYTHONPATH' in os.environ, os.getcwd(), repr(sys.stdin.read()),"
                           " sys.argv, __name__)", 0),
    "atexit": ("import atexit; atexit.register(lambda: print('at exit'))", 0),
    "fork-and-wait": ("import os\npid = os.fork()\nif pid == 0:\n    print('rank'); os._exit(7)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))", 0),
}


@pytest.fixture(scope="module")
def zy(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    z = zygote.Zygote(sys.executable, env, tmp_path_factory.mktemp("zy"))
    yield z, env
    z.close()


@pytest.mark.parametrize("name", list(CASES))
def test_each_run_is_what_python_c_gives(zy, tmp_path, name):
    z, env = zy
    code, status = CASES[name]
    env = dict(env, ZYG="set")
    got = z.run(code, env, tmp_path, timeout=60)
    want = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert got.returncode == want.returncode == status
    assert got.stdout == want.stdout
    assert got.stderr.splitlines()[-1:] == want.stderr.splitlines()[-1:]  # the traceback's last line, the message
    assert got.args == [sys.executable, "-c", code]


def test_the_callers_umask_is_the_childs(zy, tmp_path):
    z, env = zy
    old = os.umask(0o027)
    try:
        got = z.run("import os; open('f', 'w').close(); print(oct(os.stat('f').st_mode & 0o777))", env, tmp_path, timeout=60)
    finally:
        os.umask(old)
    assert got.stdout == "0o640\n", got.stderr


def test_a_timeout_kills_the_child_and_the_zygote_serves_on(zy, tmp_path):
    z, env = zy
    with pytest.raises(subprocess.TimeoutExpired) as e:
        z.run("import time; print('started', flush=True); time.sleep(60)", env, tmp_path, timeout=2)
    assert e.value.output == "started\n"
    assert z.run("print('next')", env, tmp_path, timeout=60).stdout == "next\n"


def test_no_zygote_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLPATCH_TEST_NO_ZYGOTE", "1")
    assert zygote.start(sys.executable, dict(os.environ), tmp_path) is None


@pytest.mark.parametrize("args", [["--version"], ["apply", "--bogus"], ["status", "--workdir", "no-such-dir", "--project", "."]],
                         ids=["version", "usage-error", "one-line-error"])
def test_the_cli_from_its_zygote_is_the_cli_of_a_fresh_process(tmp_path, args):
    """harness.run_cli (a child of a zygote that imported sglpatch.cli) answers as `python -m sglpatch.cli` does."""
    from harness import _cli_zygote, run_cli

    env = dict(os.environ, TMPDIR=str(tmp_path))
    assert _cli_zygote(env) is not None
    got = run_cli(args, env, tmp_path, 120)
    want = subprocess.run([sys.executable, "-m", "sglpatch.cli", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert got.args == [sys.executable, "-m", "sglpatch.cli", *args]


def test_tmpdir_is_read_from_the_childs_environment(tmp_path):
    """A preloaded module that asked tempfile for its folder in the zygote does not pin it: each child
    reads TMPDIR from its own environment, as a fresh process does."""
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "asks_tmp.py").write_text("import tempfile\nFOLDER = tempfile.gettempdir()\n")
    env = dict(os.environ, PYTHONPATH=str(mod), TMPDIR=str(tmp_path))
    z = zygote.Zygote(sys.executable, env, tmp_path, preload=("asks_tmp",))
    try:
        mine = tmp_path / "mine"
        mine.mkdir()
        got = z.run("import tempfile; print(tempfile.gettempdir())", dict(env, TMPDIR=str(mine)), tmp_path, timeout=60)
    finally:
        z.close()
    assert got.stdout == f"{mine}\n", got.stderr


def test_a_status_line_read_with_the_pid_line_is_not_waited_for():
    """A child that ends at once: its status line can come in the same read as its pid line. It is
    taken from what was read, not waited for on the emptied pipe (that waited out the timeout and
    then killed a pid that was gone)."""
    r, w = os.pipe()
    os.write(w, b"pid 1\nstatus 0 0.000\n")
    z = zygote.Zygote.__new__(zygote.Zygote)
    z.proc, z._buf = types.SimpleNamespace(stdout=os.fdopen(r, "rb", buffering=0)), b""
    t0 = time.monotonic()
    assert z._line() == "pid 1" and z._line(timeout=2) == "status 0 0.000" and time.monotonic() - t0 < 1
    assert z._line(timeout=0.2) is None  # nothing more: the timeout
    os.close(w)
    assert z._line() == ""  # its end
