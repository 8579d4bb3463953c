"""What a new user meets first, through the installed console script (`sglpatch` on PATH),
`python -m sglpatch` and scripts/*.sh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SERIES, git
from sglpatch import __version__
from sglpatch.upstream.pin import read_lock, write_lock

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
    assert "--source {auto,git,registry,sdist,wheel}" in apply_help and "(default: auto: what you serve" in apply_help
    assert "--probe-timeout SEC" in apply_help and "(default: 8.0)" in apply_help
    check_help = " ".join(cli("check", "--help").stdout.split())
    assert "the release's artifact on the package index" in check_help and "(default: registry: a CI gate needs no network)" in check_help
    regress_help = " ".join(cli("regress", "--help").stdout.split())
    assert "allreduce" in regress_help and "(default: all)" in regress_help
    bisect_help = cli("bisect", "--help").stdout
    assert "--report-dir DIR" in bisect_help and "--log-dir" not in bisect_help and "<workdir>/.git/sglpatch-bisect" in " ".join(bisect_help.split())
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
    assert "source: sdist" in proc.stderr and f"[1/{len(SERIES)}]" in proc.stderr
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


# ----------------------------------------------------------------------------- one exit-code table (issue 22)


def _commands() -> list[str]:
    from sglpatch.cli import build_parser

    return sorted(build_parser()[1])


def test_the_exit_code_table_is_in_every_help_and_the_readme():
    from sglpatch import exitcodes

    table = "\n".join(exitcodes.lines())
    assert table in cli("--help").stdout
    for command in _commands():
        assert table in cli(command, "--help").stdout, command
    regress_m = subprocess.run([sys.executable, "-m", "sglpatch.gpu.regress", "--help"], capture_output=True, text=True)
    assert table in regress_m.stdout
    readme = (ROOT / "README.md").read_text()
    assert "\n".join("    " + line for line in exitcodes.lines()) in readme, "README.md's exit-code table differs from sglpatch.exitcodes"
    assert [code for code, _ in exitcodes.TABLE] == sorted({0, 1, 2, 3, 125, 130})


def test_exit_codes_are_numbers_only_in_exitcodes():
    """Every other module names them (exitcodes.USAGE ...): no literal exit code elsewhere."""
    import ast

    for path in sorted((ROOT / "src" / "sglpatch").rglob("*.py")):
        if path.name == "exitcodes.py" or path.parts[-2:] == ("kernel", "bench.py") or "microbench" in path.parts:
            continue  # kernel_bench and its microbench/ package: a torchrun worker's own status (EXIT_HANG)
        for node in ast.walk(ast.parse(path.read_text())):
            literal = None
            if isinstance(node, ast.keyword) and node.arg == "exit_code":
                literal = node.value
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                names += [t.attr for t in targets if isinstance(t, ast.Attribute)]
                if any(n == "exit_code" or n.startswith("EXIT_") for n in names):
                    literal = node.value
            if literal is None:
                continue
            values = literal.elts if isinstance(literal, ast.Tuple) else [literal]
            for v in values:
                if isinstance(v, ast.Constant) and isinstance(v.value, int):
                    where = path.relative_to(ROOT / "src" / "sglpatch").as_posix()
                    assert (where, v.value) == ("bisect/model.py", 255), f"{path.relative_to(ROOT)}:{v.lineno}: exit code {v.value} written as a number"


@pytest.mark.parametrize("args", [("status",), ("export",), ("check",), ("watch",), ("rebase", "--onto", "0.5.10", "--dry-run"), ("regress",)])
def test_no_project_here_is_a_usage_error_for_every_command(args, tmp_path):
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglpatch: error: no sglpatch project here"), proc.stderr
    assert not list(tmp_path.iterdir())


def test_a_usage_error_is_2_and_an_interrupt_130(tmp_path):
    import signal
    import socket
    import time

    from sglpatch import exitcodes

    assert cli("apply", "--no-such-option").returncode == exitcodes.USAGE
    with socket.socket() as silent:  # accepts and never answers: the source probe waits on it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"https://127.0.0.1:{silent.getsockname()[1]}/sglang"
        proc = subprocess.Popen([shutil.which("sglpatch"), "apply", "--project", str(ROOT), "--workdir", str(tmp_path / "wd"), "--no-install",
                                 "--upstream-url", url, "--probe-timeout", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                # as from a terminal's foreground: SIGINT not ignored, also when the suite
                                # itself runs in the background (a shell's `&` ignores SIGINT for it)
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        # Ctrl-C once the probe waits on the socket (not after a fixed sleep: on a loaded machine the
        # start-up alone can take longer), in a terminal: the whole foreground group
        silent.settimeout(60)
        conn, _ = silent.accept()
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # git dies at once; sglpatch returns after the probe timeout (GitPython)
        conn.close()
    assert proc.returncode == exitcodes.INTERRUPTED and err.strip().splitlines()[-1] == "sglpatch: interrupted", err


# ----------------------------------------------------------------------------- tier cpu: broken import vs missing dependencies


def _fake_site(tmp_path: Path) -> Path:
    """Two importable packages with real dist-info metadata: one whose own code imports a submodule
    that is gone (a patch broke it), one that needs a dependency that is not installed."""
    site = tmp_path / "site"
    (site / "fakebroken").mkdir(parents=True)
    (site / "fakebroken" / "__init__.py").write_text("from fakebroken import gone  # noqa\n")
    (site / "fakedeps").mkdir()
    (site / "fakedeps" / "__init__.py").write_text("import absent_dep_for_sglpatch_tests  # noqa\n")
    info = site / "fakedeps-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakedeps\nVersion: 1.0\n"
        "Requires-Dist: absent-dep-for-sglpatch-tests>=1\nRequires-Dist: pytest\n"
        'Requires-Dist: only-with-an-extra ; extra == "x"\nRequires-Dist: only-on-python2 ; python_version < "3"\n'
    )
    (info / "direct_url.json").write_text(json.dumps({"url": f"file://{tmp_path}/tree/python", "dir_info": {"editable": True}}))
    return site


@pytest.mark.parametrize("module", ["fakebroken", "fakedeps"])
def test_tier_cpu_tells_a_broken_import_from_missing_dependencies(module, tmp_path):
    from sglpatch.gpu import regress

    site = _fake_site(tmp_path)
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests" / "patches").mkdir(parents=True)
    (proj / "tests" / "patches" / "test_p.py").write_text("def test_ok(): pass\n")
    (proj / "targets" / "t.toml").write_text(f'[env]\nPYTHONPATH = "{site}"\n[cpu]\nimport_check = "{module}"\ntimeout_s = 60\n')
    res = regress.run_regress("cpu", "t", str(tmp_path / "r"), str(proj), python=sys.executable)
    name, status, summary, failures, why = res["tiers"][0]
    if module == "fakebroken":  # the module's own code: a regression, bisect marks it bad
        assert res["exit_code"] == 1 and status == "fail" and "cannot import name 'gone'" in failures[0], res
    else:  # the environment: cannot run here, bisect skips; says what is missing and the command
        assert res["exit_code"] == 125 and status == "cannot_run", res
        assert "1 of its 2 declared dependencies are not installed (absent-dep-for-sglpatch-tests missing)" in why
        assert f"-m pip install -e {tmp_path}/tree/python" in why or f"pip install --python {sys.executable} -e {tmp_path}/tree/python" in why
        assert "No module named 'absent_dep_for_sglpatch_tests'" in why


def test_regress_leaves_no_empty_report_folder_when_it_stops_early(tmp_path):
    """A usage error found while a tier starts (after the folder was made) removes the empty folder."""
    from sglpatch.errors import SglpatchError
    from sglpatch.gpu import regress

    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests" / "patches").mkdir(parents=True)
    (proj / "targets" / "t.toml").write_text('[kernel]\ndevice = "cpu"\n')
    with pytest.raises(SglpatchError, match="--with-profile"):  # read (and refused) inside the kernel tier
        regress.run_regress("kernel", "t", str(tmp_path / "r"), str(proj), with_profile=str(tmp_path / "no-report"))
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- wording (issue 22)


def test_a_recorded_resolution_that_misfits_is_not_told_about_apply(tmp_path):
    """The watch's details said 'apply requires an exact fit to the pinned tree' where apply is not what ran."""
    import re

    from conftest import copy_project
    from sglpatch.watch import matrix

    project = copy_project(tmp_path / "project")
    shutil.rmtree(project / "resolutions" / "0.5.23")  # the newest's own records would answer first
    port = project / "resolutions" / "0.5.10.post1" / "0002-pcie-custom-allreduce.patch"
    text = port.read_text()
    shifted = re.sub(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@", lambda m: f"@@ -{int(m[1]) + 7},{m[2]} +{int(m[3]) + 7},{m[4]} @@", text,
                     count=1, flags=re.M)
    assert shifted != text
    port.write_text(shifted)
    cell = matrix.run(project, "0.5.10")["rows"][0]["cells"]["0002-pcie-custom-allreduce.patch"]
    notes = [d for d in cell["details"] if "the recorded resolution no longer applies" in d]
    assert notes and "needs an offset of -7 lines" in notes[0], cell
    assert "a recorded resolution must fit the new upstream exactly: re-record it (scripts/rerecord.sh VERSION)" in notes[0]
    assert "apply requires" not in " ".join(cell["details"])


# ----------------------------------------------------------------------------- README first contact (issue 22)


def prose_sentences(text: str) -> list[str]:
    """The sentences of a markdown text's prose (paragraphs and list items); code blocks, tables and
    headings are left out, an inline code span counts as one word."""
    import re

    paras, cur, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or (line.startswith("    ") and not cur) or line.startswith(("|", "#")) or not line.strip():
            if cur:
                paras.append(" ".join(cur))
            cur = []
            continue
        if re.match(r"\s*([-*]|\d+\.)\s", line) and cur:  # a list item starts a sentence of its own
            paras.append(" ".join(cur))
            cur = []
        cur.append(line.strip())
    if cur:
        paras.append(" ".join(cur))
    out = []
    for p in paras:
        p = re.sub(r"`[^`]*`", "CODE", p)
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(*\"]|CODE)", p) if s.strip()]
    return out


@pytest.mark.parametrize("doc, floor", [("README.md", 30), ("docs/on-the-box.md", 60)])
def test_readme_sentences_are_short(doc, floor):
    """The README (a five-minute read since issue 51; its details moved to docs/) and the runbook."""
    sentences = prose_sentences((ROOT / doc).read_text())
    assert len(sentences) > floor  # the splitter sees the prose
    long = [f"{len(s.split())} words: {s[:120]}" for s in sentences if len(s.split()) > 40]
    assert not long, "\n".join(long)


def test_readme_first_contact_says_what_where_and_what_is_needed():
    readme = (ROOT / "README.md").read_text()
    first = readme[: readme.index("## What is in the series")]
    # what the tool does comes before the jargon
    assert first.index("**What it does.**") < first.index("quilt-compatible")
    for needed in ("git", "Python >= 3.10", "uv is optional", "package index"):
        assert needed in first, needed
    assert "git clone" in first and "cd sglpatch" in first
    for where in ("`~/sglang-fork`", "`~/.cache/sglpatch`", "`$SGLPATCH_CACHE`", "206 MB", "`.tool-venv`", "`$SGLPATCH_TOOL_VENV`",
                  "5.9 GB", "`$SGLPATCH_TEST_VENV`"):
        assert where in first, where
    # what apply.sh does to which Python: three short lines
    bullets = first[first.index("**What `apply.sh` does to which Python:**"):].split("\n\n")[1].splitlines()
    assert len(bullets) == 3 and all(b.startswith("- ") and len(b.split()) <= 25 for b in bullets), bullets
    assert "refusal comes before any progress line" not in readme  # the source probe prints first; the claim is now exact


def test_readme_names_the_tool_venv_the_scripts_really_use():
    lib = (ROOT / "scripts" / "lib.sh").read_text()
    assert 'TOOL_VENV="${SGLPATCH_TOOL_VENV:-$SGLPATCH_HOME/.tool-venv}"' in lib
    from sglpatch.pythonenv.interpreter import TOOL_VENV_STAMP

    assert f'TOOL_STAMP="{TOOL_VENV_STAMP}"' in lib
