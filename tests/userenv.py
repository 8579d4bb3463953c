"""The user-environment layer: the tool run as a new user runs it, not from the test venv.

* a fresh clone of this checkout (what is here: HEAD, then the working tree's uncommitted and
  untracked files laid over it, so a run before a commit tests what will be committed);
* a scratch HOME (no ~/ml-env, no ~/sglang-fork, no ~/.cache/sglpatch: the scripts download what
  they need, the 0.5.9 sdist included);
* PATH /usr/bin:/bin, so no test venv, no pyenv shim, no uv: `python3` is the system's, and the
  scripts make their own `.tool-venv` in the clone from the package index, as on a new box; the
  user's pip configuration (its files, and the PIP_* variables) is all that is handed over;
* a serving venv of the user's (`serving_venv`): a venv of the test venv's base Python that sees
  the test venv's packages and the 0.5.23 test venv's after them (torch, transformers,
  apache-tvm-ffi, flashinfer-python 0.7.2), a stand-in for ~/ml-env after `apply --with-flashinfer`.

tests/test_user_layer.py runs the README's regress -> bisect flow through it; the README's command
blocks (issue 51) run on it too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT, make_venv, venv_0523

FRESH_PATH = "/usr/bin:/bin"


def _git(*args: str, cwd: Path) -> str:
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


def fresh_clone(dest: Path) -> Path:
    """`git clone` of this checkout, with its uncommitted and untracked (not ignored) files laid over."""
    _git("clone", "-q", "--no-hardlinks", str(ROOT), str(dest), cwd=dest.parent)
    changed = _git("ls-files", "-z", "-m", "-o", "--exclude-standard", cwd=ROOT).split("\0")
    for rel in filter(None, changed):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for rel in filter(None, _git("ls-files", "-z", "-d", cwd=ROOT).split("\0")):
        (dest / rel).unlink(missing_ok=True)
    return dest


class User:
    """A new user: `clone`, `home`, and `run(cmd...)` in their shell (cwd the clone unless given)."""

    def __init__(self, base: Path):
        base.mkdir(parents=True, exist_ok=True)
        self.home = base / "home"
        self.home.mkdir()
        self.tmp = base / "tmp"
        self.tmp.mkdir()
        self.clone = fresh_clone(base / "sglpatch")

    def env(self, **extra: str) -> dict:
        env = {"PATH": FRESH_PATH, "HOME": str(self.home), "LANG": "C.UTF-8", "TMPDIR": str(self.tmp)}
        env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})  # the user's pip configuration
        env.update(extra)
        return env

    def run(self, *cmd, cwd: Path | None = None, timeout: float = 900, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(c) for c in cmd], cwd=cwd or self.clone, env=self.env(**extra), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)

    def serving_venv(self, name: str = "ml-env") -> Path:
        """The user's serving venv (see the module's text): its python."""
        v0523 = venv_0523()
        also = () if not v0523.exists() else (Path(subprocess.run(
            [str(v0523), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip()),)
        return make_venv(self.home / name, also)
