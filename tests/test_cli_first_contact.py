"""What a new user meets first, through the installed console script (`sglpatch` on PATH),
`python -m sglpatch` and scripts/*.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, git
from sglpatch import __version__
from sglpatch.lock import read_lock, write_lock

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.sh") if p.name != "lib.sh")  # lib.sh is sourced by them
WORKDIR_SCRIPTS = ["apply.sh", "bisect.sh", "export.sh", "rebase.sh"]


def cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = shutil.which("sglpatch")
    assert exe, "the sglpatch console script is not on PATH (scripts/test.sh puts the venv's bin there)"
    return subprocess.run([exe, *args], cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)


def test_version_from_the_console_script_and_python_m():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"sglpatch {__version__}", proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "sglpatch", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"sglpatch {__version__}", proc.stdout + proc.stderr


def test_version_is_written_in_one_place():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sglpatch.__version__"}


def test_help_is_a_description_and_shows_defaults():
    top = cli("--help").stdout
    assert "rooms" not in top and "patch series" in top and "scripts/apply.sh" in top
    apply_help = " ".join(cli("apply", "--help").stdout.split())
    assert "--source {auto,git,sdist}" in apply_help and "(default: auto)" in apply_help
    assert "(default: 8.0)" in apply_help  # --probe-timeout
    check_help = " ".join(cli("check", "--help").stdout.split())
    assert "registry sdist" in check_help and "(default: sdist)" in check_help
    regress_help = " ".join(cli("regress", "--help").stdout.split())
    assert "allreduce" in regress_help and "(default: all)" in regress_help
    bisect_help = cli("bisect", "--help").stdout
    assert " DIR " not in bisect_help.replace("\n", " ") and "<workdir>/.git/sglpatch-bisect" in " ".join(bisect_help.split())
    assert "(default: None)" not in apply_help + check_help + regress_help


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_help_is_a_usage(script):
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"scripts/{script.name}" in proc.stdout
    assert "set -euo" not in proc.stdout and "HERE=" not in proc.stdout and not proc.stdout.startswith("#")


@pytest.mark.parametrize("name", WORKDIR_SCRIPTS)
@pytest.mark.parametrize("tail", [(), ("--no-install",)])
def test_script_workdir_without_value_is_one_clear_line(name, tail):
    if name != "apply.sh" and tail:
        tail = ("--dry-run",) if name == "rebase.sh" else ("--",)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / name), "--workdir", *tail], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"{name}: --workdir needs a value (see {name} --help)"], proc.stderr


def test_apply_defaults_to_auto_and_refuses_unexported_work_before_any_progress(project_copy, tmp_path):
    lock = read_lock(project_copy)
    lock.url = "https://127.0.0.1:9/nowhere/sglang"  # answers nothing: auto takes the sdist
    write_lock(project_copy, lock)
    wd = tmp_path / "fork"
    args = ("apply", "--project", str(project_copy), "--workdir", str(wd), "--no-install", "--probe-timeout", "2")
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "source: sdist" in proc.stderr and "[1/4]" in proc.stderr
    (wd / "python" / "sglang" / "mine.py").write_text("x = 1\n")
    git(wd, "add", "python/sglang/mine.py")
    git(wd, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qm", "my work")
    (project_copy / "series").write_text((project_copy / "series").read_text() + "# a comment changes the digest\n")
    head = git(wd, "rev-parse", "patched")
    proc = cli(*args)
    assert proc.returncode == 1
    assert "[1/" not in proc.stderr and "rebuilt" not in proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sglpatch: error:")]
    assert len(errors) == 1 and "not in the series" in errors[0] and "nothing was changed" in errors[0]
    assert git(wd, "rev-parse", "patched") == head


def test_what_the_tool_writes_into_the_project_is_ignored():
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    for path in ("regress-20261130-120000/report.md", "rebase-reports/0.5.10.post1.md"):
        proc = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, env=env)
        assert proc.returncode == 0, f"{path} is not ignored by .gitignore"
