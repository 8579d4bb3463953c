"""A new user's first contact, through scripts/*.sh in a fresh shell (issue 22): no venv on PATH
(only /usr/bin:/bin), HOME an empty temp dir (no ~/ml-env, no ~/sglang-fork), the system's own
Python (Debian's, externally managed), the real sdist and the real package index.

The tool's own venv is made once for this module, by the first script that needs it, exactly as
a new user's first `scripts/watch.sh --help` makes it (SGLPATCH_TOOL_VENV points it at a temp
dir; pip installs from the configured index). The download cache is the test session's
($SGLPATCH_CACHE), so the sdist is not fetched again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT
from sglpatch import exitcodes

SCRIPTS = ROOT / "scripts"
FRESH_PATH = "/usr/bin:/bin"
SYSTEM_PY = Path("/usr/bin/python3")
OWN_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.sh") if p.name not in ("lib.sh", "test.sh", "mutants.sh"))


def _system_python_usable() -> bool:
    if not SYSTEM_PY.is_file():
        return False
    code = "import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))"
    return subprocess.run([str(SYSTEM_PY), "-c", code], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _system_python_usable(), reason="needs /usr/bin/python3 >= 3.10 with venv and ensurepip")


def fresh_env(home: Path, tool_venv: Path, **extra: str) -> dict:
    env = {"PATH": FRESH_PATH, "HOME": str(home), "SGLPATCH_TOOL_VENV": str(tool_venv), "SGLPATCH_CACHE": os.environ["SGLPATCH_CACHE"]}
    env.update(extra)
    return env


def run_fresh(cmd: list, home: Path, tool_venv: Path, cwd: Path | None = None, timeout: float = 600, **extra: str):
    return subprocess.run([str(c) for c in cmd], cwd=cwd or home, env=fresh_env(home, tool_venv, **extra),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    """The tool venv, made by a first `scripts/watch.sh --help` in a fresh shell."""
    base = tmp_path_factory.mktemp("fresh")
    venv, home = base / "tool-venv", base / "home"
    home.mkdir()
    t0 = time.monotonic()
    proc = run_fresh(["bash", SCRIPTS / "watch.sh", "--help"], home, venv)
    return SimpleNamespace(venv=venv, setup=proc, seconds=time.monotonic() - t0, sglpatch=venv / "bin" / "sglpatch")


@pytest.fixture
def home(tmp_path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# ----------------------------------------------------------------------------- 1: the tool venv


def test_watch_help_in_a_fresh_shell_sets_up_the_tool_venv_once(tool, home):
    setup = tool.setup
    assert setup.returncode == 0 and "Traceback" not in setup.stderr, setup.stderr
    assert f"watch.sh: setting up the sglpatch tool in {tool.venv} (first use" in setup.stderr
    assert "Options (those of `sglpatch watch`):" in setup.stdout and "--releases" in setup.stdout
    assert setup.stdout.rstrip().endswith(exitcodes.lines()[-1])
    # the tool's dependencies are in its venv, from this checkout (editable)
    probe = "import git, psutil, unidiff, pyflakes, packaging, pytest, sglpatch; print(sglpatch.__file__)"
    out = subprocess.run([tool.venv / "bin" / "python", "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == str(ROOT / "src" / "sglpatch" / "__init__.py"), out.stderr
    # a second run uses it as it is: no set-up line, the same help
    t0 = time.monotonic()
    again = run_fresh(["bash", SCRIPTS / "watch.sh", "--help"], home, tool.venv)
    assert again.returncode == 0 and again.stderr == "" and again.stdout == setup.stdout
    assert time.monotonic() - t0 < 15


def test_a_tool_venv_without_its_stamp_is_set_up_again(tool, home, tmp_path):
    """The stamp (checkout + pyproject.toml digest) is written last: an interrupted or outdated set-up is redone."""
    assert tool.setup.returncode == 0
    stamp = tool.venv / ".sglpatch-tool"
    key = stamp.read_text()
    stamp.write_text("an older pyproject.toml\n")
    proc = run_fresh(["bash", SCRIPTS / "export.sh", "--help"], home, tool.venv)
    assert proc.returncode == 0 and "setting up the sglpatch tool" in proc.stderr, proc.stderr
    assert stamp.read_text() == key


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh") if p.name != "lib.sh"))
def test_every_script_help_works_in_a_fresh_shell(script, tool, home):
    assert tool.setup.returncode == 0
    proc = run_fresh(["bash", SCRIPTS / script, "--help"], home, tool.venv)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert f"scripts/{script}" in proc.stdout
    if script in OWN_SCRIPTS:  # one exit-code table, printed from sglpatch.exitcodes
        assert "\n".join(exitcodes.lines()) in proc.stdout, proc.stdout


def test_python_m_sglpatch_without_the_tools_dependencies_is_one_line(tmp_path, home):
    bare = tmp_path / "bare"
    subprocess.run([SYSTEM_PY, "-m", "venv", "--without-pip", bare], check=True)
    proc = subprocess.run([bare / "bin" / "python", "-m", "sglpatch", "status"], cwd=home, capture_output=True, text=True,
                          env={"PATH": FRESH_PATH, "HOME": str(home), "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == exitcodes.CANNOT_RUN
    line = one_line(proc)
    assert line.startswith("sglpatch: error: ") and "lacks 'GitPython'" in line and f"{ROOT}/scripts/*.sh" in line


# ----------------------------------------------------------------------------- 5: --python checked


def _not_pythons(tmp_path: Path) -> dict:
    text = tmp_path / "notes.txt"
    text.write_text("not a program\n")
    liar = tmp_path / "python3"
    liar.write_text("#!/bin/sh\nexit 1\n")
    liar.chmod(0o755)
    return {"missing": "/nonexistent", "directory": str(tmp_path), "text file": str(text), "not a python": str(liar)}


@pytest.mark.parametrize("what", ["missing", "directory", "text file", "not a python"])
@pytest.mark.parametrize("how", ["apply.sh", "apply.sh=", "regress.sh", "sglpatch apply", "sglpatch regress"])
def test_a_python_that_is_not_one_is_one_line_exit_2(how, what, tool, home, tmp_path):
    assert tool.setup.returncode == 0
    bad = _not_pythons(tmp_path)[what]
    wd = tmp_path / "wd"
    cmd = {
        "apply.sh": ["bash", SCRIPTS / "apply.sh", "--python", bad, "--workdir", wd],
        "apply.sh=": ["bash", SCRIPTS / "apply.sh", f"--python={bad}", "--no-install", "--workdir", wd],
        "regress.sh": ["bash", SCRIPTS / "regress.sh", "--tier", "cpu", "--python", bad],
        "sglpatch apply": [tool.sglpatch, "apply", "--project", ROOT, "--workdir", wd, "--python", bad, "--no-install"],
        "sglpatch regress": [tool.sglpatch, "regress", "--project", ROOT, "--tier", "cpu", "--python", bad],
    }[how]
    proc = run_fresh(cmd, home, tool.venv)
    assert proc.returncode == exitcodes.USAGE, proc.stdout + proc.stderr
    assert f"--python {bad}: " in one_line(proc)
    assert not wd.exists() and not list(home.glob("regress-*"))  # checked before any work, nothing written


# ----------------------------------------------------------------------------- 2: what goes into which Python


def test_apply_without_a_serving_python_refuses_before_any_work(tool, home, tmp_path):
    assert tool.setup.returncode == 0
    wd = tmp_path / "wd"
    proc = run_fresh(["bash", SCRIPTS / "apply.sh", "--source", "sdist", "--workdir", wd], home, tool.venv)
    assert proc.returncode == exitcodes.USAGE
    line = one_line(proc)
    assert "no Python to install into" in line and all(opt in line for opt in ("--python PATH", "--venv NEWDIR", "--no-install"))
    assert not wd.exists()


def test_apply_refuses_the_systems_own_python_before_any_work(tool, home, tmp_path):
    """No PEP 668 failure after the build: the externally managed system Python is refused first."""
    managed = subprocess.run([SYSTEM_PY, "-c", "import os, sysconfig; print(os.path.isfile(os.path.join(sysconfig.get_paths()['stdlib'], "
                              "'EXTERNALLY-MANAGED')))"], capture_output=True, text=True).stdout.strip()
    if managed != "True":
        pytest.skip(f"{SYSTEM_PY} is not externally managed here")
    wd = tmp_path / "wd"
    proc = run_fresh(["bash", SCRIPTS / "apply.sh", "--python", SYSTEM_PY, "--source", "sdist", "--workdir", wd], home, tool.venv)
    assert proc.returncode == exitcodes.USAGE, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "externally managed, PEP 668" in errors[0] and "externally-managed-environment" not in proc.stderr
    assert not wd.exists()


def test_the_tools_own_venv_is_never_the_serving_python(tool, home, tmp_path):
    """`.tool-venv/bin/sglpatch apply` without --python would install into the tool's venv: refused."""
    wd = tmp_path / "wd"
    proc = run_fresh([tool.sglpatch, "apply", "--project", ROOT, "--workdir", wd, "--source", "sdist"], home, tool.venv)
    assert proc.returncode == exitcodes.USAGE, proc.stdout + proc.stderr
    assert f"{tool.venv} is the sglpatch tool's own venv, not a serving Python; pass --python PATH" in one_line(proc)
    assert not wd.exists()


def _packages(python: Path) -> dict:
    out = subprocess.run([python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"], capture_output=True, text=True,
                         env={"PATH": FRESH_PATH, "PIP_NO_INDEX": "1"}, check=True).stdout
    return {p["name"].lower(): p.get("editable_project_location") for p in json.loads(out)}


@pytest.fixture(scope="module")
def applied(tool, tmp_path_factory):
    """A fresh venv (nothing but pip) that scripts/apply.sh installed the patched tree into."""
    base = tmp_path_factory.mktemp("applied")
    home, venv, wd = base / "home", base / "serving-venv", base / "sglang-fork"
    home.mkdir()
    subprocess.run([SYSTEM_PY, "-m", "venv", venv], check=True)
    py = venv / "bin" / "python"
    before = _packages(py)
    no_install = run_fresh(["bash", SCRIPTS / "apply.sh", "--python", py, "--workdir", wd, "--source", "sdist", "--no-install"],
                           home, tool.venv)
    after_no_install = _packages(py)
    proc = run_fresh(["bash", SCRIPTS / "apply.sh", "--python", py, "--workdir", wd, "--source", "sdist"], home, tool.venv)
    return SimpleNamespace(home=home, py=py, wd=wd, before=before, no_install=no_install, after_no_install=after_no_install,
                           proc=proc, after=_packages(py))


def test_apply_puts_only_the_patched_sglang_into_the_serving_python(applied):
    assert applied.no_install.returncode == 0, applied.no_install.stderr
    assert applied.after_no_install == applied.before  # --no-install: nothing at all
    assert "--no-install: nothing is installed anywhere" in applied.no_install.stderr
    assert applied.proc.returncode == 0, applied.proc.stdout + applied.proc.stderr
    added = {k: v for k, v in applied.after.items() if k not in applied.before}
    assert added == {"sglang": str(applied.wd / "python")}  # editable, --no-deps: no GitPython, psutil, packaging ...
    assert {k: v for k, v in applied.after.items() if k in applied.before} == applied.before  # nothing upgraded
    recorded = subprocess.run(["git", "-C", applied.wd, "config", "--get", "sglpatch.installed-python"], capture_output=True, text=True)
    assert recorded.stdout.strip() == str(applied.py)


def test_a_fresh_venv_is_told_the_exact_command_for_sglangs_own_dependencies(applied):
    out = applied.proc.stdout
    tree = applied.wd / "python"
    assert f"warning: {applied.py} cannot import sglang yet: ModuleNotFoundError: No module named " in out
    assert "declared dependencies is installed (" in out  # none of them: the venv is fresh
    cmd = f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG=0.5.9 {applied.py} -m pip install -e {tree}"
    then = f" && sglpatch apply --with-flashinfer --python {applied.py} --workdir {applied.wd}"  # P5's flashinfer pin: the set completed
    assert f"install SGLang 0.5.9's own dependencies: {cmd}{then}\n" in out
    assert "scripts/apply.sh --venv NEWDIR" in out
    # it is apply's own install command without --no-deps
    assert f"installing: {applied.py} -m pip install --no-deps --disable-pip-version-check -e {tree}" in applied.proc.stderr


# ----------------------------------------------------------------------------- 3: regress --tier cpu without ~/ml-env


def _report(cwd: Path) -> Path:
    found = list(cwd.glob("regress-*"))
    assert len(found) == 1 and (found[0] / "report.md").is_file() and (found[0] / "report.json").is_file(), found
    return found[0]


@pytest.mark.parametrize("how", ["recorded by apply", "--python"])
def test_regress_cpu_takes_the_python_apply_installed_into_and_says_what_is_missing(how, applied, tool, tmp_path):
    args = ["--workdir", applied.wd] if how == "recorded by apply" else ["--python", applied.py, "--workdir", tmp_path / "none"]
    proc = run_fresh(["bash", SCRIPTS / "regress.sh", "--tier", "cpu", *args], applied.home, tool.venv, cwd=tmp_path)
    assert proc.returncode == exitcodes.CANNOT_RUN, proc.stdout + proc.stderr  # bisect skips, not "bad"
    out = proc.stdout
    assert "tier cpu: cannot_run: sglang's dependencies missing in" in out and "install the patched tree first" not in out
    assert "No module named" in out and "declared dependencies is installed" in out
    assert f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG=0.5.9 {applied.py} -m pip install -e {applied.wd / 'python'}" in out
    assert ("the Python `apply` installed" in out) == (how == "recorded by apply") and ("(--python)" in out) == (how == "--python")
    assert "cannot_run" in json.loads((_report(tmp_path) / "report.json").read_text())["status"]


def test_regress_cpu_without_ml_env_cannot_run_here(tool, home, tmp_path):
    """No --python, nothing recorded (HOME is empty), the profile's ~/ml-env is not there: 125, one reason."""
    proc = run_fresh(["bash", SCRIPTS / "regress.sh", "--tier", "cpu"], home, tool.venv, cwd=tmp_path)
    assert proc.returncode == exitcodes.CANNOT_RUN and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"{home}/ml-env/bin/python3 (the profile's [cpu] python) does not exist: pass --python PATH" in proc.stdout
    assert "no such file" not in proc.stderr.lower()
    assert "does not exist" in (_report(tmp_path) / "report.md").read_text()


@pytest.mark.parametrize("tier", [["--tier", "kernel"], []])
def test_regress_kernel_without_ml_env_cannot_run_here_and_blames_no_python_option(tier, tool, home, tmp_path):
    """Issue 28, fault 7: the profile's [kernel] python is missing and no --python was given: 125, not
    exit 2 blaming a --python the user never gave (no --tier runs all three: the same)."""
    proc = run_fresh(["bash", SCRIPTS / "regress.sh", *tier], home, tool.venv, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == exitcodes.CANNOT_RUN and "Traceback" not in out, out
    assert ("tier kernel: cannot_run: the profile's [kernel] python ~/ml-env/bin/python3 is not on this machine: "
            "give --python PATH (a Python with torch and sglang) or set [kernel] python in the profile") in proc.stdout
    assert "--python: " not in out and "sglpatch: error" not in out


def test_doctor_sh_runs_the_tools_venv_not_the_system_python(tool, home, tmp_path):
    """Issue 28, fault 6: the system python3 has no psutil; doctor.sh runs the tool venv's python."""
    proc = run_fresh(["bash", SCRIPTS / "doctor.sh", "--no-p2p"], home, tool.venv, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out
    assert proc.returncode in (exitcodes.ERROR, exitcodes.CANNOT_RUN) and "\ndoctor: " in out, out
    bad = run_fresh(["bash", SCRIPTS / "doctor.sh", "--kil-stale"], home, tool.venv, cwd=tmp_path)
    assert bad.returncode == exitcodes.USAGE and "Traceback" not in bad.stdout + bad.stderr, bad.stderr
    assert "--kil-stale" in bad.stderr


# ----------------------------------------------------------------------------- 7: wording, rebase in a fresh shell


def test_rebase_dry_run_onto_a_wheel_only_release_names_the_wheel(tool, home, tmp_path):
    proc = run_fresh(["bash", SCRIPTS / "rebase.sh", "--onto", "0.5.23", "--dry-run", "--workdir", tmp_path / "none"], home, tool.venv)
    assert proc.returncode in (exitcodes.OK, exitcodes.HUMAN), proc.stdout + proc.stderr  # rebase.sh defaults to --source sdist
    assert "ready from wheel (the registry has no sdist of 0.5.23)" in proc.stderr and "ready from sdist" not in proc.stderr
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("verdict: ") and verdict.endswith(f"(exit {proc.returncode})")


def test_rebase_onto_a_release_that_does_not_exist_names_the_nearest(tool, home, tmp_path):
    from sglpatch.upstream import pkgindex

    proc = run_fresh(["bash", SCRIPTS / "rebase.sh", "--onto", "0.5.99", "--dry-run", "--workdir", tmp_path / "none"], home, tool.venv)
    assert proc.returncode == exitcodes.USAGE, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sglpatch: error:")]
    from packaging.version import Version

    known = pkgindex.releases("sglang")
    below, above = [r for r in known if Version(r) < Version("0.5.99")][-2:], [r for r in known if Version(r) > Version("0.5.99")][:2]
    newest = f" ({below[-1]} is the newest)" if not above else ""
    assert errors == [f"sglpatch: error: sglang 0.5.99 is not a release on the index; the nearest: {', '.join(below + above)}{newest}"]


# ----------------------------------------------------------------------------- 8: "Move the server" (issue 27; docs/rebase.md since issue 51)


def _readme_move_block() -> list[str]:
    text = (ROOT / "docs" / "rebase.md").read_text()  # moved there from the README (issue 51), the README links it
    part = text.split("**Move the server to a new release**", 1)[1]
    block = part.split("\n\n    ", 1)[1].split("\n\n", 1)[0]
    return [ln.split("#", 1)[0].split() for ln in ("    " + block).splitlines()]


def test_readme_move_the_server_is_the_watch_then_one_command(tool, home, tmp_path):
    """The documented move to 0.5.23 (docs/rebase.md), typed in a fresh shell: the watch names the line and its command,
    then `scripts/apply.sh --line 0.5.23 --venv ~/ml-env-0.5.23 --dry-run` plans the new venv from
    lines/0.5.23/ (the real wheel's pins, resolved on the real index). The watch is limited to
    0.5.23 (the whole matrix fetches 206 MB); the checkout's files stay as they are."""
    import hashlib

    watch, apply = _readme_move_block()
    assert watch == ["scripts/watch.sh"]
    assert apply == ["scripts/apply.sh", "--line", "0.5.23", "--venv", "~/ml-env-0.5.23", "--dry-run"]
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))  # requirements-test.txt installs it
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "uv").symlink_to(uv)  # the user's ~/.local/bin/uv (USER-CONTEXT); not on PATH
    files = ("series", "upstream.lock", *(f"patches/{n}" for n in sorted(p.name for p in (ROOT / "patches").iterdir())))
    before = {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest() for f in files}
    w = run_fresh(["bash", ROOT / watch[0], "--releases", "0.5.23"], home, tool.venv, cwd=ROOT, timeout=1200)
    assert w.returncode == exitcodes.OK, w.stdout[-3000:] + w.stderr[-3000:]
    assert "line 0.5.23 in the checkout (lines/0.5.23/, 2 patches: P1 P4): scripts/apply.sh --line 0.5.23 --venv NEWDIR" in w.stdout
    cmd = ["bash", ROOT / apply[0], *[a.replace("~", str(home), 1) if a.startswith("~") else a for a in apply[1:]]]
    # uv with the machine's certificate store, as /etc/pip.conf's `cert` gives pip (a TLS proxy here)
    a = run_fresh(cmd, home, tool.venv, cwd=ROOT, timeout=1200, UV_SYSTEM_CERTS="1")
    out = a.stdout
    assert f"resolved by: {home}/.local/bin/uv pip compile " in out, out[-3000:]  # the user's uv, found without PATH
    assert "Traceback" not in out + a.stderr and "sglang 0.5.23: " in a.stderr, a.stderr[-3000:]
    assert "requirements from sglang-0.5.23-" in a.stderr
    pins = out.split("the release's pins: ", 1)[1].split("\n", 1)[0] + " "
    assert " torch==2.14.1 " in f" {pins}" and " sglang-kernel==0.4.10 " in f" {pins}", pins
    verdict = out.strip().splitlines()[-1]
    # a refusal is 1, or 125 when the refusal is that no driver answers here (the doctor's rule, issue 38)
    want = 0 if verdict.endswith("pass") else exitcodes.CANNOT_RUN if "no NVIDIA driver answers here" in a.stderr else 1
    assert verdict.startswith("preflight: verdict: ") and a.returncode == want, out[-2000:]
    assert not (home / "ml-env-0.5.23").exists() and not (home / "sglang-fork").exists()  # a dry run: nothing made
    assert {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest() for f in files} == before
