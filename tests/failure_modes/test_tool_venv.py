"""The tool's own venv and the scripts: scripts/*.sh from any folder, a venv killed or failing half
way, a read-only checkout, Ctrl-C while it is set up, one rule for "no driver here".

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, copy_project, terminal_sigint
import sglpatch as sglpatch_pkg
from sglpatch import exitcodes
from sglpatch.pythonenv import preflight
import test_venv_preflight as vp
from test_venv_preflight import UV, release, wheel
from failure_modes.faults import KILLED


def tool_venv(tmp_path: Path) -> dict:
    """The environment for scripts/*.sh with a tool venv that is this interpreter (a wrapper and the
    stamp lib.sh checks), so that a script runs this checkout's sglpatch without building a venv."""
    tv = tmp_path / "tool-venv"
    (tv / "bin").mkdir(parents=True)
    (tv / "bin" / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (tv / "bin" / "python").chmod(0o755)
    key = subprocess.run(["bash", "-c", f". {ROOT}/scripts/lib.sh; _tool_key"], capture_output=True, text=True, check=True).stdout
    (tv / ".sglpatch-tool").write_text(key)
    return dict(os.environ, SGLPATCH_TOOL_VENV=str(tv), PYTHONPATH=str(ROOT / "src"))


def test_regress_sh_takes_the_readmes_python_pair(tmp_path):
    """`scripts/regress.sh --python A,B` (the README's A/B) reaches sglpatch regress; a pair with a
    missing side is one line naming that side, exit 2."""
    env = tool_venv(tmp_path)
    pair = f"{sys.executable},{tmp_path / 'tool-venv' / 'bin' / 'python'}"  # two interpreters (the second a wrapper)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "regress.sh"), "--tier", "kernel", "--ab", pair, "--report", str(tmp_path / "r")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == exitcodes.CANNOT_RUN, r.stdout + r.stderr  # no GPUs here; was 2: `--python A,B: no such file`
    assert "no such file" not in r.stderr and (tmp_path / "r" / "report.json").is_file()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "regress.sh"), "--tier", "kernel", "--ab", f"{sys.executable},/nonexistent"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.strip().splitlines() == ["regress.sh: --ab /nonexistent: no such file (see regress.sh --help)"]
    r = subprocess.run(["bash", str(ROOT / "scripts" / "regress.sh"), "--tier", "kernel", "--python", f"{sys.executable},/nonexistent"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.strip().splitlines() == ["regress.sh: --python /nonexistent: no such file (see regress.sh --help)"]


def test_scripts_sglpatch_is_the_tool_the_readme_names_from_any_folder(tmp_path):
    """`sglpatch ...` in the README and every hint: scripts/sglpatch, linked onto PATH as the README
    says, runs from any folder; outside a project it takes its own checkout."""
    env = tool_venv(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sglpatch").symlink_to(ROOT / "scripts" / "sglpatch")
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    r = subprocess.run(["sglpatch", "--version"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"sglpatch {sglpatch_pkg.__version__}", r.stdout + r.stderr
    r = subprocess.run(["sglpatch", "lines"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "0.5.9" in r.stdout, r.stdout + r.stderr
    readme = (ROOT / "README.md").read_text()
    assert 'ln -s "$PWD/scripts/sglpatch" ~/.local/bin/sglpatch' in readme and "`scripts/sglpatch`" in readme


def test_regress_from_a_folder_of_the_checkout_writes_its_report_where_git_ignores_it(tmp_path):
    """`scripts/regress.sh` run from docs/ left docs/regress-*/ untracked: the report goes to the
    checkout's top (/regress-*/ is in .gitignore), and the path is said."""
    project = copy_project(tmp_path / "co")
    shutil.copytree(ROOT / "targets", project / "targets")
    for d in ("docs", "tests"):
        (project / d).mkdir()
    r = subprocess.run([sys.executable, "-m", "sglpatch.cli", "regress", "--tier", "kernel", "--project", str(project),
                        "--profile", "rtx6000x8-kimi-k25"], cwd=project / "docs",  # as scripts/regress.sh runs it
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
    assert r.returncode == exitcodes.CANNOT_RUN, r.stdout + r.stderr
    assert list((project / "docs").iterdir()) == []
    reports = list(project.glob("regress-*"))
    assert len(reports) == 1 and (reports[0] / "report.json").is_file() and str(reports[0]) in r.stdout + r.stderr


def test_ctrl_c_while_the_tool_venv_is_set_up_is_one_line_and_the_next_run_says_what_it_does(tmp_path):
    """A real SIGINT to a fresh shell's `scripts/watch.sh --help` while pip installs the tool (its index
    holds the connection open): one line, exit 130, pip's traceback in the log only. The next run says
    it sets the venv up again, and where pip's output goes (it ran 307 s in silence)."""
    if not Path("/usr/bin/python3").is_file() or subprocess.run(["/usr/bin/python3", "-c", "import venv, ensurepip"]).returncode:
        pytest.skip("needs /usr/bin/python3 with venv and ensurepip")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts, never answers
    home, tv = tmp_path / "home", tmp_path / "tool-venv"
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "SGLPATCH_TOOL_VENV": str(tv), "PIP_CONFIG_FILE": os.devnull,
           "PIP_INDEX_URL": f"http://127.0.0.1:{silent.getsockname()[1]}/simple", "PIP_DEFAULT_TIMEOUT": "300", "PIP_RETRIES": "0"}
    try:
        for run in (1, 2):
            p = subprocess.Popen(["bash", str(ROOT / "scripts" / "watch.sh"), "--help"], env=env, cwd=home, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=terminal_sigint)
            deadline = time.monotonic() + 120
            while not (tv / "setup.log").exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # pip is running, waiting on the index
            os.killpg(p.pid, signal.SIGINT)
            _, err = p.communicate(timeout=120)
            assert p.returncode == 130, err
            assert "Traceback" not in err and err.strip().splitlines()[-1] == (
                f"watch.sh: interrupted while setting up the tool venv {tv}; the next run sets it up again"), err
            first = err.strip().splitlines()[0]
            assert first == (f"watch.sh: setting up the sglpatch tool in {tv} (first use; its dependencies go there only)" if run == 1
                             else f"watch.sh: setting up the sglpatch tool in {tv} again (an earlier set-up was interrupted or failed, "
                             "or pyproject.toml changed)"), err
            assert f"what it is doing: tail -f {tv}/setup.log" in err
            assert "cancelled by user" in (tv / "setup.log").read_text()  # pip's own words, in its log
            (tv / "setup.log").rename(tv / f"setup.log.{run}")  # the next run's pip writes it anew: the barrier above
    finally:
        silent.close()


def test_a_read_only_checkout_says_where_the_tool_venv_can_go(tmp_path):
    from failure_modes.faults import ReadOnly

    co = tmp_path / "checkout"
    co.mkdir()
    for part in ("scripts", "src"):
        shutil.copytree(ROOT / part, co / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", co)
    ro = ReadOnly(co)
    ro.ro()
    try:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
        r = subprocess.run(["bash", str(co / "scripts" / "export.sh")], capture_output=True, text=True, env=env, timeout=60)
    finally:
        ro.close()
    assert r.returncode == exitcodes.CANNOT_RUN, r.stderr  # was mkdir's own "cannot create directory", exit 1
    assert r.stderr.splitlines() == [f"export.sh: cannot create the tool's venv {co}/.tool-venv (read-only?): set "
                                     "SGLPATCH_TOOL_VENV to a writable folder, e.g. SGLPATCH_TOOL_VENV=$HOME/.cache/sglpatch/tool-venv"]


needs_uv = pytest.mark.skipif(UV is None, reason="uv not installed")


@needs_uv
@pytest.mark.parametrize("how", ["killed-after-the-venv-exists", "editable-install-fails"])
def test_half_built_venv_is_built_again(env, project_copy, tmp_path, how):
    """`apply --venv` stopped half-way: the re-run the message asks for builds it (the folder is
    marked as ours while it is built; a finished venv is still refused)."""
    wheel(env["index"], "sglpatch-fake-dep", "1.0")
    art = release(tmp_path, ["sglpatch-fake-dep==1.0"])
    new = tmp_path / "new"
    registry = dict(os.environ, **env["env"])
    registry.pop("UV_DEFAULT_INDEX")
    registry["PIP_INDEX_URL"] = os.environ["PIP_INDEX_URL"]  # the editable build's setuptools: uv is handed pip's index
    args = ("apply", "--project", str(project_copy), "--workdir", str(tmp_path / "fork"), "--source", "sdist", "--venv", str(new),
            "--release-artifact", str(art), "--python", sys.executable, "--installer", "uv")

    def run(e):
        return subprocess.run([sys.executable, "-m", "sglpatch.cli", *args], capture_output=True, text=True, env=e, timeout=600)

    if how == "killed-after-the-venv-exists":
        first = run(dict(registry, SGLPATCH_CRASH_AT="venv:created"))
        assert first.returncode == KILLED, first.stdout + first.stderr
    else:
        first = run(dict(os.environ, **env["env"]))  # no registry: the plan installs, the editable build fails
        assert first.returncode == 1 and "fix the environment and re-run" in first.stderr, first.stdout + first.stderr
    assert new.is_dir() and any(new.iterdir())
    again = run(registry)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "did not finish" in again.stderr, again.stderr
    assert f"installed sglang editable from {(tmp_path / 'fork').resolve()}/python into {new}/bin/python" in again.stdout
    listing = subprocess.run([UV, "pip", "list", "--python", str(new / "bin" / "python")], capture_output=True, text=True).stdout
    assert "sglpatch-fake-dep" in listing and "sglang" in listing
    last = run(registry)  # a finished venv is not ours to rebuild
    assert last.returncode == 1 and "exists and is not empty" in last.stderr, last.stderr


# --------------------------------------------------------------------------------------
# one rule for "no driver here"


def test_the_venv_preflight_fails_a_box_without_a_driver(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from sglpatch.pythonenv import preflight

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.delenv(preflight.NO_DRIVER_OK, raising=False)
    plan = SimpleNamespace(packages=[SimpleNamespace(name="torch", version="2.9.1+cu128")])
    c = preflight.check_driver(plan)
    assert c.line() == ("preflight: FAIL driver: no NVIDIA driver answers here (nvidia-smi not found): the venv's CUDA 12 "
                        "(from torch 2.9.1+cu128) cannot run on this box; build it where it serves, or set "
                        "SGLPATCH_PREFLIGHT_NO_DRIVER=1 to build it for another box")  # was "skip": the verdict passed
    monkeypatch.setenv(preflight.NO_DRIVER_OK, "1")
    assert preflight.check_driver(plan).ok is None
    cpu = SimpleNamespace(packages=[SimpleNamespace(name="torch", version="2.9.1+cpu")])
    monkeypatch.delenv(preflight.NO_DRIVER_OK)
    assert preflight.check_driver(cpu).ok is None  # a CPU-only plan needs no driver


@pytest.mark.skipif(vp.UV is None, reason="uv not installed (requirements-test.txt installs it)")
def test_no_driver_is_cannot_run_here_for_the_venv_preflight_as_for_the_doctor(env, project_copy, monkeypatch):
    """`apply --venv` on a box where no driver answers exited 1, the doctor 125: both 125 (the
    table's "cannot run here"), also when another condition failed too; a driver too old stays 1."""
    monkeypatch.delenv(preflight.NO_DRIVER_OK, raising=False)
    vp.wheel(env["index"], "torch", "2.9.1+cu128")
    proc = vp.dry_run(env, project_copy, ["torch==2.9.1+cu128"])
    assert proc.returncode == exitcodes.CANNOT_RUN, proc.stdout + proc.stderr
    assert [ln.split(":")[1] for ln in vp.fails(proc)] == [" FAIL driver"]
    assert proc.stderr.strip().splitlines()[-1] == (
        "sglpatch: error: preflight refused: 1 condition(s) failed (the FAIL lines above); nothing was created; "
        f"no NVIDIA driver answers here: cannot run here (exit {exitcodes.CANNOT_RUN})")
    assert "no GPU or driver (also when other checks fail)" in dict(exitcodes.TABLE)[exitcodes.CANNOT_RUN]
    vp.tool(env["fake"], "nvidia-smi", "520.61.05, 12.0")  # a driver, too old: a plain failure
    assert vp.dry_run(env, project_copy, ["torch==2.9.1+cu128"]).returncode == exitcodes.ERROR
