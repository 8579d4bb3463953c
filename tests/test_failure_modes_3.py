"""Issue 28, the rough edges: each one a clear line now (docs/failure-modes.md, "issue 28: the rough
edges"). Unit-level where the fault is reachable that way (CI runs on 2 cores); real processes,
real uids, real git and the real CLI where the fault lives there. Each test failed before its fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import test_failure_modes as fm
from conftest import ROOT, git, sglpatch
import sglpatch as sglpatch_pkg
from sglpatch import exitcodes
from sglpatch.errors import SglpatchError
from sglpatch.gpu.doctor import run as doctor
from sglpatch.gpu.doctor import gpu_holders as doctor_procs

rb_golden, rb_conflict, golden, case = fm.rb_golden, fm.rb_conflict, fm.golden, fm.case  # the failure-mode fixtures
TOOL_SRC = str(Path(sglpatch_pkg.__file__).resolve().parents[1])

# ----------------------------------------------------------------------------------------------
# the doctor


def _stale(proc: subprocess.Popen | int, cmdline: str = "sglang::scheduler_TP0") -> doctor_procs.GpuProc:
    pid = proc if isinstance(proc, int) else proc.pid
    return doctor_procs.GpuProc(pid, ["/dev/nvidia0"], cmdline=cmdline, worker="SGLang worker (sglang::scheduler_TP0)",
                                parent_gone=True, proc=psutil.Process(pid))


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (two uids)")


@needs_root
def test_kill_stale_on_another_users_worker_says_not_permitted_at_once(tmp_path):
    """A non-root doctor and a worker of another uid: EPERM named, no 15 s wait, never "stuck in the driver"."""
    worker = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "sleep", "120"])
    try:
        time.sleep(0.2)
        code = (
            "import json, sys, time, psutil\n"
            "from sglpatch.gpu.doctor import gpu_holders as dp\n"
            f"gp = dp.GpuProc({worker.pid}, ['/dev/nvidia0'], cmdline='sglang::scheduler_TP0', worker='w', parent_gone=True,"
            f" proc=psutil.Process({worker.pid}))\n"
            "t = time.monotonic(); lines = dp.end_stale([gp], grace=2.0)\n"
            "print(json.dumps({'lines': lines, 's': time.monotonic() - t}))\n"
        )
        env = dict(os.environ, PYTHONPATH=TOOL_SRC, HOME=str(tmp_path))
        r = subprocess.run(["setpriv", "--reuid", "65533", "--regid", "65533", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, env=env, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["lines"] == [f"pid {worker.pid} (sglang::scheduler_TP0) not ended: not permitted (EPERM: it belongs to "
                                "nobody, this doctor runs as uid 65533): run `sglpatch doctor --kill-stale` as root or as nobody"]
        assert got["s"] < 1.0  # before: SIGTERM grace + 5 s of SIGKILL, then "stuck in the driver"
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


def test_a_worker_that_exits_during_the_prompt_is_named(monkeypatch):
    w = subprocess.Popen(["sleep", "120"])
    gp = _stale(w)
    monkeypatch.setattr(doctor_procs, "scan", lambda *a, **k: {"procs": [gp]})
    said = []

    def ask(_):
        w.kill()
        w.wait()  # it exits (and is reaped) while the user reads the list
        return "y"

    lines = doctor._kill_stale(doctor.Box(nvidia_smi="/nonexistent"), False, ask, said.append)
    want = f"pid {w.pid} (sglang::scheduler_TP0) exited by itself before it was signalled: nothing sent"
    assert lines == [want] and said[-1] == f"doctor: {want}"


def test_the_stale_summary_prints_a_command_line_on_one_line():
    w = subprocess.Popen(["sleep", "120"])
    try:
        gp = _stale(w, cmdline="evil\x1b[2J\nname --x")
        c = doctor.check_procs({"procs": [gp], "smi_only": {}, "devices": ["/dev/nvidia0"], "unreadable": 0}, [])
        assert c.state == "fail" and "pid %d (evil\\x1b[2J, ? MiB" % w.pid in c.text
        assert "\n" not in c.line() and "\x1b" not in c.line() and all("\x1b" not in d and "\n" not in d for d in c.details)
    finally:
        w.kill()
        w.wait()


def test_no_gpu_is_125_even_when_the_python_lacks_sglang(tmp_path):
    from test_doctor import doctor_cli, site

    path = os.pathsep.join([str(site(tmp_path / "s", sglang=None)), TOOL_SRC])  # the sglpatch under test
    r = doctor_cli(tmp_path, str(tmp_path / "no-nvidia-smi"), env_extra={"PYTHONPATH": path})
    assert "fail sglang: " in r.stdout
    assert r.returncode == exitcodes.CANNOT_RUN, r.stdout + r.stderr  # was 1
    assert r.stdout.splitlines()[-1].startswith("doctor: cannot_run (exit 125): ")
    assert r.stdout.splitlines()[-1].endswith("1 fail, 7 skip; no GPU visible here, the GPU checks did not run")


# ----------------------------------------------------------------------------------------------
# the command line


def test_an_unknown_option_shows_the_commands_usage_not_the_top_level_one():
    r = sglpatch("rebase", "--dryrun")
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.startswith("usage: sglpatch rebase [-h]"), r.stderr
    assert r.stderr.splitlines()[-1] == "sglpatch rebase: error: unrecognized arguments: --dryrun"


def test_watch_releases_not_on_the_index_is_a_usage_error_and_a_reversed_range_says_so(monkeypatch):
    from sglpatch.upstream import pkgindex
    from sglpatch.watch import matrix

    known = ["0.5.9", "0.5.10", "0.5.10.post1", "0.5.11"]
    monkeypatch.setattr(pkgindex, "releases", lambda name, after=None, upto=None, first=None: known)
    monkeypatch.setattr(pkgindex, "index_files", lambda name: tuple(
        pkgindex.Artifact(f"sglang-{v}.tar.gz", v, "sdist", "0" * 64, f"https://example.invalid/sglang-{v}.tar.gz") for v in known))
    with pytest.raises(SglpatchError) as e:
        matrix._parse_range("0.5.99", "sglang", "0.5.9")
    assert e.value.exit_code == exitcodes.USAGE  # as `rebase --onto 0.5.99`; was 1 after a failed download
    assert str(e.value) == "sglang 0.5.99 is not a release on the index; the nearest: 0.5.10.post1, 0.5.11 (0.5.11 is the newest)"
    with pytest.raises(SglpatchError) as e:
        matrix._parse_range("0.5.11..0.5.10", "sglang", "0.5.9")
    assert e.value.exit_code == exitcodes.USAGE
    assert str(e.value) == ("--releases 0.5.11..0.5.10: 0.5.11 comes after 0.5.10 (the range is inclusive, oldest first): "
                            "did you mean 0.5.10..0.5.11?")
    assert matrix._parse_range("0.5.11", "sglang", "0.5.9") == ["0.5.11"]


def test_profile_report_refuses_batch_size_0_and_drops_an_empty_batch_bucket(tmp_path):
    from sglpatch.gpu import profile_report as pr

    rec = {"cycles": 10, "cycle_ms_mean": 20.0, "draft_ms_mean": 5.0, "verify_ms_mean": 10.0, "extend_ms_mean": 5.0,
           "accept_length": 2.5, "baseline_step_ms": 10.0}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec | {"batch_size": 0}) + "\n")  # version 1: tokens / (cycles x 0) divided by zero
    with pytest.raises(SglpatchError) as e:
        pr.load(path)
    assert str(e.value) == f"{path}:1: field batch_size is 0, expected a number > 0"
    buckets = {"0": {"cycles": 5, "cycle_ms_mean": 20.0, "accept_length": 2.0}, "1": {"cycles": 10, "cycle_ms_mean": 20.0, "accept_length": 2.5}}
    path.write_text(json.dumps(rec | {"tokens": 25.0, "requests": 10.0, "by_batch_size": buckets}) + "\n")
    s = pr.summarize(pr.load(path))
    assert list(s["by_batch_size"]) == ["1"] and s["by_batch_size"]["1"]["accept_length"] == 2.5
    text = pr.format_text(str(path), s, [])
    assert "batch 0" not in text and "inf" not in text and "nan" not in text


@pytest.mark.parametrize("script, table", [("test.sh", "exit codes (pytest's, not the sglpatch table):\n  0    every selected "
                                            "test passed\n  1    a test failed\n"), ("mutants.sh", None)])
def test_test_and_mutants_help_show_their_exit_codes(script, table):
    table = table or "\n".join(exitcodes.lines())
    r = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and table in r.stdout, r.stdout


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


# ----------------------------------------------------------------------------------------------
# a damaged rebase state: --abort checks what it restores from before it moves anything


def test_abort_checks_a_damaged_state_before_it_moves_anything(tmp_path, rb_conflict):
    """One real stop (0.5.9 -> 0.5.10.post1, a conflict); each damage is refused with the workdir
    still at the stop and the project untouched; then an orig.json without `head` falls back on
    the plan's record and the abort restores everything (was a KeyError)."""
    c = fm.Case(tmp_path, rb_conflict)
    before_wd, before = fm._exact(c.fork), fm.snapshot(c.project)
    assert fm._rebase(c).returncode == exitcodes.HUMAN
    sdir = c.fork / ".git" / "sglpatch-rebase"
    stop, saved = git(c.fork, "rev-parse", "HEAD"), tmp_path / "saved-state"
    shutil.copytree(sdir, saved)
    other = tmp_path / "other-project"
    shutil.copytree(c.project, other)
    orig = json.loads((sdir / "orig.json").read_text())

    def damage(how, *needles, args=(), absent=()):
        how()
        msg = fm.refused(c.run("rebase", "--workdir", str(c.fork), *args, "--abort"), *needles)
        assert git(c.fork, "rev-parse", "HEAD") == stop and fm.snapshot(c.project) == before  # nothing moved
        assert fm.snapshot(other) == fm.snapshot(c.project)
        for word in absent:
            assert word not in msg, msg
        shutil.rmtree(sdir)
        shutil.copytree(saved, sdir)
        return msg

    def both_corrupt():
        (sdir / "orig.json").write_text("{not json")
        (sdir / "state.json").write_text("[]")

    damage(both_corrupt, f"cannot abort the rebase in {c.fork}", "orig.json is damaged", "state.json is damaged too",
           f"git -C {c.fork} reflog", f"then delete {sdir}", args=("--project", str(c.project)), absent=("--abort",))
    damage(lambda: shutil.rmtree(sdir / "project"), "the snapshot of the project's files", "is damaged or gone",
           "nothing was changed", args=("--project", str(c.project)))  # was FileNotFoundError after the reset
    damage(lambda: (sdir / "written.json").write_text('{"../outside/x": null}'), "written.json is damaged",
           "its entry '../outside/x' is not a path inside the project", args=("--project", str(c.project)),
           absent=("symbolic link",))
    damage(lambda: (sdir / "orig.json").write_text(json.dumps(orig | {"project": str(other)})),
           f"was started from the project {other}, not {c.project}", args=("--project", str(c.project)))
    damage(lambda: (sdir / "orig.json").write_text(json.dumps(orig | {"project": str(tmp_path / "outside")})),
           f"names {tmp_path / 'outside'} as the project, which is not an sglpatch project")  # run outside any project
    (sdir / "orig.json").write_text(json.dumps({"orig": {k: v for k, v in orig["orig"].items() if k != "head"},
                                                "project": orig["project"]}))
    fm.ok(fm._rebase(c, "--abort"))
    assert fm._exact(c.fork) == before_wd and fm.snapshot(c.project) == before and not sdir.exists()


# ----------------------------------------------------------------------------------------------
# the cache


def test_a_facts_file_of_the_wrong_shape_is_worked_out_again(tmp_path, monkeypatch):
    from sglpatch.upstream import treecache

    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    sha = "a" * 64
    f = treecache._facts_path("artifact-tree", sha)
    f.parent.mkdir(parents=True)
    for text in ("[1, 2]", '"commit"', "null"):
        f.write_text(text)
        assert treecache.load_facts("artifact-tree", sha) == {}  # was the list: rec.get() raised AttributeError
    f.write_text('{"commit": "c"}')
    assert treecache.load_facts("artifact-tree", sha) == {"commit": "c"}


LIMITED = "import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"


@pytest.mark.parametrize("what", ["artifact", "facts"])
def test_a_cache_entry_linked_to_dev_zero_is_one_line_not_a_hang(tmp_path, what):
    """A cached artifact linked to /dev/zero was hashed forever (the watch hung); a facts file so
    linked was read into memory. Now: one line for the artifact, the facts worked out again."""
    cache = tmp_path / "cache"
    link = cache / "sdist" / "sglang-0.5.9.tar.gz" if what == "artifact" else cache / "trees.git" / "facts" / "artifact" / f"{'b' * 64}.json"
    link.parent.mkdir(parents=True)
    link.symlink_to("/dev/zero")
    code = LIMITED + ("from sglpatch.upstream.pin import sha256_file\nprint(sha256_file(sys.argv[1]))\n" if what == "artifact" else
                      "from sglpatch.upstream import treecache\nprint(treecache.load_facts('artifact', 'b' * 64))\n")
    env = dict(os.environ, PYTHONPATH=TOOL_SRC, SGLPATCH_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-c", code, str(link)], capture_output=True, text=True, env=env, timeout=20)
    if what == "facts":
        assert r.returncode == 0 and r.stdout == "{}\n", r.stderr[-300:]
    else:
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
            f"sglpatch.errors.SglpatchError: {link} is a symbolic link (to /dev/zero), not a file: refusing to read it; "
            "delete it and re-run")


# ----------------------------------------------------------------------------------------------
# the project, the workdir, the scripts


def test_a_series_that_is_a_symbolic_link_is_refused_not_read_through(case):
    outside = case.sentinel / "series"
    outside.write_bytes((case.project / "series").read_bytes())
    (case.project / "series").unlink()
    (case.project / "series").symlink_to(outside)
    before = case.state()
    for proc in (case.apply(), case.export()):
        fm.refused(proc, f"{case.project / 'series'} is a symbolic link (to {outside}); the series must be a regular file "
                   "in the project, as the patch files are: replace the link by the file")
    assert (case.project / "series").is_symlink() and case.state() == before  # export did not replace it by a file
    (case.project / "series").unlink()
    outside.rename(case.project / "series")
    fm.ok(case.apply())


def test_a_linked_worktree_as_workdir_names_the_main_one(case):
    wt = case.tmp / "t" / "wt2"
    git(case.fork, "worktree", "add", "-q", "--detach", str(wt), "patched")
    for proc in (case.apply(workdir=wt), case.run("export", "--project", str(case.project), "--workdir", str(wt))):
        fm.refused(proc, f"{wt} is a linked worktree (`git worktree add`), and sglpatch keeps its lock and state in the "
                   f"workdir's own .git folder: use --workdir {case.fork}, or make another with `sglpatch apply --workdir NEW`")
    git(case.fork, "worktree", "remove", "--force", str(wt))


def test_an_empty_commit_on_patched_is_named_with_the_way_out(case):
    before = fm.snapshot(case.project)
    git(case.fork, "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "--allow-empty", "-m", "an empty commit")
    c = git(case.fork, "rev-parse", "HEAD")
    base = git(case.fork, "rev-parse", "upstream")
    fm.refused(case.export(), f"commit {c[:12]} (an empty commit) on patched changes nothing, so it cannot be a patch: drop it "
               f"(`git -C {case.fork} rebase -i {base[:12]}`, delete its line) or give it a change, then re-run export; "
               "nothing was written")  # was "patch commit X is empty"
    assert fm.snapshot(case.project) == before
    git(case.fork, "reset", "-q", "--hard", "HEAD~1")
    fm.ok(case.export())


def test_a_unicode_subject_is_decoded_not_made_a_patch_name(case):
    from sglpatch.series import Entry, read_patch

    (case.fork / "README.md").write_text("x\n")
    git(case.fork, "add", "README.md")
    git(case.fork, "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "-m", "Füge Ünïcode hinzu: 日本語 ✓")
    out = fm.ok(case.export()).stdout
    assert "wrote   patches/0003-Fuge-Unicode-hinzu.patch" in out, out  # was 0003-UTF-8-q-F-C3-BCge-20-C3-9Cn-...
    assert read_patch(case.project, Entry("0003-Fuge-Unicode-hinzu.patch", 1)).subject == "Füge Ünïcode hinzu: 日本語 ✓"
    assert "0003-Fuge-Unicode-hinzu.patch" in (case.project / "series").read_text().splitlines()


def test_a_read_only_checkout_says_where_the_tool_venv_can_go(tmp_path):
    from test_failure_modes_2 import ReadOnly

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
