"""What the failure-mode cases use to make a fault happen (issue 21's helpers): a barrier and a second
real process, a private cache, a local package index, read-only mounts.

Concurrency is two real processes and a file barrier: ``SGLPATCH_PAUSE_AT=STEP`` makes one wait at
a named step (``fsutil.crashpoint``) until the test lets it go. Read-only file systems are real (a
tmpfs remounted read-only: root ignores file modes, not a read-only mount).
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SDIST_0510_SHA256, git
from sglpatch.upstream.pin import read_lock
from failure_modes.world import Case, REBASE_TARGET, _mount_tmpfs, _umount


T = REBASE_TARGET


KILLED = -signal.SIGKILL


class Barrier:
    """A named step where one real process waits (fsutil.crashpoint) until the test says go."""

    def __init__(self, c: Case, name: str = "b"):
        d = c.tmp / "barrier"
        d.mkdir(exist_ok=True)
        c.allowed.add("barrier")
        self.base = d / name

    def env(self, step: str) -> dict:
        return {"SGLPATCH_PAUSE_AT": step, "SGLPATCH_PAUSE_FILE": str(self.base), "SGLPATCH_PAUSE_TIMEOUT": "240"}

    def reached(self, proc: subprocess.Popen, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not Path(f"{self.base}.reached").exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"the process ended (exit {proc.returncode}) before the barrier:\n{out}{err}")
            assert time.monotonic() < deadline, "the barrier was not reached"
            time.sleep(0.05)

    def go(self) -> None:
        Path(f"{self.base}.go").touch()


def popen(c: Case, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sglpatch.cli", *args], cwd=c.tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=c.env(env))


def rebase_args(c: Case, *args: str) -> tuple:
    return ("rebase", "--workdir", str(c.fork), "--project", str(c.project), *(args or ("--onto", T, "--source", "sdist", "--promote")))


def private_cache(c: Case, where: Path | None = None) -> Path:
    """A cache of our own (the shared one stays untouched), holding copies of the two sdists."""
    cache = where or c.tmp / "cache"
    (cache / "sdist").mkdir(parents=True, exist_ok=True)
    for name in ("sglang-0.5.9.tar.gz", f"sglang-{T}.tar.gz"):
        shutil.copy2(c.golden["cache"] / "sdist" / name, cache / "sdist" / name)
    c.allowed.add(cache.relative_to(c.tmp).parts[0])
    return cache


def index_listing(extra: list | None = None) -> list:
    """PEP 691 file entries: the two sdists with their real sha256 (served from the cache copies)."""
    sha59 = read_lock(Path(__file__).resolve().parents[2]).sdist_sha256
    files = [{"filename": "sglang-0.5.9.tar.gz", "url": "/files/sglang-0.5.9.tar.gz", "hashes": {"sha256": sha59}},
             {"filename": f"sglang-{T}.tar.gz", "url": f"/files/sglang-{T}.tar.gz", "hashes": {"sha256": SDIST_0510_SHA256}}]
    return files + (extra or [])


class JsonIndex:
    """A PEP 691 index on 127.0.0.1 that answers /simple/sglang/ with body."""

    def __init__(self, body: bytes):
        outer = self
        self.body = body

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.rstrip("/") == "/simple/sglang":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                    self.send_header("Content-Length", str(len(outer.body)))
                    self.end_headers()
                    self.wfile.write(outer.body)
                else:
                    self.send_response(404)
                    self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index():
    servers = []

    def make(body) -> JsonIndex:
        servers.append(JsonIndex(body if isinstance(body, bytes) else json.dumps(body).encode()))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def closed_port_url() -> str:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/simple"


class ReadOnly:
    """path on its own tmpfs (its content copied in), remounted read-only and back."""

    def __init__(self, path: Path, size: str = "64m"):
        self.path = path
        saved = path.with_name(path.name + ".saved")
        if path.exists():
            shutil.move(path, saved)
        if not _mount_tmpfs(path, size):
            if saved.exists():
                path.rmdir() if path.exists() else None
                shutil.move(saved, path)
            pytest.skip("cannot mount a tmpfs here")
        if saved.exists():
            shutil.copytree(saved, path, dirs_exist_ok=True, symlinks=True)
            shutil.rmtree(saved)

    def ro(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def rw(self) -> None:
        subprocess.run(["mount", "-o", "remount,rw", str(self.path)], check=True)

    def close(self) -> None:
        saved = self.path.with_name(self.path.name + ".saved")
        self.rw()
        shutil.copytree(self.path, saved, symlinks=True)
        _umount(self.path)
        self.path.rmdir()
        shutil.move(saved, self.path)


def no_timing(text: str) -> str:
    return re.sub(r"\d+\.\d+s", "Xs", text)


def workdir_state(wd: Path) -> dict:
    """_exact, also at a conflict stop (an index with unmerged entries has no tree)."""
    out = {"refs": git(wd, "for-each-ref", "--format=%(refname) %(objectname)"), "HEAD": (wd / ".git" / "HEAD").read_bytes(),
           "config": (wd / ".git" / "config").read_bytes(), "index": git(wd, "ls-files", "--stage")}
    out.update({str(p.relative_to(wd)): p.read_bytes() for p in sorted(wd.rglob("*")) if p.is_file() and ".git" not in p.relative_to(wd).parts})
    return out


def saved_answer(files: list) -> str:
    """An index answer as the cache keeps it (index/sglang.json)."""
    return json.dumps([{"filename": f["filename"], "sha256": f["hashes"]["sha256"], "url": f"http://127.0.0.1:9/files/{f['filename']}"}
                       for f in files])
