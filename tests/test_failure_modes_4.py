"""Issue 38, first contact in a fourth round: a generated file that blocked every apply, a bisect
that blamed upstream for a typo, an installer that ignored the user's pip settings, and the rough
edges (docs/failure-modes.md, "issue 38"). Real git, real pip, real signals and real processes where
the fault lives there; each test failed before its fix."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import test_failure_modes as fm
import test_venv_preflight as vp
from conftest import ROOT, copy_project, git, make_venv, terminal_sigint
import sglpatch as sglpatch_pkg
from sglpatch import exitcodes
from sglpatch.pythonenv import preflight
from sglpatch.upstream import treecache
from sglpatch.gpu import profile_report
from test_failure_modes import DEP3, DEV, P2_FILE, ok

golden, case = fm.golden, fm.case  # the failure-mode fixtures (built once per session)
env = vp.env  # the venv tests' PATH and local index
VERSION_PY = "python/sglang/_version.py"


def _as_a_build_writes_it(c) -> str:
    """_version.py as setuptools-scm rewrites it when the tree is built without the pinned version
    (the install-deps command apply prints, run in a shell without its variable): the workdir's
    commit and a dev version."""
    f = c.fork / VERSION_PY
    text = f.read_text()
    built = text.replace("__version__ = version = '0.5.9'", "__version__ = version = '0.5.10.dev3+g1a2b3c4'")
    assert built != text
    f.write_text(built)
    return built


def test_the_builds_version_file_never_blocks_apply_nor_is_exported(case):
    _as_a_build_writes_it(case)
    with open(case.project / "series", "a") as s:
        s.write("# a series change that makes apply rebuild\n")
    proc = ok(case.apply())
    assert "uncommitted" not in proc.stderr
    assert f"put back {VERSION_PY}" in proc.stderr  # said, not silent
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    # status does not count it as an edit; export never writes it, alone or next to a real edit
    _as_a_build_writes_it(case)
    st = ok(case.run("status", "--project", str(case.project), "--workdir", str(case.fork)))
    assert "dirty:    0 uncommitted file(s)" in st.stdout and "build output" in st.stdout
    git(case.fork, *DEV, "commit", "-qam", "wip")  # the advice a user followed before: commit, then export
    proc = ok(case.export())
    assert "(wip)" in proc.stderr and "build output, never exported" in proc.stderr and "run `sglpatch apply`" in proc.stderr
    assert not list((case.project / "patches").glob("0003-*")) and "wip" not in (case.project / "series").read_text()
    ok(case.apply())  # the series without it: patched is built again without the commit (kept under refs/sglpatch/backup/)
    assert git(case.fork, "log", "-1", "--format=%s", "patched") != "wip"
    _as_a_build_writes_it(case)
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# tuned\n")
    git(case.fork, *DEV, "commit", "-qam", f"environ: tuned\n\n{DEP3}")
    ok(case.export())
    data = (case.project / "patches" / "0003-environ-tuned.patch").read_text()  # numbered among what is exported
    assert "environ.py" in data and "_version.py" not in data
    ok(case.apply())
    case.in_sync()
    case.outside_clean()


def test_ctrl_c_after_the_build_wrote_the_version_file_leaves_the_tree_clean(case):
    """A real SIGINT to the process group of a real `apply` once pip's build has rewritten
    _version.py (held there by the SGLPATCH_PAUSE_AT barrier): exit 130, and the tree clean."""
    py = make_venv(case.tmp / "t" / "venv")
    barrier = case.tmp / "t" / "pause"
    env = case.env({"SGLPATCH_PAUSE_AT": "install:built", "SGLPATCH_PAUSE_FILE": str(barrier), "PIP_NO_BUILD_ISOLATION": "0",
                    "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG": "0.5.10.dev3"})  # what a build without the pin writes
    env.pop("PYTHONUNBUFFERED", None)  # a minimal shell's: stdout to a pipe is block-buffered
    p = subprocess.Popen([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(case.project), "--workdir", str(case.fork),
                          "--source", "sdist", "--python", str(py), "--installer", "pip"],
                         cwd=case.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                         preexec_fn=terminal_sigint)  # Ctrl-C as from a terminal
    try:
        reached = Path(f"{barrier}.reached")
        deadline = time.monotonic() + 300
        while not reached.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reached.exists(), p.communicate()
        assert VERSION_PY in git(case.fork, "status", "--porcelain", "--untracked-files=no")  # the build rewrote it
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, out
    # one pipe for both streams, as `| tee` sees them: stdout's "patched is up to date" comes before
    # the install, not after "interrupted" (stdout was block-buffered when piped)
    lines = out.rstrip().splitlines()
    assert lines[-1] == "sglpatch: interrupted" and "Traceback" not in out, out
    assert [ln for ln in lines if ln.startswith("patched ")] and lines.index(next(ln for ln in lines if ln.startswith("patched "))) < \
        lines.index(next(ln for ln in lines if ln.startswith("sglpatch: installing")))
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    for f in case.tmp.joinpath("t").glob("pause*"):
        f.unlink()
    shutil.rmtree(case.tmp / "t" / "venv")
    case.runs_pip = True
    case.outside_clean()


# ----------------------------------------------------------------------------------------------
# scripts/*.sh


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
    r = subprocess.run(["bash", str(ROOT / "scripts" / "regress.sh"), "--tier", "kernel", "--python", pair, "--report", str(tmp_path / "r")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == exitcodes.CANNOT_RUN, r.stdout + r.stderr  # no GPUs here; was 2: `--python A,B: no such file`
    assert "no such file" not in r.stderr and (tmp_path / "r" / "report.json").is_file()
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


def test_a_workdir_inside_the_checkout_is_refused_in_one_line(tmp_path):
    """`apply --workdir fork` run in the checkout made a git repository inside it."""
    project = copy_project(tmp_path / "co")
    for wd, cwd in (("fork", project), (str(project / "lines" / "w"), tmp_path)):
        r = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--workdir", wd, "--project", str(project), "--no-install",
                            "--source", "sdist"], cwd=cwd, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
        assert r.returncode == exitcodes.USAGE, r.stdout + r.stderr
        assert r.stderr.strip().splitlines() == [
            f"sglpatch: error: --workdir {wd} is inside the sglpatch checkout {project} (a git repository inside it): "
            "pass a folder outside it, e.g. --workdir ~/sglang-fork; nothing was changed"]
        assert not (project / "fork").exists() and not (project / "lines" / "w").exists()


# ----------------------------------------------------------------------------------------------
# one rule for "no driver here"


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


# ----------------------------------------------------------------------------------------------
# the tool's own venv


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


# ----------------------------------------------------------------------------------------------
# files that are not what they claim


def _sdist(path: Path, pkg_info: bytes) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        member = tarfile.TarInfo("sglang-0.5.9/PKG-INFO")
        member.size = len(pkg_info)
        tf.addfile(member, io.BytesIO(pkg_info))
    return path


def test_a_release_artifact_whose_pkg_info_is_not_utf8_is_one_line(project_copy, tmp_path):
    art = _sdist(tmp_path / "sglang-0.5.9.tar.gz", b"Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.9\nSummary: caf\xe9\n")
    r = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--workdir", str(tmp_path / "fork"),
                        "--venv", str(tmp_path / "new"), "--dry-run", "--release-artifact", str(art), "--python", sys.executable],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120, cwd=tmp_path)
    assert r.returncode == exitcodes.ERROR and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"sglpatch: error: {art}: its PKG-INFO is not UTF-8 text (invalid continuation byte at byte 62): "
        "pass the release's own sdist or wheel (--release-artifact)"]


def test_a_fifo_in_patches_is_refused_not_read_forever(case):
    fifo = case.project / "patches" / "0003-a-fifo.patch"
    os.mkfifo(fifo)
    with open(case.project / "series", "a") as s:
        s.write("0003-a-fifo.patch\n")

    def fix():
        fifo.unlink()
        case.restore("series")

    msg = fm.refused_apply(case, "patches/0003-a-fifo.patch is not a regular file", "regular files", fix=fix)
    assert "\n" not in msg


def test_profile_report_of_a_device_is_refused_not_read_forever(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sglpatch.cli", "profile-report", "/dev/zero"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=60, cwd=tmp_path)
    assert r.returncode == exitcodes.ERROR and r.stderr.strip().splitlines() == [
        "sglpatch: error: /dev/zero: not a regular file (a device, a FIFO or a socket); copy the profile to a file and pass that"]


def test_a_repack_killed_in_the_tree_cache_leaves_no_tmp_pack_for_ever(tmp_path, monkeypatch):
    """A real `git repack -d --window=0` of the cache (as tree_commit runs it), its process group
    SIGKILLed while it writes its pack, leaves tmp_pack_*. The next use of the cache removes such a
    file once it is older than a live repack's (an hour); a young one, which a repack running now may
    be writing, stays."""
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    cg = treecache.cache_repo()
    files = tmp_path / "files"
    files.mkdir()
    for i in range(1500):
        (files / f"f{i}").write_bytes(os.urandom(16384))
    genv = dict(os.environ, GIT_DIR=str(cg.workdir), GIT_WORK_TREE=str(files), GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    subprocess.run(["git", "add", "-A"], env=genv, check=True)
    tree = subprocess.run(["git", "write-tree"], env=genv, check=True, capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit-tree", "-m", "t", tree], env=genv, check=True,
                            capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "update-ref", f"{treecache.TREE_REF}/t", commit], env=genv, check=True)
    pack = cg.workdir / "objects" / "pack"
    r = subprocess.Popen(["git", "repack", "-d", "-q", "--window=0"], cwd=cg.workdir, start_new_session=True)
    deadline = time.monotonic() + 60
    while r.poll() is None and not list(pack.glob("tmp_pack_*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.killpg(r.pid, signal.SIGKILL)
    r.wait()
    left = list(pack.glob("tmp_pack_*"))
    assert left, "the repack finished before it could be killed"
    young = pack / "tmp_pack_young"
    young.write_bytes(b"a live repack's")
    old = time.time() - 2 * 3600
    for p in left:
        os.utime(p, (old, old))
    treecache.cache_repo()
    assert [p.name for p in pack.glob("tmp_pack_*")] == ["tmp_pack_young"]


def test_profile_report_draws_no_verdict_from_a_batch_1_bucket_without_cycles(tmp_path):
    """A by_batch_size bucket "1" with 0 cycles (no batch-1 cycle in that interval) said "speculation is
    SLOWER (0.00x the baseline)": no data, no verdict."""
    rec = {"cycles": 10, "cycle_ms_mean": 20.0, "draft_ms_mean": 5.0, "verify_ms_mean": 10.0, "extend_ms_mean": 5.0,
           "accept_length": 2.5, "baseline_step_ms": 10.0, "tokens": 100.0, "requests": 40.0,
           "by_batch_size": {"1": {"cycles": 0, "cycle_ms_mean": 0.0, "accept_length": 0.0},
                             "4": {"cycles": 10, "cycle_ms_mean": 20.0, "accept_length": 2.5}}}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    s = profile_report.summarize(profile_report.load(path))
    assert list(s["by_batch_size"]) == ["4"] and s["speedup"] is None and s["break_even_accept_length"] is None
    text = profile_report.format_text(str(path), s, profile_report.predictions(s, [2.0]))
    assert "SLOWER" not in text and "verdict" not in text and "no batch-1 cycles" in text, text


# ----------------------------------------------------------------------------------------------
# rerecord.sh: resolutions/R replaced in one step


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("step", ["replace_dir:copied", "replace_dir:swapped", None])
def test_rerecord_replaces_a_folder_in_one_step(tmp_path, step):
    """A real SIGKILL at each step of fsutil.replace_dir (what rerecord.sh now replaces resolutions/R and
    lines/R with): the folder is the old one or the new one, whole; the next call leaves no copy behind.
    rerecord.sh did `rm -rf R; cp -r NEW R`: a kill between left R missing or half copied."""
    dest, new = tmp_path / "resolutions" / "0.5.23", tmp_path / "new"
    for d, v in ((dest, "old"), (new, "new")):
        (d / "sub").mkdir(parents=True)
        (d / "resolutions.toml").write_text(v)
        (d / "sub" / "0001.patch").write_text(v * 1000)
    code = "import sys; from sglpatch.fsutil import replace_dir; replace_dir(sys.argv[1], sys.argv[2])"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), SGLPATCH_TEST_HOOKS="1", **({"SGLPATCH_CRASH_AT": step} if step else {}))
    r = subprocess.run([sys.executable, "-c", code, str(new), str(dest)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == (-signal.SIGKILL if step else 0), r.stderr
    assert _tree(dest) in (_tree(new), {"resolutions.toml": "old", "sub/0001.patch": "old" * 1000})
    assert _tree(dest) == (_tree(new) if step != "replace_dir:copied" else {"resolutions.toml": "old", "sub/0001.patch": "old" * 1000})
    env.pop("SGLPATCH_CRASH_AT", None)
    subprocess.run([sys.executable, "-c", code, str(new), str(dest)], env=env, check=True, timeout=60)
    assert _tree(dest) == _tree(new) and sorted(p.name for p in dest.parent.iterdir()) == ["0.5.23"]
    script = (ROOT / "scripts" / "rerecord.sh").read_text()
    assert 'replace_dir "$new" "$res"' in script and 'rm -rf "$res"' not in script and 'rm -rf "$line"' not in script


# ----------------------------------------------------------------------------------------------
# the README's figures that can be checked


def test_the_readmes_checkable_figures_agree_with_the_tree():
    """The patch count (read from `series`, whatever it is today), the exit-code table (from
    sglpatch.exitcodes) and test.sh's own codes (its header): the README said `[1/4]` with 5 patches,
    and that every scripts/*.sh exits with the table, test.sh included."""
    readme = (ROOT / "README.md").read_text()
    n = len([ln for ln in (ROOT / "series").read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")])
    for m in re.finditer(r"\[(\d+)/(\d+)\]", readme):
        assert int(m.group(2)) == n, f"README.md: {m.group(0)} but the series has {n} patches"
    table = readme[readme.index("## What is in the series"):]
    table = table[: table.index("\n\n", table.index("|---|"))]
    assert len(re.findall(r"^\| P\d+ \|", table, re.M)) == n, "README.md's series table has a row per patch"
    assert "\n".join("    " + line for line in exitcodes.lines()) in readme
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    codes = re.findall(r"^#   (\d+)  ", test_sh[test_sh.index("# exit codes (pytest's"):], re.M)
    said = readme[readme.index("`scripts/test.sh` is the exception"):].split("\n\n")[0]
    assert codes and all(f"{c} " in said for c in codes), (codes, said)
    assert "but test.sh" in exitcodes.lines()[0]
    assert "builds two venvs" in readme
