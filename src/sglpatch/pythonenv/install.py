"""Install the patched tree into a Python environment (editable, --no-deps), with pip or uv, record
which interpreter it went into (the workdir's git config, read back by `regress --tier cpu`), and
say what that interpreter now imports, or what it still lacks and the command that installs it."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sglpatch import redact
from sglpatch import exitcodes
from sglpatch.pythonenv import interpreter
from sglpatch.errors import SglpatchError
from sglpatch.fsutil import crashpoint
from sglpatch.gitcmd import Git
from sglpatch.pythonenv.interpreter import find_uv
from sglpatch.pythonenv import pip_config
from sglpatch.workdir import INSTALLED_KEY, put_back_built, scratch_dir

def check_target(python: str | None, installs: bool) -> None:
    """Before any work: a --python that is not a Python is a one-line usage error; the interpreter
    to install into (python, else this one) is neither the tool's own venv nor a system Python
    that PEP 668 closes (the install would fail only after the build)."""
    facts = interpreter.check_python(python) if python else None
    if not installs:
        return
    if not python and Path(sys.prefix, interpreter.TOOL_VENV_STAMP).exists():
        raise SglpatchError(f"{sys.prefix} is the sglpatch tool's own venv, not a serving Python; pass --python PATH", exitcodes.USAGE)
    interpreter.refuse_system_python(python or sys.executable, facts or interpreter.check_python(sys.executable, "this Python"))


def record(workdir: Path, python: str) -> None:
    """Remember python (as given, not resolved: a venv's python is a symlink to its base) in the
    workdir, beside every interpreter recorded before (one value each; the last one is the newest).
    Called BEFORE the install runs: a kill after pip finished still leaves it named."""
    exe = os.path.expanduser(python)
    exe = os.path.abspath(exe) if os.sep in exe else (shutil.which(exe) or exe)
    git = Git(Path(workdir))
    have = all_recorded(workdir)
    if have and have[-1] == exe:
        return
    if exe in have:
        git.run("config", "--local", "--unset-all", INSTALLED_KEY, f"^{re.escape(exe)}$")
    git.run("config", "--local", "--add", INSTALLED_KEY, exe)


def all_recorded(workdir: Path) -> list[str]:
    """Every interpreter `apply` installed this workdir's tree into, oldest first."""
    workdir = Path(workdir).expanduser()
    if not (workdir / ".git").is_dir():
        return []
    rc, out, _ = Git(workdir).run("config", "--local", "--get-all", INSTALLED_KEY, check=False)
    return [ln for ln in out.splitlines() if ln.strip()] if rc == 0 else []


def recorded(workdir: Path) -> str | None:
    """The interpreter `apply` last installed this workdir's tree into, or None."""
    have = all_recorded(workdir)
    return have[-1] if have else None


def serves_from(python: str, workdir: Path) -> bool:
    """Whether python imports sglang from workdir's tree (found without importing sglang: a venv
    that lacks sglang's dependencies still points at the tree)."""
    code = "import importlib.util as u; s = u.find_spec('sglang'); print(s.origin if s and s.origin else '')"
    try:
        origin = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, cwd="/").stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(origin) and Path(origin).resolve().is_relative_to((Path(workdir) / "python").resolve())


def guard_serving(workdir: Path, moving: str, fix: str) -> None:
    """Refuse to move a tree to another release (moving: 'from 0.5.9 to 0.5.23') while the
    interpreter apply installed it into still imports sglang from it: that venv would run the new
    release's code on the old one's dependencies. fix: the command that builds it elsewhere."""
    live = [py for py in all_recorded(workdir) if serves_from(py, workdir)]  # each one asked now, as pip would answer
    if live:
        py = live[-1]
        raise SglpatchError(
            f"{py} imports sglang from {workdir} (editable): moving that tree {moving} would change what it runs, on the "
            f"old release's dependencies; nothing was changed. Build it in a workdir of its own: {fix}"
        )


def installed_from(python: str, src: Path, version: str | None) -> bool:
    """Whether python's install record says sglang (version, when given) is installed and found in src,
    read without importing sglang (a venv without sglang's dependencies fails the import)."""
    facts = interpreter.probe(python)
    if facts is None or not facts[0] or not facts[1] or not Path(facts[1]).resolve().is_relative_to(Path(src).resolve()):
        return False
    return version is None or interpreter.same_version(facts[0], version)


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


def wheel_sourced(src: Path) -> bool:
    """A tree taken from a wheel (wheel-only releases, 0.5.11+): python/sglang/ and no build files."""
    return not ((src / "pyproject.toml").is_file() or (src / "setup.py").is_file())


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def editable_wheel(src: Path, metadata: bytes, name: str, version: str, dest: Path) -> Path:
    """An editable wheel for a wheel-sourced tree: a .pth that puts src on sys.path, and a dist-info
    carrying the release wheel's own METADATA (its version and Requires-Dist, byte for byte).
    Installed by pip or uv like any wheel, so `pip uninstall` removes exactly what it added."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"__editable__.{name}-{version}.pth": (str(src.resolve()) + "\n").encode(),
        f"{dist}/METADATA": metadata,
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sglpatch\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{k},{_record_hash(v)},{len(v)}\n" for k, v in files.items()) + f"{dist}/RECORD,,\n"
    files[f"{dist}/RECORD"] = record.encode()
    whl = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for k, v in files.items():
            zf.writestr(zipfile.ZipInfo(k, date_time=(1980, 1, 1, 0, 0, 0)), v)
    return whl


def _release_metadata(lock) -> bytes:
    """The locked wheel's METADATA (index-verified, from the cache or downloaded)."""
    from sglpatch.upstream import artifacts

    _, path = artifacts.fetch(lock.name, lock.version, "wheel", expect_sha256=lock.sdist_sha256)
    data = artifacts.metadata_bytes(path)
    if not data:
        raise SglpatchError(f"{path.name} carries no METADATA; cannot make the editable install's dist-info")
    return data


def install(workdir: Path, python: str | None = None, installer: str = "auto", version: str | None = None, lock=None) -> str:
    """Editable-install DIR/python into python's environment. Returns a one-line summary. A
    wheel-sourced tree (no pyproject.toml) goes in as a generated editable wheel (editable_wheel),
    whose METADATA is the locked wheel's (lock)."""
    workdir = Path(workdir).resolve()
    py = python or sys.executable
    if not (shutil.which(py) or Path(py).is_file()):
        raise SglpatchError(f"python interpreter {py} not found; pass --python PATH")
    src = workdir / "python"
    record(workdir, py)  # first: a kill between pip and here must not leave the tree unguarded
    if installed_from(py, src, version):
        return f"sglang already installed editable from {src} for {py}"
    uv = find_uv() if installer in ("auto", "uv") else None
    if installer == "uv" and not uv:
        raise SglpatchError("--installer uv: uv not found on PATH or in ~/.local/bin")
    if wheel_sourced(src):
        if lock is None or lock.artifact_kind != "wheel":
            raise SglpatchError(f"{src} has no pyproject.toml (a wheel-sourced tree) and its lock pins no wheel; re-run `sglpatch apply`")
        metadata = _release_metadata(lock)
        with tempfile.TemporaryDirectory(prefix="sglpatch-editable-", dir=scratch_dir(Git(workdir))) as tmp:
            whl = editable_wheel(src, metadata, lock.name, lock.version, Path(tmp))
            if uv:
                cmd = [uv, "pip", "install", "--python", py, "--no-deps", *pip_config.uv_args(), str(whl)]
            else:
                cmd = [py, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", str(whl)]
            print(f"sglpatch: installing (editable, a .pth to {src} + {lock.name} {lock.version}'s METADATA): {redact.shown(cmd)}",
                  file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
            crashpoint("install:built")
        if proc.returncode != 0:
            raise SglpatchError(
                f"installing {src} failed (exit {proc.returncode}, see above); the patched tree is ready in {workdir}: "
                "fix the environment and re-run, or use --no-install"
            )
        return f"installed sglang {lock.version} editable from {src} into {py}"
    if uv:
        # uv reads none of pip's configuration: the build's own requirements (setuptools) come from
        # the user's index, as pip would take them
        cmd = [uv, "pip", "install", "--python", py, "--no-deps", *pip_config.uv_args(), "-e", str(src)]
    else:
        cmd = [py, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-e", str(src)]
    print(f"sglpatch: installing: {redact.shown(cmd)}", file=sys.stderr, flush=True)
    git = Git(workdir)
    env = dict(os.environ)
    if version:
        # the workdir carries no upstream tags; tell setuptools-scm the pinned version
        env["SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG"] = version
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env)
        crashpoint("install:built")
    finally:  # setuptools-scm rewrites _version.py during the build: put it back, also after Ctrl-C
        put_back_built(git, quiet=True)
    if proc.returncode != 0:
        raise SglpatchError(
            f"installing {src} failed (exit {proc.returncode}, see above); the patched tree is ready in {workdir}: "
            "fix the environment and re-run, or use --no-install"
        )
    return f"installed sglang editable from {src} into {py}"


def report(python: str, workdir: Path, version: str | None, opt: str = "") -> list[str]:
    """What python imports now; when that is not the tree, why, and what to do (the exact command)."""
    st = interpreter.module_state(python)
    if st is not None and st.ok:
        return [f"{python} imports sglang {st.version or '?'} from {st.file}"]
    if st is not None and st.lacks_dependencies:
        tree = str(Path(workdir).resolve() / "python")
        if wheel_sourced(Path(tree)):  # no pyproject.toml: `pip install -e` cannot read the pins from it
            return [
                f"warning: {python} cannot import sglang yet: {interpreter.missing_summary(st)}",
                f"  SGLang {version}'s own dependencies: build a complete new venv (the release's pinned set, checked first): "
                f"scripts/apply.sh{opt} --venv NEWDIR",
            ]
        return [
            f"warning: {python} cannot import sglang yet: {interpreter.missing_summary(st)}",
            f"  install SGLang {version}'s own dependencies: {interpreter.deps_command(python, tree, version, find_uv())}",
            f"  or build a complete new venv instead (the release's pinned set, checked first): scripts/apply.sh{opt} --venv NEWDIR",
        ]
    why = st.error if st is not None and st.error else "it does not run"
    return [f"warning: {python} cannot import sglang ({why}); `{python} -c 'import sglang'` shows the whole error"]
