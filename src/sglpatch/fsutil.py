"""Small file-system helpers: atomic writes, an exclusive lock file."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from sglpatch.errors import SglpatchError


def write_if_changed(path: Path, data: bytes) -> bool:
    """Atomically replace path with data unless it already holds exactly these bytes.

    The new content is written to a temporary file beside it and renamed over it, so a
    full disk or a kill leaves either the old file or the new one, never half of one.
    """
    path = Path(path)
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if e.errno == errno.ENOSPC:
            raise SglpatchError(f"no space left on device while writing {path}; nothing was changed there, free space and re-run") from None
        raise SglpatchError(f"cannot write {path}: {e.strerror}") from None
    return True


@contextmanager
def exclusive(lockfile: Path, what: str):
    """Hold an exclusive, non-blocking lock on lockfile for the duration."""
    lockfile = Path(lockfile)
    lockfile.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(lockfile), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SglpatchError(f"another sglpatch command is working on {what} ({lockfile} is locked); wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)


def crashpoint(step: str) -> None:
    """Fault-injection hook for the failure-mode tests: ``SGLPATCH_CRASH_AT=step`` makes the
    process SIGKILL itself here, the way an OOM kill or a power cut would stop it.

    ``SGLPATCH_PAUSE_AT=step`` with ``SGLPATCH_PAUSE_FILE=BASE`` is a barrier between two real
    processes: here the process writes ``BASE.reached`` (its pid) and waits until ``BASE.go``
    exists (at most ``SGLPATCH_PAUSE_TIMEOUT`` seconds, default 300), then goes on."""
    if os.environ.get("SGLPATCH_PAUSE_AT") == step and os.environ.get("SGLPATCH_PAUSE_FILE"):
        base = os.environ["SGLPATCH_PAUSE_FILE"]
        with open(f"{base}.reached.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{base}.reached.tmp", f"{base}.reached")
        deadline = time.monotonic() + float(os.environ.get("SGLPATCH_PAUSE_TIMEOUT", "300"))
        while not os.path.exists(f"{base}.go") and time.monotonic() < deadline:
            time.sleep(0.02)
    if os.environ.get("SGLPATCH_CRASH_AT") == step:
        os.kill(os.getpid(), signal.SIGKILL)
