"""Stopping what a command started: its process group plus every descendant seen earlier.

A command run with ``start_new_session=True`` leads its own process group, and killing the
group ends it and its children. Some children leave the group (``setsid``, daemons, a server
launcher's workers) or are orphaned by a crashed parent and lose the link to it; the only way
to find those later is to have seen them. :class:`Tree` keeps such a snapshot (psutil's
``Process`` objects, which also guard against a recycled PID: one that now belongs to another
program is never signalled) and :meth:`Tree.kill` ends the group and everything in it.

Used by ``sglpatch bisect`` (per-step timeout, Ctrl-C); the regression suite's launcher is
meant to use the same (one implementation).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil


def unsafe_group(pgid: int) -> str | None:
    """Why process group pgid must not be signalled as a group from here, or None. 0 is no group
    (os.killpg(0) signals the caller's own; getpgid says 0 for a group outside this PID namespace),
    and neither is ours nor one holding a process we were started from."""
    if pgid <= 0:
        return f"its process group ({pgid}) cannot be named from this PID namespace"
    if pgid == os.getpgrp():
        return f"its process group {pgid} holds this process"
    try:
        for parent in psutil.Process().parents():
            if os.getpgid(parent.pid) == pgid:
                return f"its process group {pgid} holds pid {parent.pid}, which started this process"
    except (psutil.Error, OSError):
        pass
    return None


class Tree:
    """The process group led by ``pid`` and every descendant seen by :meth:`snapshot`."""

    def __init__(self, pid: int):
        self.pgid = pid
        self.seen: dict[int, psutil.Process] = {}
        try:
            if os.getpgid(pid) == pid:  # the leader, not a process that got its PID since
                self.seen[pid] = psutil.Process(pid)
        except (psutil.Error, OSError):
            pass

    def snapshot(self) -> None:
        """Remember the descendants of every process seen so far and the group's members."""
        for proc in list(self.seen.values()):
            try:
                children = proc.children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                self.seen.setdefault(child.pid, child)
        for proc in psutil.process_iter():
            try:
                if proc.pid not in self.seen and os.getpgid(proc.pid) == self.pgid:
                    self.seen[proc.pid] = proc
            except (psutil.Error, OSError):
                continue

    def alive(self) -> list[int]:
        """PIDs of remembered processes still running (zombies and recycled PIDs excluded)."""
        out = []
        for pid, proc in self.seen.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                continue
        return out

    def signal(self, sig: int) -> None:
        if unsafe_group(self.pgid) is None:  # else the remembered processes only, one by one
            try:
                os.killpg(self.pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in list(self.seen.values()):
            try:
                proc.send_signal(sig)  # psutil refuses a PID that now belongs to another process
            except psutil.Error:
                continue

    def kill(self, grace: float = 5.0, reap: subprocess.Popen | None = None) -> list[int]:
        """SIGTERM the group and every remembered process, SIGKILL what is left after grace
        seconds; return the PIDs still alive after that (normally none). ``reap``: our own
        child, polled so that it does not linger as a zombie."""
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            self.snapshot()
            if not self.alive():
                break
            self.signal(sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if reap is not None:
                    reap.poll()
                if not self.alive():
                    break
                time.sleep(0.05)
        if reap is not None:
            reap.poll()
        return self.alive()


def kill_group(pgid: int, grace: float = 5.0, seen: Tree | None = None, reap: subprocess.Popen | None = None) -> list[int]:
    """Kill the process group ``pgid`` and what ``seen`` remembered of it; see :class:`Tree`."""
    tree = seen if seen is not None else Tree(pgid)
    return tree.kill(grace=grace, reap=reap)


def end_descendants(grace: float = 5.0) -> list[int]:
    """SIGTERM every descendant of this process (pip, uv, git, their builds), SIGKILL what is left
    after grace seconds; the PIDs still alive after that (normally none)."""
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for k in kids:
            try:
                k.send_signal(sig)
            except psutil.Error:
                pass
        _, kids = psutil.wait_procs(kids, timeout=wait_s)
        if not kids:
            break
    return [k.pid for k in kids]
