"""Running GPU steps: each in its own session under a timeout, its whole process tree ended
afterwards (also children that left the session), never anything found by name."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

from sglpatch.gpu.shared.profile import usage_error
from sglpatch.proctree import Tree


class ManagedProcess:
    """A command started in its own session, its output appended to a log.  `snapshot()`
    remembers every descendant (`sglpatch.proctree.Tree`: psutil, never a recycled PID) so
    that `stop()` ends them even after they left the session or were orphaned."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path, cwd: str | None = None):
        self.cmd = cmd
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        try:
            self.popen = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise usage_error(f"cannot start {cmd[0]}: {e}") from None
        self.pid = self.popen.pid
        self.tree = Tree(self.pid)
        self.stopped = False

    @property
    def seen(self) -> list[int]:
        return list(self.tree.seen)

    def poll(self):
        return self.popen.poll()

    def snapshot(self) -> None:
        self.tree.snapshot()

    def stop(self, grace_s: float = 15.0) -> list[int]:
        """Terminate the whole tree; returns PIDs still alive afterwards (should be [])."""
        if self.stopped:
            return self.tree.alive()
        survivors = self.tree.kill(grace=grace_s, reap=self.popen)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self._log.close()
        self.stopped = True
        return survivors


def run_step(cmd: list[str], env: dict, log_path: Path, timeout_s: float, cwd: str | None = None) -> dict:
    """Run a command to completion under a timeout; kill its tree on timeout."""
    t0 = time.monotonic()
    mp = ManagedProcess(cmd, env, log_path, cwd=cwd)
    timed_out = False
    while mp.poll() is None:
        mp.snapshot()
        if time.monotonic() - t0 > timeout_s:
            timed_out = True
            break
        time.sleep(0.2)
    survivors = mp.stop(grace_s=10)
    return {"cmd": cmd, "rc": mp.popen.returncode, "timed_out": timed_out, "survivors": survivors,
            "wall_s": round(time.monotonic() - t0, 1), "log": str(log_path)}


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
