"""The user's path end to end: the CLI and scripts/apply.sh, auto source, install, lock --resolve."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import venv
from pathlib import Path

import pytest

from conftest import SERIES, git, make_venv, sglpatch, sglpatch_inproc
from sglpatch.stack import build
from sglpatch.upstream.pin import read_lock, write_lock


def _mirror(tmp_path: Path, project: Path) -> tuple[Path, str]:
    """A local git 'upstream' holding the sdist tree with tag v0.5.9 (stands in for GitHub)."""
    wd = tmp_path / "seed"
    build.apply(project, wd, source="sdist")
    mirror = tmp_path / "mirror"
    git(tmp_path, "clone", "-q", "--branch", "upstream", str(wd), str(mirror))
    git(mirror, "tag", "v0.5.9")
    return mirror, git(mirror, "rev-parse", "HEAD")


def test_auto_source_uses_git_when_it_answers_else_sdist(project_copy, tmp_path):
    mirror, sha = _mirror(tmp_path, project_copy)
    lock = read_lock(project_copy)
    lock.url, lock.commit = f"file://{mirror}", sha[:9]
    write_lock(project_copy, lock)
    proc = sglpatch("apply", "--project", str(project_copy), "--workdir", str(tmp_path / "a"), "--source", "auto", "--no-install")
    assert proc.returncode == 0, proc.stderr
    assert "source: git" in proc.stderr
    assert "Receiving objects" in proc.stderr  # git's progress meter is shown for the fetch
    lock.url, lock.commit = "https://127.0.0.1:9/nowhere/sglang", read_lock(Path(__file__).parents[1]).commit
    write_lock(project_copy, lock)
    proc = sglpatch(
        "apply", "--project", str(project_copy), "--workdir", str(tmp_path / "b"), "--source", "auto", "--probe-timeout", "3", "--no-install"
    )
    assert proc.returncode == 0, proc.stderr
    assert "source: sdist" in proc.stderr
    assert "not reachable" in proc.stderr or "did not answer" in proc.stderr
    assert git(tmp_path / "a", "rev-parse", "patched^{tree}") == git(tmp_path / "b", "rev-parse", "patched^{tree}")
    # the URL answers but its tag is not the locked commit: auto says so and falls back to the sdist
    lock.url, lock.commit = f"file://{mirror}", read_lock(Path(__file__).parents[1]).commit
    write_lock(project_copy, lock)
    proc = sglpatch("apply", "--project", str(project_copy), "--workdir", str(tmp_path / "c"), "--source", "auto", "--no-install")
    assert proc.returncode == 0, proc.stderr
    assert "source: git" in proc.stderr and "the git source failed (upstream.lock: field upstream.commit" in proc.stderr
    assert git(tmp_path / "c", "rev-parse", "patched^{tree}") == git(tmp_path / "b", "rev-parse", "patched^{tree}")
    # an explicit --source git never falls back
    proc = sglpatch("apply", "--project", str(project_copy), "--workdir", str(tmp_path / "d"), "--source", "git", "--no-install")
    assert proc.returncode == 1 and "upstream.commit" in proc.stderr


def test_lock_resolve_writes_the_full_commit(project_copy, tmp_path):
    mirror, sha = _mirror(tmp_path, project_copy)
    lock = read_lock(project_copy)
    lock.url, lock.commit = f"file://{mirror}", sha[:9]
    write_lock(project_copy, lock)
    proc = sglpatch_inproc("lock", "--resolve", "--project", str(project_copy))
    assert proc.returncode == 0, proc.stderr
    assert read_lock(project_copy).commit == sha
    lock.commit = "abcdef123"
    write_lock(project_copy, lock)
    proc = sglpatch_inproc("lock", "--resolve", "--project", str(project_copy))
    assert proc.returncode == 1 and "upstream.commit" in proc.stderr


@pytest.mark.parametrize("installer", ["pip", "uv"])  # the user installs with uv
def test_apply_installs_into_the_given_python_and_reports_it(project_copy, tmp_path, installer):
    if shutil.which(installer) is None:
        pytest.skip(f"{installer} not installed (requirements-test.txt installs it)")
    py = make_venv(tmp_path / "venv")
    wd = tmp_path / "fork"
    args = ["apply", "--project", str(project_copy), "--workdir", str(wd), "--source", "sdist", "--python", str(py), "--installer", installer]
    proc = sglpatch(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("uv pip install --python" in proc.stderr) == (installer == "uv")
    assert f"imports sglang 0.5.9 from {wd.resolve()}/python/sglang/__init__.py" in proc.stdout
    assert f"carries {len(SERIES)} patches:" in proc.stdout and "0002-pcie-custom-allreduce.patch: custom_all_reduce" in proc.stdout
    assert git(wd, "status", "--porcelain", "--untracked-files=no") == ""
    # re-running is safe: no commit, no reinstall
    head = git(wd, "rev-parse", "patched")
    proc = sglpatch(*args)
    assert proc.returncode == 0 and "up to date" in proc.stdout and "already installed" in proc.stdout
    assert git(wd, "rev-parse", "patched") == head


def test_apply_sh_runs_the_whole_flow(project_root, tmp_path):
    wd = tmp_path / "fork"
    proc = subprocess.run(
        ["bash", str(project_root / "scripts" / "apply.sh"), "--workdir", str(wd), "--source", "sdist", "--no-install"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "patched rebuilt" in proc.stdout or "up to date" in proc.stdout
    assert git(wd, "rev-parse", "--abbrev-ref", "HEAD") == "patched"


def test_relative_workdir(project_copy, tmp_path):
    proc = sglpatch_inproc("apply", "--project", str(project_copy), "--workdir", "fork", "--source", "sdist", "--no-install", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert git(tmp_path / "fork", "rev-parse", "--abbrev-ref", "HEAD") == "patched"
    proc = sglpatch_inproc("export", "--project", str(project_copy), "--workdir", "fork", cwd=tmp_path)
    assert proc.returncode == 0 and "0 written" in proc.stdout, proc.stdout + proc.stderr


def _bare_venv(where: Path) -> Path:
    """A venv without pip and without any of sglang's dependencies: `import sglang` fails in it."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)  # as `python -m venv` makes it
    return where / "bin" / "python"


def _uv_env() -> dict:
    return {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}


def test_redaction_is_pips():
    from sglpatch import redact

    assert redact.url("https://u:p@h.example/simple") == "https://u:****@h.example/simple"
    assert redact.url("https://token@h.example/simple and http://h2/x") == "https://****@h.example/simple and http://h2/x"
    assert redact.shown(["pip", "--index-url=https://u:p@h/s", "-e", "/a@b"]) == "pip --index-url=https://u:****@h/s -e /a@b"


def test_warm_apply_into_a_venv_without_sglangs_dependencies_reinstalls_nothing(project_copy, tmp_path):
    """Issue 50: the "already installed" check imported sglang, which fails where its dependencies are
    missing, so every warm apply reinstalled it; now the install record (dist metadata) answers."""
    if shutil.which("uv", path=_uv_env()["PATH"]) is None:
        pytest.skip("uv not installed (requirements-test.txt installs it)")
    py = _bare_venv(tmp_path / "venv")
    args = ["apply", "--project", str(project_copy), "--workdir", str(tmp_path / "fork"), "--source", "sdist", "--python", str(py),
            "--installer", "uv"]
    proc = sglpatch(*args, env=_uv_env())
    assert proc.returncode == 0 and "sglpatch: installing: " in proc.stderr, proc.stdout + proc.stderr
    assert "cannot import sglang yet" in proc.stdout  # the venv lacks sglang's dependencies, as the user's did
    (dist,) = (tmp_path / "venv").glob("lib/python*/site-packages/sglang-*.dist-info")
    before = (dist.stat().st_mtime_ns, (dist / "RECORD").stat().st_mtime_ns)
    proc = sglpatch(*args, env=_uv_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sglpatch: installing" not in proc.stderr and "already installed editable" in proc.stdout, proc.stdout + proc.stderr
    assert dist.is_dir() and (dist.stat().st_mtime_ns, (dist / "RECORD").stat().st_mtime_ns) == before


@pytest.mark.parametrize("spelling", ["venv/bin/python", "../here/venv/bin/python"])
def test_a_relative_python_is_taken_from_the_callers_directory(project_copy, tmp_path, spelling, monkeypatch):
    """Issue 50: --python ../env/bin/python was probed from / and refused; it is the caller's path, the
    venv's bin/python kept as the link it is (abspath, not realpath: its target is the base Python, outside
    the venv). --no-install here: a regression to realpath would install into that base Python."""
    from sglpatch.argtypes import python_path

    here = tmp_path / "here"
    py = _bare_venv(here / "venv")
    monkeypatch.chdir(here)
    assert py.is_symlink() and python_path(spelling) == str(py) and python_path("python3") == "python3"
    proc = sglpatch("apply", "--project", str(project_copy), "--workdir", str(tmp_path / "fork"), "--source", "sdist",
                    "--python", spelling, "--no-install", cwd=here)
    assert proc.returncode == 0 and "carries" in proc.stdout, proc.stdout + proc.stderr
    proc = sglpatch("regress", "--project", str(project_copy), "--tier", "cpu", "--python", spelling, "--report-dir", str(tmp_path / "r"),
                    cwd=here)
    assert "does not run as a Python interpreter" not in proc.stderr and "no such file" not in proc.stderr, proc.stderr
    assert f"--python {py}" in (tmp_path / "r" / "report.json").read_text() and "tier cpu: " in proc.stdout, proc.stdout + proc.stderr


def _black_hole() -> tuple[str, list, socket.socket]:
    """An https URL on 127.0.0.1 whose server takes each connection and never answers (traffic silently
    dropped), and the list of connections it took."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    taken: list = []

    def take():
        while True:
            try:
                taken.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=take, daemon=True).start()
    return f"https://127.0.0.1:{srv.getsockname()[1]}/sglang", taken, srv


def test_a_warm_apply_does_not_probe_the_git_url(project_copy, tmp_path):
    """Issue 50: --source auto probed upstream.url on every apply (8 s where traffic is dropped); when the
    workdir's upstream branch already holds the lock's tree there is nothing to fetch, and no probe."""
    url, taken, srv = _black_hole()
    args = ["apply", "--project", str(project_copy), "--workdir", str(tmp_path / "fork"), "--source", "auto", "--upstream-url", url,
            "--probe-timeout", "1", "--no-install"]
    try:
        proc = sglpatch(*args)
        assert proc.returncode == 0 and "source: sdist (" in proc.stderr and "127.0.0.1" in proc.stderr, proc.stderr
        assert len(taken) >= 1  # the cold apply probed it
        n = len(taken)
        proc = sglpatch(*args)
    finally:
        srv.close()
    assert proc.returncode == 0 and "up to date" in proc.stdout, proc.stdout + proc.stderr
    assert len(taken) == n, f"the warm apply connected to {url}"
    assert "source: the workdir's upstream branch" in proc.stderr and "not probed" in proc.stderr, proc.stderr
