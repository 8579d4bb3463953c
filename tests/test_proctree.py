"""sglpatch.proctree: a process group plus the descendants seen earlier, ended with psutil."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
from conftest import wait_pid

from sglpatch.proctree import Tree


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_kill_ends_an_orphan_that_left_the_group_only_because_it_was_seen(tmp_path):
    # CMD -> sh (exits after 2 s) -> sleep in its own session: once sh is gone, the sleep is
    # neither in CMD's group nor its descendant; only the earlier snapshot knows it
    pidfile = tmp_path / "pid"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.run(['sh', '-c', 'setsid sleep 300 & echo $! > {pidfile}; sleep 2'])\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    escaped = None
    try:
        tree = Tree(proc.pid)
        escaped = wait_pid(pidfile, timeout=10.0)
        tree.snapshot()
        assert escaped in tree.seen
        time.sleep(2.5)  # sh has exited: the sleep is an orphan in another session
        assert os.getpgid(escaped) != proc.pid and escaped not in [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        fresh = Tree(proc.pid)
        fresh.snapshot()
        assert escaped not in fresh.seen  # without the earlier snapshot it would survive
        assert tree.kill(grace=2.0, reap=proc) == []
        assert proc.poll() is not None and _gone(escaped)
    finally:
        if proc.poll() is None:
            proc.kill()
        if escaped and not _gone(escaped):
            os.kill(escaped, 9)


def test_a_recycled_pid_is_never_signalled():
    # a Tree for a group that no longer exists must not adopt whatever holds that PID now
    other = subprocess.Popen(["sleep", "30"])  # in our group, not a group leader
    try:
        tree = Tree(other.pid)
        assert tree.seen == {}
        tree.snapshot()
        assert tree.kill(grace=0.5) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
