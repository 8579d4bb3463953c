"""One Python of the patched venv that has imported torch and transformers once, and forks a
child for each piece of code the patch tests run (conftest's ``run_patched``).

Each child is a real process of that Python: it sets the environment and working folder the
test asks for, imports the patched SGLang modules itself (none is imported before the fork),
runs the code as ``python -c`` would (``__main__``, atexit handlers, exit status, a signal
ends it with -signal), with its output in files. What it saves: importing torch, transformers
and their imports (about 3 of the 6 CPU-seconds a patch-test process took) once per session
instead of once per process; the tests run ten such processes, twice per suite (on 0.5.9 and
on the rebased tree). SGLPATCH_TEST_NO_ZYGOTE=1 runs each as its own ``python -c`` again.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.image_processing_utils")

SERVER = r"""
import atexit, importlib, json, os, sys, threading, traceback, types
proto = os.fdopen(os.dup(1), "w")  # the answers; what the imports print goes where stderr goes
os.dup2(2, 1)
devnull = os.open(os.devnull, os.O_RDONLY)
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
import gc
gc.freeze()  # what was imported stays out of each child's collections (and its pages shared)
print("ready" if threading.active_count() == 1 else "threads", file=proto, flush=True)

def child(req):
    os.dup2(devnull, 0)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(req["env"])
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None  # TMPDIR is read again, from this run's environment
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    sys.argv = req.get("argv") or ["-c"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(req["code"], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)

for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        proto.close()
        child(req)
    print(f"pid {pid}", file=proto, flush=True)
    _, status, usage = os.wait4(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(f"status {code} {usage.ru_utime + usage.ru_stime:.3f}", file=proto, flush=True)
"""


class Zygote:
    def __init__(self, python: Path, env: dict, folder: Path, preload: tuple = PRELOAD):
        self.python, self.folder = str(python), folder
        self.cpu = 0.0  # CPU seconds of the children (not in this process's RUSAGE_CHILDREN)
        self.proc = subprocess.Popen([self.python, "-c", SERVER, *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, cwd=folder)  # stdout: read by _line only
        self._buf = b""
        first = self._line()
        if first != "ready":  # a thread started by an import: forking is not safe
            self.close()
            raise RuntimeError(f"zygote not ready: {first!r}")
        self.n = 0

    def run(self, code: str, env: dict, cwd: Path, timeout: float, argv: list | None = None,
            args: list | None = None) -> subprocess.CompletedProcess:
        """code run as `python -c` runs it (sys.argv: argv, default ["-c"]); the result names args
        (default [python, "-c", code]), the command it stands for."""
        self.n += 1
        out, err = self.folder / f"out-{self.n}", self.folder / f"err-{self.n}"
        umask = os.umask(0o022)
        os.umask(umask)  # the caller's, as a child of its own would inherit it
        req = {"code": code, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err), "argv": argv, "umask": umask}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pid = int(self._line().split()[1])
        status = self._line(timeout)
        killed = status is None
        if killed:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does on its timeout
            status = self._line()
        _, code_s, cpu = status.split()
        self.cpu += float(cpu)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        args = args or [self.python, "-c", code]
        if killed:
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
        return subprocess.CompletedProcess(args, int(code_s), stdout, stderr)

    def _line(self, timeout: float | None = None) -> str | None:
        """The zygote's next line ("" at its end); None when timeout seconds pass first. Read from the
        pipe's file descriptor (the buffered reader is never used): a line already read with the one
        before would not wake a select on the pipe."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            if deadline is not None and not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start(python: Path, env: dict, folder: Path, preload: tuple = PRELOAD) -> Zygote | None:
    """A zygote for python, or None (SGLPATCH_TEST_NO_ZYGOTE set, or it could not start safely)."""
    if os.environ.get("SGLPATCH_TEST_NO_ZYGOTE"):
        return None
    try:
        return Zygote(python, env, Path(tempfile.mkdtemp(dir=folder)), preload)
    except (OSError, RuntimeError, ValueError):
        return None
