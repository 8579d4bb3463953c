"""Install the patched tree into a Python environment (editable, --no-deps), with pip or uv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import Git

GENERATED = ("python/sglang/_version.py",)  # rewritten by setuptools-scm during the build


def find_uv() -> str | None:
    found = shutil.which("uv")
    if found:
        return found
    local = Path.home() / ".local" / "bin" / "uv"
    return str(local) if local.is_file() and os.access(local, os.X_OK) else None


def installed_sglang(python: str) -> tuple[str, str] | None:
    """(path, version) of the sglang that python imports, or None."""
    code = "import sglang, sys; print(sglang.__file__); print(getattr(sglang, '__version__', '?'))"
    try:
        proc = subprocess.run([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    lines = proc.stdout.strip().splitlines()
    return (lines[-2], lines[-1]) if len(lines) >= 2 else None


def install(workdir: Path, python: str | None = None, installer: str = "auto", version: str | None = None) -> str:
    """Editable-install DIR/python into python's environment. Returns a one-line summary."""
    workdir = Path(workdir).resolve()
    py = python or sys.executable
    if not (shutil.which(py) or Path(py).is_file()):
        raise SglpatchError(f"python interpreter {py} not found; pass --python PATH")
    src = workdir / "python"
    have = installed_sglang(py)
    if have and Path(have[0]).resolve().is_relative_to(src.resolve()):
        return f"sglang already installed editable from {src} for {py}"
    uv = find_uv() if installer in ("auto", "uv") else None
    if installer == "uv" and not uv:
        raise SglpatchError("--installer uv: uv not found on PATH or in ~/.local/bin")
    if uv:
        cmd = [uv, "pip", "install", "--python", py, "--no-deps", "-e", str(src)]
    else:
        cmd = [py, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-e", str(src)]
    print(f"sglpatch: installing: {' '.join(cmd)}", file=sys.stderr, flush=True)
    git = Git(workdir)
    env = dict(os.environ)
    if version:
        # the workdir carries no upstream tags; tell setuptools-scm the pinned version
        env["SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG"] = version
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env)
    # setuptools-scm rewrites _version.py during the build; keep the tree clean.
    for path in GENERATED:
        if path in git.dirty_files():
            git.run("checkout", "-q", "HEAD", "--", path)
    if proc.returncode != 0:
        raise SglpatchError(
            f"installing {src} failed (exit {proc.returncode}, see above); the patched tree is ready in {workdir}: "
            "fix the environment and re-run, or use --no-install"
        )
    return f"installed sglang editable from {src} into {py}"
