"""sglpatch bisect: real 0.5.9 tree from the sdist, real `git bisect run`, real signals.

One session-wide workdir holds a private series of N small real patches (each adds one marker
line to a different sglang file). A test CMD (a small script) fails exactly when patch k's
marker is in the tree, so bisect must name patch k; it also records every run so the number of
CMD runs is checked against the bound ceil(log2(N+1)) + 2.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, git, sglpatch

from sglpatch import bisect
from sglpatch.bisect import driver, report as bisect_report
from sglpatch.stack import build
from sglpatch.errors import SglpatchError

N = 5
FILES = [
    "python/sglang/version.py",
    "python/sglang/utils.py",
    "python/sglang/global_config.py",
    "python/sglang/lang/api.py",
    "python/sglang/srt/environ.py",
]
BOUND = math.ceil(math.log2(N + 1)) + 2


def _mark(k: int) -> str:
    return f"SGLPATCH_BISECT_TEST_MARK_{k} = {k}"


@pytest.fixture(scope="session")
def bisect_project(tmp_path_factory, sdist_059) -> tuple[Path, Path, list[str]]:
    """(project, workdir template, series names): N real patches applied by sglpatch apply."""
    base = tmp_path_factory.mktemp("bisect")
    project = base / "project"
    (project / "patches").mkdir(parents=True)
    shutil.copy2(ROOT / "upstream.lock", project / "upstream.lock")
    (project / "series").write_text("")
    wd = base / "wd"
    build.apply(project, wd, source="sdist")  # upstream only (empty series)
    scratch = base / "scratch"
    git(base, "clone", "-q", "--branch", "upstream", str(wd), str(scratch))
    env = dict(
        os.environ,
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="Test Author",
        GIT_AUTHOR_EMAIL="test@example.com",
        GIT_AUTHOR_DATE="2026-01-02T03:04:05+00:00",
        GIT_COMMITTER_NAME="Test Author",
        GIT_COMMITTER_EMAIL="test@example.com",
        GIT_COMMITTER_DATE="2026-01-02T03:04:05+00:00",
    )
    names = []
    for k, rel in enumerate(FILES, 1):
        path = scratch / rel
        path.write_text(path.read_text() + f"{_mark(k)}\n")
        message = (
            f"test: marker {k} in {Path(rel).name}\n\n"
            f"Description: bisect test patch {k}\n"
            f" adds {_mark(k)} to {rel}\n"
            "Origin: vendor, sglpatch tests\n"
            "Forwarded: not-needed\n"
            "Last-Update: 2026-01-02\n"
        )
        subprocess.run(["git", "commit", "-q", "-a", "-F", "-"], cwd=scratch, input=message, text=True, env=env, check=True)
        data = subprocess.run(
            ["git", "format-patch", "--stdout", "--zero-commit", "--no-signature", "--full-index", "-1", "HEAD"],
            cwd=scratch, capture_output=True, env=env, check=True,
        ).stdout
        name = f"{k:04d}-test-marker-{k}.patch"
        (project / "patches" / name).write_bytes(data)
        names.append(name)
    (project / "series").write_text("# bisect test series\n" + "".join(f"{n}\n" for n in names))
    build.apply(project, wd, source="sdist")
    assert len(git(wd, "rev-list", "upstream..patched").split()) == N
    return project, wd, names


@pytest.fixture
def workdir(bisect_project, tmp_path) -> Path:
    """A private copy of the session workdir (the tests that may break it get their own)."""
    src, dest = bisect_project[1], tmp_path / "wd"
    # hard-link git's objects (never rewritten in place), copy the rest: ~2x faster than a full copy
    shutil.copytree(src, dest, symlinks=True, ignore=lambda d, names: ["objects"] if Path(d) == src / ".git" else [])
    shutil.copytree(src / ".git" / "objects", dest / ".git" / "objects", copy_function=os.link)
    return dest


CHECK = textwrap.dedent(
    """\
    import os, signal, subprocess, sys, time
    wd, counter, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    bad_k, skip_k = int(sys.argv[4]), int(sys.argv[5])
    commit = os.environ.get("SGLPATCH_BISECT_COMMIT", "")
    head = open(os.path.join(wd, ".git", "HEAD")).read().strip()
    with open(counter, "a") as f:
        f.write(f"{commit} {os.getcwd()} {head} {os.environ.get('SGLPATCH_BISECT_PATCH', '')}\\n")
    files = %r
    def has(k):
        return "SGLPATCH_BISECT_TEST_MARK_%%d = " %% k in open(os.path.join(wd, files[k - 1])).read()
    print(f"check: commit {commit[:12]}", flush=True)
    if skip_k and has(skip_k) and not (skip_k < len(files) and has(skip_k + 1)):
        sys.exit(125)
    if mode == "upstream-bad":
        sys.exit(1)
    if mode.startswith("exit-"):  # exit-N at patch bad_k and above (at every commit without bad_k)
        sys.exit(int(mode[5:]) if not bad_k or has(bad_k) else 0)
    if mode == "cannot":
        sys.exit(125)
    if mode == "upbad-skip":
        sys.exit(125 if has(1) else 1)
    if mode == "never":
        sys.exit(0)
    if mode == "hang-all" or (bad_k and has(bad_k)):
        if mode.startswith("hang"):
            child = subprocess.Popen(["sleep", "300"])
            open(counter + ".pids", "a").write(f"{child.pid}\\n{os.getpid()}\\n")
            time.sleep(300)
        if mode == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        print("check: regression present", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0)
    """
) % (FILES,)


@pytest.fixture
def check(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    counter = tmp_path / "runs.txt"

    def make(wd: Path, mode: str = "normal", bad_k: int = 0, skip_k: int = 0) -> list[str]:
        counter.write_text("")
        return [sys.executable, str(script), str(wd), str(counter), mode, str(bad_k), str(skip_k)]

    def runs() -> list[list[str]]:
        return [line.split() for line in counter.read_text().splitlines()]

    make.runs = runs
    make.counter = counter
    return make


def assert_restored(wd: Path, patched_sha: str) -> None:
    assert git(wd, "symbolic-ref", "--short", "HEAD") == "patched"
    assert git(wd, "rev-parse", "HEAD") == patched_sha
    assert git(wd, "rev-parse", "patched") == patched_sha
    assert git(wd, "status", "--porcelain", "--untracked-files=no") == ""
    assert not (wd / ".git" / "BISECT_START").exists()
    assert git(wd, "for-each-ref", "refs/bisect") == ""


def test_names_each_patch_within_bound(bisect_project, check, tmp_path, monkeypatch, capfdbinary):
    project, wd, names = bisect_project
    patched = git(wd, "rev-parse", "patched")
    upstream = git(wd, "rev-parse", "upstream")
    series = git(wd, "rev-list", "--reverse", "upstream..patched").split()
    user_cwd = tmp_path / "elsewhere"
    user_cwd.mkdir()
    monkeypatch.chdir(user_cwd)
    for k in range(1, N + 1):
        mode = "crash" if k == N else "normal"  # a CMD killed by a signal counts as bad (git would abort)
        cmd = check(wd, mode, bad_k=k)
        res = driver.run(wd, cmd, triage=True, project_root=project, log_dir=tmp_path / f"log{k}")
        runs = check.runs()
        assert res.outcome == "found", res.message
        assert res.first_bad.index == k and res.first_bad.name == names[k - 1]
        assert res.first_bad.commit == series[k - 1]
        assert res.first_bad.subject == f"test: marker {k} in {Path(FILES[k - 1]).name}"
        assert res.first_bad.description.startswith(f"bisect test patch {k}")
        assert res.runs == len(runs) <= BOUND
        # the triage results are git's endpoints: neither is run twice, no commit is run twice
        commits = [r[0] for r in runs]
        assert commits[:2] == [upstream, patched]
        assert len(set(commits)) == len(commits)
        for commit, cwd, head, patch in runs:  # CMD: user's cwd, the commit under test, its name
            assert cwd == str(user_cwd) and head == commit
            assert patch == ("upstream" if commit == upstream else names[series.index(commit)])
        assert_restored(wd, patched)
        report = "\n".join(bisect_report.format_report(res))
        assert names[k - 1] in report and f"bisect test patch {k}" in report and f"CMD runs: {len(runs)}" in report
        assert (tmp_path / f"log{k}" / "steps.txt").read_text().count("\n") == len(runs) + 1
    out = capfdbinary.readouterr()
    assert b"check: regression present" in out.err and b"check: commit" in out.out  # CMD output passed through
    assert b"about" in out.err  # progress with an estimate


def test_without_triage_trusts_endpoints(bisect_project, check, tmp_path):
    project, wd, names = bisect_project
    res = driver.run(wd, check(wd, bad_k=2), project_root=project, log_dir=tmp_path / "log")
    assert res.outcome == "found" and res.first_bad.name == names[1]
    assert res.runs == len(check.runs()) <= math.ceil(math.log2(N))
    assert_restored(wd, git(wd, "rev-parse", "patched"))


def test_cli_triage_upstream_regression_no_bisect(bisect_project, check, tmp_path):
    project, wd, _ = bisect_project
    logs = tmp_path / "log"
    proc = sglpatch(
        "bisect", "--workdir", str(wd), "--project", str(project), "--triage", "--report-dir", str(logs),
        "--", *check(wd, "upstream-bad"), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "regression is upstream" in proc.stdout
    assert "(exit codes: 1 on GOOD, 1 on BAD)" in proc.stdout  # triage says which exit codes it saw
    assert "CMD runs: 2" in proc.stdout
    assert len(check.runs()) == 2
    assert not (logs / "git-bisect-run.log").exists() and not (logs / "bisect.log").exists()  # no bisect
    assert_restored(wd, git(wd, "rev-parse", "patched"))

    proc = sglpatch("bisect", "--workdir", str(wd), "--triage", "--log-dir", str(logs), "--", *check(wd, "never"), cwd=tmp_path)
    assert proc.returncode == 0 and "no regression" in proc.stdout, proc.stdout + proc.stderr
    assert len(check.runs()) == 2


def test_hang_times_out_kills_group_and_restores(workdir, bisect_project, check, tmp_path):
    project, _, names = bisect_project
    patched = git(workdir, "rev-parse", "patched")
    t0 = time.monotonic()
    res = driver.run(workdir, check(workdir, "hang", bad_k=4), timeout=1.0, project_root=project, log_dir=tmp_path / "log")
    assert time.monotonic() - t0 < 30
    assert res.outcome == "found" and res.first_bad.name == names[3]
    timed_out = [s for s in res.steps if s.rc is None]
    assert timed_out and all(s.verdict == "bad" and "timed out" in s.note for s in timed_out)
    time.sleep(0.2)
    for pid in map(int, (check.counter.parent / "runs.txt.pids").read_text().split()):
        assert not _alive(pid), f"process {pid} of the hung CMD survived"
    assert_restored(workdir, patched)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_skip_is_handled(bisect_project, check, tmp_path):
    project, wd, names = bisect_project
    series = git(wd, "rev-list", "--reverse", "upstream..patched").split()
    # commit of patch 2 cannot be tested: the bad one (4) is still found
    res = driver.run(wd, check(wd, bad_k=4, skip_k=2), triage=True, project_root=project, log_dir=tmp_path / "a")
    assert res.outcome == "found" and res.first_bad.name == names[3]
    assert res.runs == len(check.runs()) <= BOUND
    # the commit just below the bad one cannot be tested: git cannot decide between 3 and 4
    res = driver.run(wd, check(wd, bad_k=4, skip_k=3), triage=True, project_root=project, log_dir=tmp_path / "b")
    assert any(s.verdict == "skip" for s in res.steps)
    assert res.outcome == "ambiguous" and res.exit_code == 1
    assert [c.commit for c in res.candidates] == series[2:4]
    assert res.runs == len(check.runs()) <= BOUND
    assert_restored(wd, git(wd, "rev-parse", "patched"))


@pytest.mark.parametrize("phase", ["bisect", "triage"])
def test_sigint_during_a_step_restores_patched(phase, workdir, bisect_project, check, tmp_path):
    project, _, _ = bisect_project
    patched = git(workdir, "rev-parse", "patched")
    if phase == "bisect":  # inside a step of git bisect run: every commit but upstream hangs
        cmd, extra = check(workdir, "hang", bad_k=1), []
    else:  # the triage run on upstream (in sglpatch itself)
        cmd, extra = check(workdir, "hang-all"), ["--triage"]
    env = dict(os.environ, PYTHONPATH=str(Path(bisect.__file__).resolve().parents[2]))  # the sglpatch under test
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglpatch.cli", "bisect", "--workdir", str(workdir), "--project", str(project),
         "--report-dir", str(tmp_path / "log"), *extra, "--", *cmd],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    pids = check.counter.parent / "runs.txt.pids"
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    # inside a real git bisect run step, or in the triage on detached upstream
    assert (workdir / ".git" / "BISECT_START").exists() == (phase == "bisect")
    assert git(workdir, "symbolic-ref", "-q", "HEAD", check=False) == ""
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert b"interrupted" in err and b"back on patched" in err
    assert_restored(workdir, patched)
    time.sleep(0.2)
    for pid in map(int, pids.read_text().split()):
        assert not _alive(pid), f"process {pid} of the interrupted CMD survived"


def test_refuses_dirty_or_bisect_in_progress(workdir, check, tmp_path):
    f = workdir / FILES[0]
    f.write_text(f.read_text() + "# local edit\n")
    with pytest.raises(SglpatchError, match=r"uncommitted changes .*git stash"):
        driver.run(workdir, check(workdir), log_dir=tmp_path / "log")
    assert f.read_text().endswith("# local edit\n") and check.runs() == []
    git(workdir, "checkout", "-q", "--", FILES[0])
    git(workdir, "bisect", "start", "patched", "upstream")
    proc = sglpatch("bisect", "--workdir", str(workdir), "--", *check(workdir), cwd=tmp_path)
    assert proc.returncode == 1 and "bisect is already in progress" in proc.stderr and "bisect reset" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and check.runs() == []
    assert (workdir / ".git" / "BISECT_START").exists()  # the user's bisect is left alone


# ----------------------------------------------------------------------------- issue 28: faults 5 and 8


@pytest.mark.parametrize("triage", [True, False])
def test_a_cmd_that_could_not_run_anywhere_gives_no_verdict_and_exit_125(triage, bisect_project, check, tmp_path):
    project, wd, _ = bisect_project
    extra = ["--triage"] if triage else []
    proc = sglpatch("bisect", "--workdir", str(wd), "--project", str(project), *extra, "--report-dir", str(tmp_path / "log"),
                    "--", *check(wd, "cannot"), cwd=tmp_path)
    runs = len(check.runs())
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert f"CMD could not run here: all {runs} run(s) exited 125 (125 cannot run here, " in proc.stdout
    assert "regression is upstream" not in proc.stdout and "first bad" not in proc.stdout
    assert runs == 2 if triage else runs >= 1
    assert_restored(wd, git(wd, "rev-parse", "patched"))


def test_triage_draws_no_verdict_from_a_full_stack_that_could_not_run(bisect_project, check, tmp_path):
    """GOOD fails, BAD cannot run: not "regression is upstream ... the full stack passes"."""
    project, wd, _ = bisect_project
    res = driver.run(wd, check(wd, "upbad-skip"), triage=True, project_root=project, log_dir=tmp_path / "log")
    assert (res.outcome, res.exit_code) == ("inconclusive", 1), res.message
    assert res.message == f"cannot triage: CMD could not run (exit 125) on {res.steps[1].label}"
    assert [s.verdict for s in res.steps] == ["bad", "skip"]


def test_the_readme_triage_of_regress_sh_on_a_box_without_its_python_exits_125(bisect_project, tmp_path):
    """Fault 8: `bisect.sh --triage -- scripts/regress.sh --tier kernel` where ~/ml-env is missing."""
    from conftest import make_venv

    project, wd, _ = bisect_project
    venv = tmp_path / "tool-venv"
    make_venv(venv)
    digest = subprocess.run(["sha256sum"], input=(ROOT / "pyproject.toml").read_bytes(), capture_output=True, check=True)
    (venv / ".sglpatch-tool").write_text(f"{ROOT} {digest.stdout.split()[0].decode()}\n")
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), SGLPATCH_TOOL_VENV=str(venv), PYTHONPATH=str(ROOT / "src"))
    env.pop("SGLPATCH_PROFILE", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "bisect.sh"), "--workdir", str(wd), "--triage", "--timeout", "1800",
                           "--log-dir", str(tmp_path / "log"), "--", str(ROOT / "scripts" / "regress.sh"), "--tier", "kernel"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert "CMD could not run here: all 2 run(s) exited 125" in proc.stdout
    assert "regression is upstream" not in proc.stdout
    assert "the profile's [kernel] python ~/ml-env/bin/python3 is not on this machine" in proc.stderr + proc.stdout
    assert_restored(wd, git(wd, "rev-parse", "patched"))


def test_a_killed_bisects_state_is_removed_from_tmpdir_by_the_next_run(workdir, bisect_project, check, tmp_path):
    """Fault 5: SIGKILL leaves TMPDIR/sglpatch-bisect-PID-* (the environment, tokens included); the next run removes it."""
    project, _, _ = bisect_project
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmpdir), SECRET_TOKEN="hf_do_not_keep")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglpatch.cli", "bisect", "--workdir", str(workdir), "--project", str(project), "--triage",
         "--log-dir", str(tmp_path / "log"), "--", *check(workdir, "hang-all")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    pids = check.counter.parent / "runs.txt.pids"
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    left = [p for p in tmpdir.iterdir() if p.name.startswith("sglpatch-bisect-")]
    assert [p.name.startswith(f"sglpatch-bisect-{proc.pid}-") for p in left] == [True]
    assert "hf_do_not_keep" in (left[0] / "state.json").read_text()
    proc.kill()
    proc.wait()
    for pid in map(int, pids.read_text().split()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    git(workdir, "checkout", "-q", "-f", "patched")
    r = sglpatch("bisect", "--workdir", str(workdir), "--project", str(project), "--log-dir", str(tmp_path / "log2"),
                 "--", *check(workdir, "never"), cwd=tmp_path, env={"TMPDIR": str(tmpdir)})
    assert not left[0].exists(), r.stdout + r.stderr
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("sglpatch-bisect-")] == []


# ----------------------------------------------------------------------------- issue 38: no verdict from a usage error


def test_the_readme_triage_of_a_mistyped_regress_sh_stops_with_one_line(bisect_project, tmp_path):
    """`bisect.sh --triage -- scripts/regress.sh --tier kernal` (a typo: argparse's exit 2) was "regression is
    upstream", exit 0. A usage error stops at the first run, one line, exit 2, no verdict."""
    from failure_modes.test_tool_venv import tool_venv

    project, wd, _ = bisect_project
    env = tool_venv(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "bisect.sh"), "--workdir", str(wd), "--triage", "--log-dir", str(tmp_path / "log"),
                           "--", str(ROOT / "scripts" / "regress.sh"), "--tier", "kernal"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "regression is upstream" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sglpatch: error: CMD exited 2 (a usage error: it could not run as given) on upstream (") and \
        "stopped after 1 run, no verdict" in last and "step-01.log" in last, proc.stderr
    assert (tmp_path / "log" / "step-01.log").is_file() and not (tmp_path / "log" / "step-02.log").exists()
    assert_restored(wd, git(wd, "rev-parse", "patched"))


@pytest.mark.parametrize("code", [2, 3])
def test_an_exit_that_is_no_verdict_stops_git_bisect_run(code, bisect_project, check, tmp_path):
    """Inside real `git bisect run`: CMD exits 2 (usage) or 3 (not 0, 1 or 125) from patch 3 on. It was "bad"
    (git's 1-127), naming patch 3; now the bisect stops with one line, no patch named."""
    project, wd, names = bisect_project
    with pytest.raises(SglpatchError) as e:
        driver.run(wd, check(wd, f"exit-{code}", bad_k=3), project_root=project, log_dir=tmp_path / "log")
    assert e.value.exit_code == (2 if code == 2 else 1)
    msg = str(e.value)
    assert msg.startswith(f"CMD exited {code} (") and "no verdict" in msg and "first bad" not in msg and "\n" not in msg
    assert (f"[3/{N}]" in msg or f"[4/{N}]" in msg or f"[5/{N}]" in msg), msg
    assert_restored(wd, git(wd, "rev-parse", "patched"))


def test_triage_says_the_exit_codes_it_saw(bisect_project, check, tmp_path):
    project, wd, _ = bisect_project
    res = driver.run(wd, check(wd, bad_k=2), triage=True, project_root=project, log_dir=tmp_path / "log")
    assert res.outcome == "found"
    res = driver.run(wd, check(wd, "never"), triage=True, project_root=project, log_dir=tmp_path / "log2")
    assert res.message == "no regression: CMD passes on upstream and on the full stack (exit codes: 0 on GOOD, 0 on BAD)"
