"""The world every failure-mode case runs in, and its five guarantees (docs/failure-modes.md lists
every case; the cases are in this folder, one file per concern).

Every case runs the real CLI (a subprocess; or ``sglpatch.cli.main`` in the test's own process
where the test is marked ``inproc``: nothing about a real process under test) against a real git
workdir built from the real 0.5.9 sdist, and asserts the same five things:

1. one clear line ``sglpatch: error: ...`` (the last line on stderr, no traceback);
2. a non-zero exit;
3. the user's work in the workdir intact (an untracked file, refs, uncommitted edits where the
   case has them, unexported commits where the case has them);
4. nothing written outside the workdir and the project: a private TMPDIR and HOME stay empty,
   a sentinel folder that hostile input aims at stays empty, the sdist cache is unchanged, and
   no other entry appears next to the project and the workdir;
5. a re-run after the cause is fixed succeeds.

The series used here is our own small one (two patches made with ``sglpatch export`` on the
real tree), so the cases do not depend on the project's patch series. OS faults are real where
the machine allows it (a tmpfs that fills up, a local HTTP index that cuts the download, pip
that cannot reach an index, SIGKILL); ``SGLPATCH_CRASH_AT=step`` stops the process with
SIGKILL at a named step so that every step of apply and export is hit deterministically.

Here: the session set-up (a project with two real patches, a workdir where they are applied, and
the same rebased onto 0.5.10.post1), ``Case`` (one test's world), and the assertions every case
makes (``refused``, ``refused_apply``, ``ok``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, built_once, git, run_cli, run_cli_inproc
import sglpatch as sglpatch_pkg
from sglpatch.stack import build, export as stack_export, status
from sglpatch.upstream.cachedir import cache_dir
from sglpatch.upstream.pin import read_lock, write_lock
from sglpatch.workdir import SCRATCH


SUBJECT_1 = "version: say that the fallback is for a build"


SUBJECT_2 = "environ: note for the failure-mode tests"


DEP3 = "Description: failure-mode test patch\nOrigin: vendor, sglpatch tests\nForwarded: no\nLast-Update: 2026-11-30\n"


P1_FILE = "python/sglang/version.py"


P2_FILE = "python/sglang/srt/environ.py"


CRLF_FILE = (
    "python/sglang/srt/layers/moe/fused_moe_triton/configs/triton_3_1_0/"
    "E=8,N=4096,device_name=AMD_Instinct_MI325X,dtype=fp8_w8a8.json"
)


DEV = ("-c", "user.name=Dev", "-c", "user.email=dev@example.com")


PIP_HOME_STATE = {".rustup", ".cache", ".config", ".local"}


TOOL_SRC = str(Path(sglpatch_pkg.__file__).resolve().parents[1])


# --------------------------------------------------------------------------------------
# session set-up: a project with two real patches, and a workdir where they are applied


def once(fn):
    """A session fixture built once per process although two test modules import it
    (tests/test_failure_modes_2.py uses these): pytest keeps one value per module otherwise."""
    memo: dict = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "value" not in memo:
            memo["value"] = fn(*args, **kwargs)
        return memo["value"]

    return wrapper


@pytest.fixture(scope="session")
@once
def golden(tmp_path_factory, sdist_059):
    """Built once for the run (all workers); every case copies it."""
    with built_once(tmp_path_factory, "fm-golden") as (base, done):
        if not done:
            _build_golden(base)
    cache = cache_dir()
    return {"project": base / "project", "fork": base / "fork", "cache": cache, "cache_listing": sdist_cache(cache)}


def _build_golden(base: Path) -> None:
    proj = base / "project"
    (proj / "patches").mkdir(parents=True)
    lock = read_lock(ROOT)
    lock.blobs = {}
    write_lock(proj, lock)
    (proj / "series").write_text("# failure-mode test series\n")
    wd = base / "fork"
    build.apply(proj, wd, source="sdist")
    f1 = wd / P1_FILE
    f1.write_text(f1.read_text().replace("# Fallback for development without build", "# Fallback for development without a build"))
    git(wd, *DEV, "commit", "-qam", f"{SUBJECT_1}\n\n{DEP3}")
    f2 = wd / P2_FILE
    f2.write_text(f2.read_text().replace("import warnings\n", "import warnings\n\n# sglpatch failure-mode test\n", 1))
    (wd / "python/sglang/srt/fm_note.py").write_text('"""A new file added by a patch."""\n')
    git(wd, "add", "-A", "python")
    git(wd, *DEV, "commit", "-qm", f"{SUBJECT_2}\n\n{DEP3}")
    stack_export.export(proj, wd)
    status.update_blobs(proj, wd)
    assert build.apply(proj, wd, source="sdist").changed is False
    assert len((proj / "series").read_text().split(".patch")) == 3
    # one pack instead of ~2000 loose objects: each case copies this workdir (cp -a), in half the time
    git(wd, "repack", "-a", "-d", "-q")


def sdist_cache(cache: Path) -> list:
    """The verified 0.5.9 sdist in the shared cache (other tests may add other files there)."""
    d = cache / "sdist"
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in d.glob("sglang-0.5.9.tar.gz*"))


def listing(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else {}


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class Case:
    """One test's world: project copy, workdir copy, private TMPDIR/HOME, a sentinel folder."""

    def __init__(self, tmp: Path, golden: dict, fresh: bool = False, inproc: bool = False):
        self.tmp = tmp
        self.inproc = inproc  # the CLI in this process (run_cli_inproc), not a child of its own
        self.golden = golden
        self.project = tmp / "project"
        shutil.copytree(golden["project"], self.project)
        self.fork = tmp / "fork"
        if not fresh:
            subprocess.run(["cp", "-a", str(golden["fork"]), str(self.fork)], check=True)
            (self.fork / "my-notes.txt").write_text("the user's untracked notes\n")
        self.tmpdir = tmp / "t"
        self.home = tmp / "home"
        self.sentinel = tmp / "sentinel"
        for d in (self.tmpdir, self.home, self.sentinel):
            d.mkdir()
        self.allowed = {"project", "fork", "t", "home", "sentinel"}
        self.runs_pip = False

    # -- running the real CLI --------------------------------------------------
    def env(self, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        env.update(
            TMPDIR=str(self.tmpdir),
            HOME=str(self.home),
            SGLPATCH_CACHE=str(self.golden["cache"]),
            PYTHONPATH=str(ROOT / "src"),
            GIT_CONFIG_NOSYSTEM="1",
        )
        env.pop("SGLPATCH_CRASH_AT", None)
        env.update(extra or {})
        return env

    def run(self, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return (run_cli_inproc if self.inproc else run_cli)(list(args), self.env(env), self.tmp, timeout)

    def apply(self, *extra: str, env: dict | None = None, workdir: Path | None = None) -> subprocess.CompletedProcess:
        source = () if "--source" in extra else ("--source", "sdist")  # the registry sdist unless a test says otherwise
        return self.run("apply", "--project", str(self.project), "--workdir", str(workdir or self.fork), "--no-install", *source, *extra, env=env)

    def export(self, env: dict | None = None) -> subprocess.CompletedProcess:
        return self.run("export", "--project", str(self.project), "--workdir", str(self.fork), env=env)

    # -- the user's state ---------------------------------------------------------
    def state(self, wd: Path | None = None) -> dict:
        wd = wd or self.fork
        notes = wd / "my-notes.txt"
        return {
            "heads": git(wd, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads/"),
            "HEAD": git(wd, "symbolic-ref", "-q", "HEAD", check=False) or git(wd, "rev-parse", "HEAD"),
            "diff": git(wd, "diff", "HEAD", "--binary"),
            "staged": git(wd, "diff", "--cached", "--binary"),
            "notes": notes.read_text() if notes.exists() else None,
        }

    def outside_clean(self) -> None:
        assert sorted(p.name for p in self.tmpdir.iterdir()) == [], "left files in TMPDIR"
        home = sorted(p.name for p in self.home.iterdir())
        if self.runs_pip:  # pip, run for the user with their configuration, keeps its own state there
            home = [h for h in home if h not in PIP_HOME_STATE]
        assert home == [], "wrote into HOME"
        assert sorted(p.name for p in self.sentinel.iterdir()) == [], "wrote into the sentinel folder"
        assert {p.name for p in self.tmp.iterdir()} <= self.allowed, "wrote next to the project/workdir"
        assert sdist_cache(self.golden["cache"]) == self.golden["cache_listing"], "changed the sdist cache"
        scratch = self.fork / ".git" / SCRATCH
        assert not scratch.exists() or not any(scratch.iterdir()), "left scratch files"

    def restore(self, *names: str) -> None:
        """Fix the cause: put project files back as they were."""
        for name in names:
            src = self.golden["project"] / name
            dst = self.project / name
            if dst.is_symlink() or dst.is_file():
                dst.unlink()
            if src.exists():
                shutil.copy2(src, dst)

    def append_patch(self, name: str, data: bytes, series_line: str | None = None) -> None:
        (self.project / "patches" / name).write_bytes(data)
        with open(self.project / "series", "a") as f:
            f.write((series_line or name) + "\n")

    def in_sync(self) -> None:
        out = self.run("status", "--project", str(self.project), "--workdir", str(self.fork))
        assert out.returncode == 0 and "in sync with the series" in out.stdout, out.stdout + out.stderr
        assert git(self.fork, "status", "--porcelain", "--untracked-files=no") == ""


def inproc(request) -> bool:
    """The test is marked `inproc`: its Case runs the CLI in this process (nothing about a real
    process is under test: no signal, crash point, second process or umask). SGLPATCH_TEST_NO_INPROC=1:
    each in a child of its own again."""
    return request.node.get_closest_marker("inproc") is not None and not os.environ.get("SGLPATCH_TEST_NO_INPROC")


@pytest.fixture
def case(tmp_path, golden, request) -> Case:
    return Case(tmp_path, golden, inproc=inproc(request))


@pytest.fixture
def fresh(tmp_path, golden, request) -> Case:
    return Case(tmp_path, golden, fresh=True, inproc=inproc(request))


def refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit and exactly one one-line error, last on stderr, naming the needles."""
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, None), out
    assert "Traceback" not in out, out
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("sglpatch: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    msg = errors[0]
    for n in needles:
        assert n.lower() in msg.lower(), f"{n!r} not in {msg!r}"
    return msg


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def mkpatch(subject: str, diff: str | bytes, header_extra: bytes = b"") -> bytes:
    head = (
        b"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        b"From: Someone <someone@example.com>\nDate: Mon, 30 Nov 2026 12:00:00 +0000\n"
        + b"Subject: [PATCH] " + subject.encode() + b"\n" + header_extra + b"\n" + DEP3.encode() + b"---\n"
    )
    body = diff.encode() if isinstance(diff, str) else diff
    return head + body + b"-- \n2.39.5\n\n"


def _new_file_diff(path: str, content: str = "x = 1\n", quoted: str | None = None) -> str:
    a, b = (f'"a/{quoted}"', f'"b/{quoted}"') if quoted else (f"a/{path}", f"b/{path}")
    return (
        f"diff --git {a} {b}\nnew file mode 100644\nindex 0000000..1111111\n--- /dev/null\n+++ {b}\n"
        f"@@ -0,0 +1 @@\n+{content}"
    )


def patch_names(c: Case) -> list[str]:
    return [line for line in (c.project / "series").read_text().splitlines() if line and not line.startswith("#")]


def refused_apply(c: Case, *needles: str, fix=None, extra: tuple = (), env: dict | None = None) -> str:
    """The common shape of a bad-input apply case."""
    before = c.state()
    proj_before = snapshot(c.project)
    msg = refused(c.apply(*extra, env=env), *needles)
    assert c.state() == before
    assert snapshot(c.project) == proj_before
    c.outside_clean()
    if fix is None:
        c.restore("series", "upstream.lock")
        for p in (c.project / "patches").iterdir():
            if not (c.golden["project"] / "patches" / p.name).exists():
                p.unlink()
        c.restore(*(f"patches/{p.name}" for p in (c.golden["project"] / "patches").iterdir()))
    else:
        fix()
    ok(c.apply(*extra))
    c.in_sync()
    assert c.state()["notes"] == before["notes"]
    c.outside_clean()
    return msg


# --------------------------------------------------------------------------------------
# a real tmpfs (root only)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


# --------------------------------------------------------------------------------------
# a rebase onto 0.5.10.post1 (the real sdist): the stop on a conflict, and the finished rebase


REBASE_TARGET = "0.5.10.post1"


P3_UPSTREAM = "0003-kimi-k25-eagle3-delegation.patch"  # the real P3: upstream in 0.5.10.post1, dropped


GATE = "python/sglang/srt/distributed/device_communicators/custom_all_reduce.py"


@pytest.fixture(scope="session")
@once
def rb_golden(golden, tmp_path_factory, sdist_0510):
    """The two-patch project plus P3 (so the rebase drops one), the target's recorded pin, a CHANGELOG."""
    with built_once(tmp_path_factory, "fm-rebase") as (base, done):
        proj, wd = base / "project", base / "fork"
        if not done:
            shutil.copytree(golden["project"], proj)
            subprocess.run(["cp", "-a", str(golden["fork"]), str(wd)], check=True)
            shutil.copy2(ROOT / "patches" / P3_UPSTREAM, proj / "patches" / P3_UPSTREAM)
            with open(proj / "series", "a") as f:
                f.write(P3_UPSTREAM + "\n")
            (proj / "resolutions" / REBASE_TARGET).mkdir(parents=True)
            shutil.copy2(ROOT / "resolutions" / REBASE_TARGET / "target.toml", proj / "resolutions" / REBASE_TARGET / "target.toml")
            (proj / "CHANGELOG.md").write_text("# Changelog\n\n## 0.1.0\n- started\n")
            build.apply(proj, wd, source="sdist")
            status.update_blobs(proj, wd)
            assert build.apply(proj, wd, source="sdist").changed is False
    return dict(golden, project=proj, fork=wd)


@pytest.fixture(scope="session")
@once
def rb_conflict(rb_golden, tmp_path_factory):
    """rb_golden plus a patch on the NVLink gate that 0.5.10.post1 moved: a conflict, no recorded resolution."""
    base = tmp_path_factory.mktemp("fm-rebase-conflict")
    proj, wd = base / "project", base / "fork"
    shutil.copytree(rb_golden["project"], proj)
    subprocess.run(["cp", "-a", str(rb_golden["fork"]), str(wd)], check=True)
    f = wd / GATE
    f.write_text(f.read_text().replace(
        "        if world_size > 2 and not full_nvlink:\n", "        if world_size > 2 and not full_nvlink and not _pcie_allowed():\n", 1))
    git(wd, *DEV, "commit", "-qam", f"custom_all_reduce: a patch on the NVLink gate\n\n{DEP3}")
    stack_export.export(proj, wd)
    status.update_blobs(proj, wd)
    assert build.apply(proj, wd, source="sdist").changed is False
    return dict(rb_golden, project=proj, fork=wd)


def _rebase(c: Case, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    args = args or ("--onto", REBASE_TARGET, "--source", "sdist", "--promote")  # the primary: the journaled writes of the finish
    return c.run("rebase", "--workdir", str(c.fork), "--project", str(c.project), *args, env=env)


def _heads(wd: Path) -> str:
    return git(wd, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads/")


def _exact(wd: Path) -> dict:
    """What --abort must restore byte for byte: refs (not the pre-rebase backups a late kill left), HEAD,
    config, index, every file of the worktree (the user's untracked notes included)."""
    refs = [r for r in git(wd, "for-each-ref", "--format=%(refname) %(objectname)").splitlines() if "refs/sglpatch/backup/" not in r]
    out = {"refs": refs, "HEAD": (wd / ".git" / "HEAD").read_bytes(), "config": (wd / ".git" / "config").read_bytes(),
           "index": git(wd, "write-tree")}
    for p in sorted(wd.rglob("*")):
        rel = p.relative_to(wd)
        if rel.parts[0] != ".git" and (p.is_file() or p.is_symlink()):
            out[str(rel)] = os.readlink(p) if p.is_symlink() else p.read_bytes()
    return out


def _users_work_kept(c: Case, orig: dict) -> None:
    assert (c.fork / "my-notes.txt").read_text() == "the user's untracked notes\n"
    kept = git(c.fork, "for-each-ref", "--format=%(objectname)", "refs/heads/", "refs/sglpatch/backup/").split()
    assert orig["patched"] in kept and orig["upstream"] in kept, "the pre-rebase branches are neither in place nor backed up"


@pytest.fixture(scope="session")
@once
def rb_after(rb_golden, tmp_path_factory):
    """What an uninterrupted rebase writes: the project's files and the workdir's branches."""
    c = Case(tmp_path_factory.mktemp("fm-rebase-after"), rb_golden)
    ok(_rebase(c))
    assert P3_UPSTREAM not in patch_names(c)
    assert (c.project / "rebase-reports" / f"0.5.9..{REBASE_TARGET}" / "dropped" / P3_UPSTREAM).is_file()
    return {"project": snapshot(c.project), "heads": _heads(c.fork)}
