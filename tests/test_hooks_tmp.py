"""Issue 28, faults 4 and 5, on real processes: the fault-injection hooks are off outside the
test harness, and a killed `sglpatch bisect` leaves nothing of its state in TMPDIR."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from sglpatch import fsutil

HOOK = "from sglpatch.fsutil import crashpoint; crashpoint('apply:locked'); print('went on')"


def _hook_env(tmp_path: Path, hooks: bool, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLPATCH_")}
    env.update(PYTHONPATH=str(ROOT / "src"), **extra)
    if hooks:
        env[fsutil.TEST_HOOKS_VAR] = "1"
    return env


@pytest.mark.parametrize("hooks", [False, True])
def test_a_left_over_crash_hook_kills_only_under_the_test_harness(tmp_path, hooks):
    env = _hook_env(tmp_path, hooks, SGLPATCH_CRASH_AT="apply:locked")
    r = subprocess.run([sys.executable, "-c", HOOK], env=env, capture_output=True, text=True, timeout=60)
    if hooks:
        assert r.returncode == -signal.SIGKILL and r.stdout == ""
    else:
        assert (r.returncode, r.stdout) == (0, "went on\n"), r.stderr


@pytest.mark.parametrize("hooks", [False, True])
def test_a_left_over_pause_hook_neither_waits_nor_writes_outside(tmp_path, hooks):
    base = tmp_path / "barrier"
    env = _hook_env(tmp_path, hooks, SGLPATCH_PAUSE_AT="apply:locked", SGLPATCH_PAUSE_FILE=str(base),
                    SGLPATCH_PAUSE_TIMEOUT="30")
    p = subprocess.Popen([sys.executable, "-c", HOOK], env=env, stdout=subprocess.PIPE, text=True)
    if hooks:  # the barrier holds it until BASE.go exists
        deadline = time.monotonic() + 30
        while not Path(f"{base}.reached").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(f"{base}.reached").read_text() == str(p.pid) and p.poll() is None
        Path(f"{base}.go").touch()
    out, _ = p.communicate(timeout=30)
    assert (p.returncode, out) == (0, "went on\n")
    assert Path(f"{base}.reached").exists() == hooks
