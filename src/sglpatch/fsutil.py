"""Small file-system helpers: atomic writes that stay inside a tree and keep a file's mode, a
journal of what a command wrote, an exclusive lock file, private temporary folders."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from sglpatch.errors import SglpatchError

# (journal file, root) while a journal is kept (see journal())
_JOURNAL: list[tuple[Path, Path]] = []


def inside(root: Path, path: Path, what: str | None = None) -> Path:
    """path, when where it really is (every symbolic link followed, folders included) is root
    or below it; else a one-line refusal. For paths the tool writes or reads in a tree."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise SglpatchError(
            f"{what or path} leads outside {root} (through a symbolic link, to {real}); refusing to use it: "
            "replace the link by a real file or folder"
        )
    return Path(path)


def open_regular(path: Path):
    """path opened for reading when it is a regular file itself: a symbolic link (to /dev/zero, a
    FIFO, a file elsewhere) or a device is one line, never read (reading one can hang)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise SglpatchError(f"{path} is a symbolic link (to {os.readlink(path)}), not a file: refusing to read it; "
                            "delete it and re-run") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise SglpatchError(f"{path} is not a regular file (a device or a pipe): refusing to read it; delete it and re-run")
    return f


def no_link(path: Path, hint: str) -> Path:
    """Refuse a symbolic link at path itself (a file sglpatch keeps, e.g. in DIR/.git)."""
    if os.path.islink(path):
        raise SglpatchError(f"{path} is a symbolic link (to {os.readlink(path)}); {hint}")
    return Path(path)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_if_changed(path: Path, data: bytes, within: Path | None = None) -> bool:
    """Atomically replace path with data unless it already holds exactly these bytes.

    The new content is written to a temporary file beside it and renamed over it, so a
    full disk or a kill leaves either the old file or the new one, never half of one. The
    file keeps its mode (a new one gets what the umask leaves of 0666). With within, a path
    that leads outside that tree (a linked folder) is refused before anything is written.
    """
    path = Path(path)
    if within is not None:
        inside(within, path.parent)
    try:
        if path.read_bytes() == data:
            return False
    except (FileNotFoundError, NotADirectoryError):
        pass
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = 0o666 & ~_umask()
    _record(path, hashlib.sha256(data).hexdigest())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise _write_error(path, e) from None
    return True


def _write_error(path: Path, e: OSError) -> SglpatchError:
    if e.errno == errno.ENOSPC:
        return SglpatchError(f"no space left on device while writing {path}; nothing was changed there, free space and re-run")
    return SglpatchError(f"cannot write {path}: {e.strerror}")


def remove(path: Path, within: Path | None = None) -> bool:
    """Delete the file path (journaled like a write); False when there was none."""
    path = Path(path)
    if within is not None:
        inside(within, path.parent)
    if not path.is_file() and not path.is_symlink():
        return False
    _record(path, None)
    path.unlink()
    return True


# --------------------------------------------------------------------------------------
# a journal of what a command writes under a root (rebase --abort undoes exactly that)


@contextmanager
def journal(file: Path, root: Path):
    """While active, every write_if_changed / remove under root is recorded in file, before it
    happens, as {relative path: sha256 of the bytes written, or null for a removal}."""
    _JOURNAL.append((Path(file), Path(root)))
    try:
        yield
    finally:
        _JOURNAL.pop()


def read_journal(file: Path) -> dict[str, str | None]:
    try:
        data = json.loads(Path(file).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise SglpatchError(f"{file} is damaged ({e})") from None
    if not isinstance(data, dict):
        raise SglpatchError(f"{file} is damaged (not a JSON object)")
    return data


def _record(path: Path, digest: str | None) -> None:
    if not _JOURNAL:
        return
    file, root = _JOURNAL[-1]
    try:
        rel = Path(os.path.abspath(path)).relative_to(os.path.abspath(root))
    except ValueError:
        return
    entries = read_journal(file)
    if entries.get(str(rel), "") == digest:
        return
    entries[str(rel)] = digest
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, file)


# --------------------------------------------------------------------------------------
# the workdir lock


@contextmanager
def exclusive(lockfile: Path, what: str):
    """Hold an exclusive, non-blocking lock on lockfile for the duration (never through a link)."""
    lockfile = Path(lockfile)
    lockfile.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(str(lockfile), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            no_link(lockfile, "sglpatch keeps its lock file there: remove the link and re-run")
        raise SglpatchError(f"cannot open the lock file {lockfile}: {e.strerror}") from None
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


# --------------------------------------------------------------------------------------
# private temporary folders in TMPDIR, and those a killed run left


_TMP_RE = re.compile(r"^sglpatch-([a-z]+)-(\d+)-")


def tmp_prefix(kind: str) -> str:
    """sglpatch-KIND-PID-: every temporary file or folder is named after its process, so that the
    next run can tell a killed run's leftovers in TMPDIR from a live run's (clean_stale_tmp)."""
    return f"sglpatch-{kind}-{os.getpid()}-"


def private_tmpdir(kind: str) -> tempfile.TemporaryDirectory:
    """A temporary folder in TMPDIR (tmp_prefix), after removing what killed runs left there."""
    clean_stale_tmp()
    return tempfile.TemporaryDirectory(prefix=tmp_prefix(kind))


def clean_stale_tmp() -> list[str]:
    """Remove sglpatch-*-PID-* folders in TMPDIR whose process is gone (killed: a SIGKILL runs no
    clean-up); only our own user's. Returns their names."""
    base = Path(tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_RE.match(entry.name)
        if not m or int(m.group(2)) == os.getpid():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(m.group(2)), 0)
            continue  # its process is alive
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


TEST_HOOKS_VAR = "SGLPATCH_TEST_HOOKS"  # only the test harness sets it (tests/conftest.py)


def replace_dir(src: Path, dest: Path) -> None:
    """Put a copy of the folder src in place of the folder dest in one step: the copy is made next
    to dest (``.NAME.sglpatch-new``), then the two are exchanged (renameat2 RENAME_EXCHANGE), so
    that a kill at any point leaves dest the old folder or the new one, never missing or half
    copied; then the old one goes. A copy left by a killed run is removed by the next call."""
    dest = Path(dest)
    staged = dest.with_name(f".{dest.name}.sglpatch-new")
    if staged.exists() or staged.is_symlink():
        shutil.rmtree(staged) if staged.is_dir() and not staged.is_symlink() else staged.unlink()
    shutil.copytree(src, staged, symlinks=True)
    crashpoint("replace_dir:copied")
    if not dest.exists():
        os.rename(staged, dest)
        return
    _exchange(staged, dest)
    crashpoint("replace_dir:swapped")
    shutil.rmtree(staged)


def _exchange(a: Path, b: Path) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None and fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return
    err = ctypes.get_errno() if fn is not None else errno.ENOSYS
    if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), str(b))
    old = b.with_name(f".{b.name}.sglpatch-old")  # no exchange here: two renames, the old one kept until the new is in
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)


def crashpoint(step: str) -> None:
    """Fault-injection hook for the failure-mode tests: ``SGLPATCH_CRASH_AT=step`` makes the
    process SIGKILL itself here, the way an OOM kill or a power cut would stop it.

    ``SGLPATCH_PAUSE_AT=step`` with ``SGLPATCH_PAUSE_FILE=BASE`` is a barrier between two real
    processes: here the process writes ``BASE.reached`` (its pid) and waits until ``BASE.go``
    exists (at most ``SGLPATCH_PAUSE_TIMEOUT`` seconds, default 300), then goes on.

    Both are off unless ``SGLPATCH_TEST_HOOKS=1`` (TEST_HOOKS_VAR) is set too: tests/conftest.py
    sets it for the test session; a user's shell that has a stray SGLPATCH_CRASH_AT or
    SGLPATCH_PAUSE_AT left over never kills or stalls a real run."""
    if os.environ.get(TEST_HOOKS_VAR) != "1":
        return
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
