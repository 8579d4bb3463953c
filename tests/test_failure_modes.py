"""Hostile input and faults: a tested catalogue (docs/failure-modes.md lists every case).

Every case runs the real CLI (a subprocess) against a real git workdir built from the real
0.5.9 sdist, and asserts the same five things:

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
"""

from __future__ import annotations

import errno
import functools
import http.server
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from conftest import ROOT, built_once, git, run_cli
from sglpatch.stack import build, export as stack_export, status
from sglpatch.upstream.cachedir import cache_dir
from sglpatch.upstream.pin import read_lock, sha256_file, write_lock
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
# fixed dates for the commits the tests make, so that exports compare byte for byte
os.environ.setdefault("GIT_AUTHOR_DATE", "2026-11-30T12:00:00+00:00")
os.environ.setdefault("GIT_COMMITTER_DATE", "2026-11-30T12:00:00+00:00")


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

    def __init__(self, tmp: Path, golden: dict, fresh: bool = False):
        self.tmp = tmp
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
        return run_cli(list(args), self.env(env), self.tmp, timeout)

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


@pytest.fixture
def case(tmp_path, golden) -> Case:
    return Case(tmp_path, golden)


@pytest.fixture
def fresh(tmp_path, golden) -> Case:
    return Case(tmp_path, golden, fresh=True)


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
# series


def test_series_malformed_line(case):
    with open(case.project / "series", "a") as f:
        f.write("0003-fix$(touch ${HOME}/x).patch\n")
    refused_apply(case, "series:", "characters outside")


def test_series_unknown_option(case):
    first = patch_names(case)[0]
    (case.project / "series").write_text((case.project / "series").read_text().replace(first, first + " -R"))
    refused_apply(case, "unknown option '-R'", first)


def test_series_duplicate_entry(case):
    with open(case.project / "series", "a") as f:
        f.write(patch_names(case)[0] + "\n")
    refused_apply(case, "listed twice")


def test_series_missing_patch_file(case):
    with open(case.project / "series", "a") as f:
        f.write("0003-not-there.patch\n")
    refused_apply(case, "0003-not-there.patch does not exist")


def test_series_not_utf8(case):
    with open(case.project / "series", "ab") as f:
        f.write(b"# caf\xe9\n")
    refused_apply(case, "not UTF-8")


def test_series_name_traversal(case):
    with open(case.project / "series", "a") as f:
        f.write("../../sentinel/evil.patch\n")
    refused_apply(case, "'..'")


# --------------------------------------------------------------------------------------
# patch files


def test_empty_patch(case):
    case.append_patch("0003-empty.patch", b"")
    refused_apply(case, "0003-empty.patch is empty")


def test_patch_without_diff(case):
    case.append_patch("0003-nodiff.patch", mkpatch("nothing", b""))
    refused_apply(case, "contains no diff")


def _edit_patch(c: Case, k: int, old: str, new: str, count: int = 1) -> str:
    name = patch_names(c)[k]
    path = c.project / "patches" / name
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, count))
    return name


def test_patch_needing_fuzz(case):
    # a context line differs from the pinned tree; GNU patch would apply it with fuzz
    name = _edit_patch(case, 0, "\n         except Exception:\n", "\n         except Exception:  # changed\n")
    tree = case.tmp / "t" / "plain"
    msg = refused_apply(case, name, "python/sglang/version.py", "hunk #1", "fuzz", "sglpatch rebase")
    # proof that it is a fuzz case: `patch -F3` accepts it on the upstream tree
    tree.mkdir()
    archive = subprocess.run(["git", "archive", "upstream", "python/sglang/version.py"], cwd=case.fork, capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(tree)], input=archive, check=True)
    data = (case.golden["project"] / "patches" / name).read_text().replace("\n         except Exception:\n", "\n         except Exception:  # changed\n", 1)
    proc = subprocess.run(["patch", "-p1", "-F3", "--dry-run"], cwd=tree, input=data.encode(), capture_output=True)
    assert proc.returncode == 0 and b"fuzz" in proc.stdout, proc.stdout
    shutil.rmtree(tree)
    assert "\n" not in msg


def test_patch_with_offset(case):
    name = patch_names(case)[1]
    path = case.project / "patches" / name
    text = path.read_text()
    i = text.index("\n@@ -") + 1
    end = text.index(" @@", i)
    old = text[i:end]
    start = int(old.split()[1].split(",")[0][1:])
    path.write_text(text[:i] + old.replace(f"-{start},", f"-{start + 2},", 1) + text[end:])
    refused_apply(case, name, "offset of -2 lines", "exact fit")


def test_patch_that_does_not_apply(case):
    name = _edit_patch(case, 0, "-            # Fallback for development without build", "-            # Fallback for dev without any build")
    refused_apply(case, name, "hunk #1", "does not apply")


def test_patch_for_missing_file(case):
    diff = (
        "diff --git a/python/sglang/srt/no_such_file.py b/python/sglang/srt/no_such_file.py\n"
        "--- a/python/sglang/srt/no_such_file.py\n+++ b/python/sglang/srt/no_such_file.py\n@@ -1 +1 @@\n-a\n+b\n"
    )
    case.append_patch("0003-missing.patch", mkpatch("missing", diff))
    refused_apply(case, "no_such_file.py does not exist", "-p level")


def test_wrong_strip_level(case):
    name = patch_names(case)[0]
    (case.project / "series").write_text((case.project / "series").read_text().replace(name, name + " -p0"))
    refused_apply(case, name, "a/python/sglang/version.py does not exist", "-p level")


def _new_file_diff(path: str, content: str = "x = 1\n", quoted: str | None = None) -> str:
    a, b = (f'"a/{quoted}"', f'"b/{quoted}"') if quoted else (f"a/{path}", f"b/{path}")
    return (
        f"diff --git {a} {b}\nnew file mode 100644\nindex 0000000..1111111\n--- /dev/null\n+++ {b}\n"
        f"@@ -0,0 +1 @@\n+{content}"
    )


def test_patch_with_dotdot_path(case):
    case.append_patch("0003-up.patch", mkpatch("escape", _new_file_diff("../sentinel/pwned.py")))
    refused_apply(case, "0003-up.patch", "'..'")


def test_patch_with_absolute_path(case):
    target = f"{case.sentinel}/pwned.py"
    diff = f"--- /dev/null\n+++ {target}\n@@ -0,0 +1 @@\n+x = 1\n"
    case.append_patch("0003-abs.patch", mkpatch("absolute", diff), "0003-abs.patch -p0")
    refused_apply(case, "0003-abs.patch", "absolute")


def test_patch_with_octal_quoted_dotdot(case):
    case.append_patch("0003-quoted.patch", mkpatch("quoted", _new_file_diff("", quoted="\\056\\056/sentinel/pwned.py")))
    refused_apply(case, "0003-quoted.patch", "'..'")


def test_patch_rename_out_of_tree(case):
    diff = (
        "diff --git a/python/sglang/version.py b/python/sglang/version.py\nsimilarity index 100%\n"
        "rename from python/sglang/version.py\nrename to ../sentinel/version.py\n"
    )
    case.append_patch("0003-rename.patch", mkpatch("rename out", diff))
    refused_apply(case, "0003-rename.patch", "'..'")


def test_patch_into_dot_git(case):
    case.append_patch("0003-hook.patch", mkpatch("hook", _new_file_diff(".git/hooks/post-checkout", "touch /tmp/pwned\n")))
    refused_apply(case, "0003-hook.patch", ".git")


def _symlink_diff(path: str, target: str) -> str:
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 120000\nindex 0000000..2222222\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1 @@\n+{target}\n\\ No newline at end of file\n"
    )


def test_patch_writing_through_symlink_made_by_earlier_patch(case):
    case.append_patch("0003-link.patch", mkpatch("link", _symlink_diff("python/escape", str(case.sentinel))))
    case.append_patch("0004-through.patch", mkpatch("through", _new_file_diff("python/escape/pwned.py")))
    refused_apply(case, "0004-through.patch", "beyond a symbolic link")
    assert not (case.fork / "python" / "escape").exists()


def test_patch_writing_through_symlink_in_upstream_tree(case):
    """git source whose tree has a symlink leading out; a patch writing through it is refused."""
    mirror = case.tmp / "t" / "mirror"
    git(case.tmp, "clone", "-q", "--branch", "upstream", str(case.fork), str(mirror))
    os.symlink(str(case.sentinel), mirror / "python" / "outside")
    git(mirror, "add", "python/outside")
    git(mirror, *DEV, "commit", "-qm", "upstream with a symlink")
    git(mirror, "tag", "v0.5.9")
    lock = read_lock(case.project)
    lock.url, lock.commit = f"file://{mirror}", git(mirror, "rev-parse", "HEAD")
    write_lock(case.project, lock)
    (case.project / "series").write_text("0001-through.patch\n")
    (case.project / "patches" / "0001-through.patch").write_bytes(mkpatch("through", _new_file_diff("python/outside/pwned.py")))
    fork2 = case.tmp / "fork2"
    case.allowed.add("fork2")
    cache = {"SGLPATCH_CACHE": str(case.tmp / "t" / "cache")}
    try:
        proc = case.apply("--source", "git", workdir=fork2, env=cache)
        refused(proc, "0001-through.patch", "beyond a symbolic link")
        assert list(case.sentinel.iterdir()) == []
        (case.project / "patches" / "0001-through.patch").write_bytes(mkpatch("inside", _new_file_diff("python/inside.py")))
        ok(case.apply("--source", "git", workdir=fork2, env=cache))
        assert (fork2 / "python" / "outside").is_symlink() and list(case.sentinel.iterdir()) == []
    finally:
        shutil.rmtree(mirror)
        shutil.rmtree(case.tmp / "t" / "cache", ignore_errors=True)
    case.outside_clean()


def test_patch_file_is_a_symlink(case):
    secret = case.sentinel / "secret.patch"
    secret.write_bytes((case.golden["project"] / "patches" / patch_names(case)[0]).read_bytes())
    os.symlink(secret, case.project / "patches" / "0003-link.patch")
    with open(case.project / "series", "a") as f:
        f.write("0003-link.patch\n")
    before = case.state()
    refused(case.apply(), "symbolic link")
    assert case.state() == before
    secret.unlink()
    (case.project / "patches" / "0003-link.patch").unlink()
    case.restore("series")
    ok(case.apply())
    case.outside_clean()


def test_crlf_converted_patch(case):
    name = patch_names(case)[0]
    path = case.project / "patches" / name
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    refused_apply(case, name, "CRLF", "dos2unix")


def test_patch_to_upstream_crlf_file_works(case):
    """Upstream has CRLF files (AMD MoE configs); a valid patch to one applies and exports byte-stably."""
    f = case.fork / CRLF_FILE
    data = f.read_bytes()
    assert b"\r\n" in data
    f.write_bytes(data.replace(b'"BLOCK_SIZE_M": 64', b'"BLOCK_SIZE_M": 32', 1))
    git(case.fork, *DEV, "commit", "-qam", f"moe: tune a CRLF config\n\n{DEP3}")
    ok(case.export())
    exported = snapshot(case.project)
    fork2 = case.tmp / "fork2"
    case.allowed.add("fork2")
    subprocess.run(["cp", "-a", str(case.golden["fork"]), str(fork2)], check=True)
    ok(case.apply(workdir=fork2))
    assert git(fork2, "rev-parse", "patched^{tree}") == git(case.fork, "rev-parse", "patched^{tree}")
    ok(case.run("export", "--project", str(case.project), "--workdir", str(fork2)))
    assert snapshot(case.project) == exported
    case.outside_clean()


def test_valid_binary_patch_works(case):
    (case.fork / "python" / "sglang" / "blob.bin").write_bytes(bytes(range(256)) * 8)
    git(case.fork, "add", "python/sglang/blob.bin")
    git(case.fork, *DEV, "commit", "-qm", f"add a binary file\n\n{DEP3}")
    ok(case.export())
    name = patch_names(case)[-1]
    assert b"GIT binary patch" in (case.project / "patches" / name).read_bytes()
    exported = snapshot(case.project)
    fork2 = case.tmp / "fork2"
    case.allowed.add("fork2")
    subprocess.run(["cp", "-a", str(case.golden["fork"]), str(fork2)], check=True)
    ok(case.apply(workdir=fork2))
    assert (fork2 / "python" / "sglang" / "blob.bin").read_bytes() == bytes(range(256)) * 8
    ok(case.run("export", "--project", str(case.project), "--workdir", str(fork2)))
    assert snapshot(case.project) == exported
    case.outside_clean()


def test_corrupt_binary_patch(case, tmp_path):
    # a NUL byte makes git treat it as binary whatever the random bytes are
    (case.fork / "python" / "sglang" / "blob.bin").write_bytes(b"\0" + os.urandom(511))
    git(case.fork, "add", "python/sglang/blob.bin")
    git(case.fork, *DEV, "commit", "-qm", f"add a binary file\n\n{DEP3}")
    ok(case.export())
    name = patch_names(case)[-1]
    path = case.project / "patches" / name
    lines = path.read_bytes().split(b"\n")
    k = next(i for i, line in enumerate(lines) if line.startswith(b"GIT binary patch")) + 3
    lines[k] = lines[k][:1] + bytes(reversed(lines[k][1:]))
    path.write_bytes(b"\n".join(lines))
    # the workdir must not be the source of truth here: take a clean copy
    shutil.rmtree(case.fork)
    subprocess.run(["cp", "-a", str(case.golden["fork"]), str(case.fork)], check=True)
    (case.fork / "my-notes.txt").write_text("the user's untracked notes\n")

    def fix():
        path.unlink()
        case.restore("series")

    refused_apply(case, name, "does not apply", fix=fix)


def test_non_utf8_header(case):
    case.append_patch("0003-latin1.patch", mkpatch("caf\xe9", _new_file_diff("python/latin.py")).replace("caf\xe9".encode(), b"caf\xe9"))
    refused_apply(case, "0003-latin1.patch", "not UTF-8", "sglpatch export")


# --------------------------------------------------------------------------------------
# upstream.lock


def _lock_text(c: Case, old: str, new: str) -> None:
    path = c.project / "upstream.lock"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_lock_wrong_sha256(case):
    """A wrong (well-formed) sha256: the good cached sdist is kept, the error names the field."""
    lock = read_lock(case.project)
    _lock_text(case, lock.sdist_sha256, "0" * 64)
    case.runs_pip = True
    dead = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
            "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "0", "PIP_NO_CACHE_DIR": "1"}
    refused_apply(case, "sdist.sha256", "upstream.lock", "fix sdist.sha256", env=dead)


def test_lock_wrong_blob_id(case):
    lock = read_lock(case.project)
    path = sorted(lock.blobs)[0]
    _lock_text(case, lock.blobs[path], "1" * 40)
    refused_apply(case, f"blobs.{path!r}")


def test_lock_unknown_field(case):
    _lock_text(case, 'version = "0.5.9"\n', 'version = "0.5.9"\nmirror = "https://example.com"\n')
    refused_apply(case, "unknown field upstream.mirror")


def test_lock_missing_field(case):
    _lock_text(case, 'filename = "sglang-0.5.9.tar.gz"\n', "")
    refused_apply(case, "missing field sdist.filename")


def test_lock_not_toml(case):
    _lock_text(case, "[sdist]", "[sdist")
    refused_apply(case, "not valid TOML")


def test_lock_commit_disagrees_with_sdist(case):
    _lock_text(case, 'commit = "bbe9c7eeb"', 'commit = "abcdef123"')
    refused_apply(case, "upstream.commit", "_version.py")


@pytest.mark.parametrize(
    "url, needle",
    [
        ("ext::sh -c touch% {sentinel}/ext", "upstream.url"),
        ("ext::sh", "transport helpers"),
        ("--upload-pack=touch {sentinel}/up", "upstream.url"),
        ("ssh://-oProxyCommand=touch%20{sentinel}/ssh/x", "must not start with '-'"),
        ("git@-oProxyCommand=x:y", "upstream.url"),
        ("fd::3", "transport helpers"),
        ("http://127.0.0.1:9/sglang", "only https"),
    ],
    ids=["ext-space", "ext", "upload-pack", "ssh-proxycommand", "scp-dash-host", "fd", "http"],
)
def test_lock_hostile_url(case, url, needle):
    lock_path = case.project / "upstream.lock"
    text = lock_path.read_text().replace("https://github.com/sgl-project/sglang", url.format(sentinel=case.sentinel), 1)
    lock_path.write_text(text)
    before = case.state()
    refused(case.apply("--source", "git"), needle)
    refused(case.apply("--source", "auto", "--probe-timeout", "2"), needle)
    assert case.state() == before
    case.outside_clean()
    case.restore("upstream.lock")
    ok(case.apply())


@pytest.mark.parametrize(
    "url", ["ext::sh -c touch% /tmp/sglpatch-pwned", "--upload-pack=touch /tmp/x", "ssh://-oProxyCommand=x/y"],
    ids=["ext", "upload-pack", "ssh-proxycommand"],
)
def test_cli_hostile_upstream_url(case, url):
    before = case.state()
    refused(case.apply("--source", "git", f"--upstream-url={url}"), "invalid upstream url")
    assert case.state() == before and not Path("/tmp/sglpatch-pwned").exists()
    case.outside_clean()
    ok(case.apply())


@pytest.mark.parametrize("tag", ["-v0.5.9", "--output=/tmp/x", "v0.5.9..HEAD"])
def test_lock_tag_option_looking(case, tag):
    _lock_text(case, 'tag = "v0.5.9"', f'tag = "{tag}"')
    before = case.state()
    refused(case.apply("--source", "git"), "upstream.tag")
    assert case.state() == before
    case.restore("upstream.lock")
    ok(case.apply())
    case.outside_clean()


def _evil_tarball(dest: Path, member: str, link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("sglang-0.5.9/sglang/__init__.py")
        info.size = 0
        tf.addfile(info, io.BytesIO(b""))
        info = tarfile.TarInfo(member)
        if link:
            info.type, info.linkname = tarfile.SYMTYPE, link
            tf.addfile(info)
        else:
            info.size = 4
            tf.addfile(info, io.BytesIO(b"pwnd"))
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["dotdot", "symlink"])
def test_hostile_sdist_with_matching_sha(fresh, kind):
    """Even a tarball the lock vouches for cannot write outside the tree."""
    c = fresh
    cache = c.tmp / "t" / "cache"
    (cache / "sdist").mkdir(parents=True)
    if kind == "dotdot":
        data = _evil_tarball(cache, "sglang-0.5.9/../../sentinel/pwned")
    else:
        data = _evil_tarball(cache, "sglang-0.5.9/sglang/evil", link=str(c.sentinel))
    (cache / "sdist" / "sglang-0.5.9.tar.gz").write_bytes(data)
    import hashlib

    _lock_text(c, read_lock(c.project).sdist_sha256, hashlib.sha256(data).hexdigest())
    refused(c.apply(env={"SGLPATCH_CACHE": str(cache)}), "sglang-0.5.9.tar.gz", "refusing" if kind == "symlink" else "leaves the tree")
    assert list(c.sentinel.iterdir()) == []
    shutil.rmtree(cache)
    c.restore("upstream.lock")
    ok(c.apply())
    c.outside_clean()


# --------------------------------------------------------------------------------------
# the workdir


def test_dirty_workdir(case):
    f = case.fork / P1_FILE
    f.write_text(f.read_text() + "# my experiment\n")
    g = case.fork / P2_FILE
    g.write_text(g.read_text() + "# staged experiment\n")
    git(case.fork, "add", P2_FILE)
    before = case.state()
    with open(case.project / "series", "a") as s:
        s.write("# a series change that would make apply rebuild\n")
    for extra in ((), ("--force",)):
        refused(case.apply(*extra), "uncommitted changes", "nothing was changed")
        assert case.state() == before
    for cmd in ("status", "check"):
        case.run(cmd, "--project", str(case.project), "--workdir", str(case.fork))
    ok(case.export())  # export warns, and keeps the edits
    assert case.state() == before
    git(case.fork, "stash", "-q")
    ok(case.apply())
    git(case.fork, "stash", "pop", "-q")
    assert case.state()["diff"] == before["diff"]
    case.outside_clean()


def test_detached_head(case):
    git(case.fork, "checkout", "-q", "--detach", "patched~1")
    before = case.state()
    refused(case.apply(), "detached", "checkout patched")
    assert case.state() == before
    git(case.fork, "checkout", "-q", "patched")
    ok(case.apply())
    case.outside_clean()


def test_foreign_branch_checked_out(case):
    git(case.fork, "checkout", "-q", "-b", "my-experiment")
    before = case.state()
    refused(case.apply(), "my-experiment", "checkout patched")
    assert case.state() == before
    git(case.fork, "checkout", "-q", "patched")
    ok(case.apply())
    case.outside_clean()


@pytest.mark.parametrize("kind", ["plain-dir", "foreign-repo", "a-file", "subdir-of-workdir", "not-applied-export"])
def test_workdir_not_ours(case, kind):
    other = case.tmp / "other"
    case.allowed.add("other")
    if kind == "plain-dir":
        other.mkdir()
        (other / "thesis.tex").write_text("mine")
    elif kind == "foreign-repo":
        other.mkdir()
        git(other, "init", "-q")
        (other / "app.py").write_text("mine")
        git(other, "add", "app.py")
        git(other, *DEV, "commit", "-qm", "mine")
    elif kind == "a-file":
        other.write_text("mine")
    elif kind == "subdir-of-workdir":
        other = case.fork / "python"
    before = snapshot(other) if other.is_dir() and kind != "subdir-of-workdir" else None
    if kind == "not-applied-export":
        other.mkdir()
        msg = refused(case.run("export", "--project", str(case.project), "--workdir", str(other)), "not set up yet", "sglpatch apply")
    else:
        msg = refused(case.apply(workdir=other), "choose")
    assert "\n" not in msg
    if before is not None:
        assert snapshot(other) == before
    if kind == "a-file":
        assert other.read_text() == "mine"
    case.outside_clean()
    ok(case.apply())


def test_unexported_commit(case):
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# tuned\n")
    git(case.fork, *DEV, "commit", "-qam", f"environ: tuned\n\n{DEP3}")
    before = case.state()
    with open(case.project / "series", "a") as s:
        s.write("# edited\n")
    refused(case.apply(), "not in the series", "sglpatch export", "--force")
    assert case.state() == before
    ok(case.export())
    ok(case.apply())
    assert case.state()["heads"] == before["heads"]
    case.outside_clean()


def test_stale_index_lock(case):
    (case.fork / ".git" / "index.lock").write_text("")
    with open(case.project / "series", "a") as s:
        s.write("# edited\n")
    before = case.state()
    refused(case.apply(), "index.lock", "remove that file")
    assert case.state() == before
    (case.fork / ".git" / "index.lock").unlink()
    ok(case.apply())
    case.outside_clean()


def test_hostile_local_git_config_does_not_run(case):
    """The workdir's own .git/config and hooks are the user's; sglpatch never runs them."""
    pwn = f"touch {case.sentinel}/ran"
    for key, value in (("core.fsmonitor", pwn), ("core.pager", pwn), ("diff.external", pwn), ("core.sshCommand", pwn)):
        git(case.fork, "config", key, value)
    hook = case.fork / ".git" / "hooks" / "post-checkout"
    hook.write_text(f"#!/bin/sh\n{pwn}\n")
    hook.chmod(0o755)
    (case.fork / ".git" / "hooks" / "reference-transaction").write_text(f"#!/bin/sh\n{pwn}\n")
    (case.fork / ".git" / "hooks" / "reference-transaction").chmod(0o755)
    case.restore("series")
    (case.project / "series").write_text((case.project / "series").read_text() + "# rebuild\n")
    ok(case.apply())
    ok(case.export())
    ok(case.run("status", "--project", str(case.project), "--workdir", str(case.fork)))
    assert list(case.sentinel.iterdir()) == []
    case.outside_clean()


def test_two_applies_at_once(fresh):
    """Two real apply processes on one workdir: the second is refused by the lock file."""
    c = fresh
    env = c.env()
    first = subprocess.Popen(
        [sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(c.project), "--workdir", str(c.fork), "--no-install", "--source", "sdist"],
        cwd=c.tmp, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    for line in first.stderr:
        if "sglang-0.5.9.tar.gz" in line:  # "extracting ..." or "taking the tree of ... from the tree cache": the lock is held
            break
    # held there with a real SIGSTOP: a tree from the tree cache makes the rest of the apply fast
    # enough to finish before the other two start (CI saw the export pass, stop 33)
    first.send_signal(signal.SIGSTOP)
    try:
        second = c.apply()
        export = c.export()
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    refused(second, "another sglpatch command", "wait for it")
    refused(export, "another sglpatch command")
    c.in_sync()
    ok(c.apply())
    c.outside_clean()


# --------------------------------------------------------------------------------------
# disk full


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(path: Path) -> Path:
    filler = path / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def _grow_last_patch(c: Case) -> None:
    f = c.fork / P2_FILE
    f.write_text(f.read_text() + "".join(f"# long experiment line {i}\n" for i in range(400)))
    git(c.fork, *DEV, "commit", "-qa", "--amend", "--no-edit")


def test_disk_full_during_export_real_tmpfs(case):
    mnt = case.tmp / "project"
    saved = case.tmp / "t" / "saved"
    shutil.copytree(mnt, saved)
    shutil.rmtree(mnt)
    if not _mount_tmpfs(mnt, "256k"):
        shutil.rmtree(saved)
        pytest.skip("cannot mount a tmpfs here (the monkeypatched variant covers the case)")
    try:
        shutil.copytree(saved, mnt, dirs_exist_ok=True)
        shutil.rmtree(saved)
        _grow_last_patch(case)
        before_proj = snapshot(mnt)
        before = case.state()
        filler = _fill(mnt)
        refused(case.export(), "no space left on device", "free space and re-run")
        after = snapshot(mnt)
        after.pop(".filler")
        assert after == before_proj, "export left a partial file"
        assert case.state() == before
        filler.unlink()
        ok(case.export())
        assert b"long experiment line 399" in (mnt / "patches" / patch_names(case)[1]).read_bytes()
        assert not [p for p in mnt.rglob("*.tmp")]
        ok(case.apply())
        case.in_sync()
        kept = snapshot(mnt)
    finally:
        _umount(mnt)
    shutil.rmtree(mnt, ignore_errors=True)
    assert kept
    case.outside_clean()


def test_disk_full_during_export_simulated(case, monkeypatch, capsys):
    """In-process CLI with os.replace failing with ENOSPC on the second file: each file old or new."""
    from sglpatch import cli, fsutil

    _grow_last_patch(case)
    f = case.fork / P1_FILE
    f.write_text(f.read_text() + "# another\n")
    git(case.fork, *DEV, "commit", "-qam", f"third\n\n{DEP3}")
    before_proj = snapshot(case.project)
    calls = {"n": 0}
    real_replace = os.replace

    def replace(src, dst):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", replace)
    rc = cli.main(["export", "--project", str(case.project), "--workdir", str(case.fork)])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip().splitlines()[-1].startswith("sglpatch: error: no space left on device"), err
    now = snapshot(case.project)
    assert not [k for k in now if k.endswith(".tmp")]
    assert now["series"] == before_proj["series"]
    monkeypatch.setattr(fsutil.os, "replace", real_replace)
    assert cli.main(["export", "--project", str(case.project), "--workdir", str(case.fork)]) == 0
    assert len(patch_names(case)) == 3
    ok(case.apply())
    case.in_sync()


def test_disk_full_during_apply_real_tmpfs(fresh):
    c = fresh
    if not _mount_tmpfs(c.fork, "2m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        msg = refused(c.apply(), "No space left on device")
        assert "\n" not in msg
        subprocess.run(["mount", "-o", "remount,size=512m", str(c.fork)], check=True)
        ok(c.apply())
        c.in_sync()
        c.outside_clean()
    finally:
        _umount(c.fork)


# --------------------------------------------------------------------------------------
# network and pip


def _tampered_sdist(data: bytes) -> bytes:
    """The real sdist plus one extra file: a valid archive pip accepts, with another sha256."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as src, tarfile.open(fileobj=out, mode="w:gz") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        info = tarfile.TarInfo("sglang-0.5.9/sglang/injected.py")
        payload = b"import os  # not upstream\n"
        info.size = len(payload)
        dst.addfile(info, io.BytesIO(payload))
    return out.getvalue()


class _Index:
    """A PEP 503 index on 127.0.0.1 serving the sdist whole, cut in the middle, or tampered."""

    def __init__(self, data: bytes):
        self.data, self.mode = data, "cut"
        self.tampered = _tampered_sdist(data)
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.rstrip("/") == "/simple/sglang":
                    body = b'<html><body><a href="/files/sglang-0.5.9.tar.gz">sglang-0.5.9.tar.gz</a></body></html>'
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/files/sglang-0.5.9.tar.gz":
                    data = outer.tampered if outer.mode == "tampered" else outer.data
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if outer.mode == "cut":
                        self.wfile.write(data[: len(data) // 3])
                        self.wfile.flush()
                        self.connection.shutdown(2)
                    else:
                        self.wfile.write(data)
                else:
                    self.send_response(404)
                    self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _pip_env(index_url: str, cache: Path) -> dict:
    # the user's pip configuration with this index; no build isolation (offline build deps)
    return {
        "PIP_INDEX_URL": index_url,
        "PIP_RETRIES": "0",
        "PIP_DEFAULT_TIMEOUT": "10",
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_NO_CACHE_DIR": "1",
        "SGLPATCH_CACHE": str(cache),
    }


@pytest.mark.parametrize("mode", ["cut", "tampered"])
def test_interrupted_or_tampered_sdist_download(fresh, sdist_059, mode):
    c = fresh
    c.runs_pip = True
    cache = c.tmp / "cache"
    c.allowed.add("cache")
    index = _Index(sdist_059.read_bytes())
    index.mode = mode
    try:
        env = _pip_env(index.url, cache)
        proc = c.apply(env=env)
        refused(proc, *(("pip download", "re-run") if mode == "cut" else ("sdist.sha256",)))
        assert listing(cache / "sdist") == {}, "a partial or unverified sdist was kept"
        c.outside_clean()
        index.mode = "full"
        done = ok(c.apply(env=env))
        assert "  pip: Collecting sglang==0.5.9" in done.stderr  # the download shows progress
        assert sha256_file(cache / "sdist" / "sglang-0.5.9.tar.gz") == read_lock(c.project).sdist_sha256
        c.in_sync()
    finally:
        index.close()
    c.outside_clean()


def test_pip_failing_during_install(case):
    """Real pip with no reachable index cannot get build dependencies: the tree is kept, re-run installs."""
    from conftest import make_venv

    env_dir = case.tmp / "t" / "venv"
    py = make_venv(env_dir)
    args = ("apply", "--project", str(case.project), "--workdir", str(case.fork), "--source", "sdist", "--python", str(py), "--installer", "pip")
    with open(case.project / "series", "a") as s:
        s.write("# rebuild\n")
    bad = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
           "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "0", "PIP_NO_CACHE_DIR": "1"}
    before_notes = case.state()["notes"]
    proc = case.run(*args, env=bad)
    refused(proc, "installing", "failed", "fix the environment and re-run")
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    assert case.state()["notes"] == before_notes
    case.in_sync()
    proc = ok(case.run(*args, env={"PIP_NO_BUILD_ISOLATION": "0"}))
    assert f"imports sglang 0.5.9 from {case.fork.resolve()}/python/sglang/__init__.py" in proc.stdout
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    shutil.rmtree(env_dir)
    case.runs_pip = True
    case.outside_clean()


# --------------------------------------------------------------------------------------
# SIGKILL at each step, then a re-run


FRESH_STEPS = ["init", "apply:locked", "materialize:extract", "materialize:built", "materialize:ref",
               "apply:patch:1", "apply:patch:2", "apply:checkout", "apply:moved"]


@pytest.mark.parametrize("step", FRESH_STEPS)
def test_sigkill_during_first_apply(fresh, golden, step):
    c = fresh
    proc = c.apply(env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ok(c.apply())
    c.in_sync()
    assert git(c.fork, "rev-parse", "patched^{tree}") == git(golden["fork"], "rev-parse", "patched^{tree}")
    assert git(c.fork, "rev-list", "--count", "upstream..patched") == "2"
    c.outside_clean()


REBUILD_STEPS = ["apply:locked", "apply:patch:1", "apply:patch:3", "apply:backup", "apply:moved"]


@pytest.mark.parametrize("step", REBUILD_STEPS)
def test_sigkill_during_rebuild(case, step):
    """apply over an existing workdir whose series grew a patch (and with --force over unexported work)."""
    diff = _new_file_diff("python/sglang/srt/fm_third.py")
    case.append_patch("0003-third.patch", mkpatch("third", diff))
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# my unexported work\n")
    git(case.fork, *DEV, "commit", "-qam", "wip")
    mine = git(case.fork, "rev-parse", "patched")
    proc = case.apply("--force", env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # the unexported commit is on patched or in a backup ref, never lost
    assert mine in git(case.fork, "for-each-ref", "--format=%(objectname)", "refs/heads/patched", "refs/sglpatch/backup/")
    assert (case.fork / "my-notes.txt").exists()
    ok(case.apply("--force"))
    case.in_sync()
    assert mine in git(case.fork, "for-each-ref", "--format=%(objectname)", "refs/sglpatch/backup/")
    assert git(case.fork, "log", "--format=%s", "-1", "patched") == "third"
    case.outside_clean()


EXPORT_STEPS = ["export:patch:1", "export:patch:2", "export:patch:3", "export:removed", "export:series"]


@pytest.fixture(scope="session")
def export_expected(golden, tmp_path_factory):
    """What a clean export of the edited stack below writes."""
    c = Case(tmp_path_factory.mktemp("fm-export"), golden)
    _edit_stack_for_export(c)
    ok(c.export())
    return snapshot(c.project)


def _edit_stack_for_export(c: Case) -> None:
    # a new patch 3, an amended patch 2... (patch 3 amended with a new file), a stale series entry to remove
    f = c.fork / P1_FILE
    f.write_text(f.read_text() + "# stage 3\n")
    git(c.fork, *DEV, "commit", "-qam", f"version: a third patch\n\n{DEP3}")
    (c.fork / "python" / "sglang" / "fm_edit.txt").write_text("edited\n")
    git(c.fork, "add", "python/sglang/fm_edit.txt")
    git(c.fork, *DEV, "commit", "-q", "--amend", "--no-edit")
    with open(c.project / "series", "a") as s:
        s.write("# trailing comment\n")
    (c.project / "patches" / "0009-stale.patch").write_bytes((c.project / "patches" / patch_names(c)[0]).read_bytes())
    with open(c.project / "series", "a") as s:
        s.write("0009-stale.patch\n")


@pytest.mark.parametrize("step", EXPORT_STEPS)
def test_sigkill_during_export(case, export_expected, step):
    _edit_stack_for_export(case)
    f = case.fork / P2_FILE
    f.write_text(f.read_text() + "# uncommitted edit\n")
    before = case.state()
    proc = case.export(env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert case.state() == before
    assert not [p for p in case.project.rglob("*.tmp")]
    ok(case.export())
    assert snapshot(case.project) == export_expected
    assert case.state() == before
    case.outside_clean()


def test_sigkill_from_outside_mid_apply(fresh):
    """A real kill -9 of the whole process group (sglpatch and its git) as soon as the first patch lands."""
    c = fresh
    p = subprocess.Popen(
        [sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(c.project), "--workdir", str(c.fork), "--no-install", "--source", "sdist"],
        cwd=c.tmp, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=c.env(), start_new_session=True,
    )
    for line in p.stderr:
        if "[1/2]" in line:
            os.killpg(p.pid, signal.SIGKILL)
            break
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# SIGKILL at each step of a rebase onto 0.5.10.post1 (the real sdist), then the documented
# recovery: before the rebase has saved its state, the same command again; after that,
# `--continue` (the re-run says so in one line), or `--abort` (byte for byte)

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


# (step, recovery): "rerun" = the same command again (no rebase state saved yet);
# "continue" = the re-run is refused with one line naming --continue, which completes the rebase
REBASE_STEPS = [
    ("materialize:extract", "rerun"),  # extracting the new upstream's sdist
    ("rebase:upstream", "rerun"),  # the new upstream commit built, nothing else
    ("rebase:snapshot", "rerun"),  # project snapshot taken, state.json not written yet
    ("rebase:saved", "continue"),  # state.json written, no patch done
    ("rebase:patch:2", "continue"),  # mid-series (every rebase:patch:K leaves the same state)
    ("rebase:progress", "continue"),  # every patch done and saved, nothing moved yet
    ("rebase:finish:backup", "continue"),  # pre-rebase backup refs written
    ("rebase:finish:upstream", "continue"),  # `upstream` moved
    ("rebase:finish:patched", "continue"),  # `patched` moved and checked out
    ("rebase:finish:report", "continue"),  # rebase-reports/ written
    ("rebase:finish:export", "continue"),  # patches/ + series written, P3 removed
    ("rebase:finish:lock", "continue"),  # upstream.lock written
    ("rebase:finish:changelog", "continue"),  # CHANGELOG.md written
    ("rebase:finish:recorded", "continue"),  # the workdir recorded as in sync, state not yet removed
]


@pytest.mark.parametrize("step, recovery", REBASE_STEPS, ids=[s for s, _ in REBASE_STEPS])
def test_sigkill_during_rebase(tmp_path, rb_golden, rb_after, step, recovery):
    c = Case(tmp_path, rb_golden)
    orig = {b: git(c.fork, "rev-parse", b) for b in ("patched", "upstream")}
    before = snapshot(c.project)
    proc = _rebase(c, env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    _users_work_kept(c, orig)
    for rel, data in snapshot(c.project).items():  # each project file is the old one or the new one, never half
        assert data in (before.get(rel), rb_after["project"].get(rel)), f"{rel} is neither as before nor as after the rebase"
    if recovery == "rerun":
        ok(_rebase(c))
    else:
        refused(_rebase(c), "already in progress", "interrupted", f"sglpatch rebase --workdir {c.fork} --continue", "--abort")
        ok(_rebase(c, "--continue"))
    assert snapshot(c.project) == rb_after["project"]
    assert _heads(c.fork) == rb_after["heads"]
    _users_work_kept(c, orig)
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    assert git(c.fork, "for-each-ref", "refs/sglpatch/rebase/") == ""
    c.in_sync()
    c.outside_clean()


def test_sigkill_late_in_rebase_then_abort(tmp_path, rb_golden, rb_after):
    """--abort also works after a kill in the finishing step (project half rewritten, branches moved)."""
    c = Case(tmp_path, rb_golden)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    proc = _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:finish:changelog"})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert snapshot(c.project) != before and _heads(c.fork) == rb_after["heads"]
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd
    assert snapshot(c.project) == before
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    c.in_sync()  # back on the old pin, in sync: a new rebase starts from here (as in rebase:snapshot above)
    c.outside_clean()


STOP_STEPS = ["rebase:stop:checkout", "rebase:stop:applied", "rebase:stop:saved"]


@pytest.mark.parametrize("step", STOP_STEPS)
def test_sigkill_at_rebase_conflict_stop_then_abort(tmp_path, rb_conflict, step):
    """A series whose last patch conflicts on 0.5.10.post1 with no recorded resolution: killed while
    stopping for the user (detached at the new stack, the patch 3-way applied); --abort restores all."""
    c = Case(tmp_path, rb_conflict)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    proc = _rebase(c, env={"SGLPATCH_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert (c.fork / "my-notes.txt").read_text() == "the user's untracked notes\n"
    assert _heads(c.fork) == _heads(rb_conflict["fork"])  # no branch moved
    assert snapshot(c.project) == before  # the project is written only at the very end
    msg = refused(_rebase(c), "already in progress", "--continue", "--abort")
    if step == "rebase:stop:saved":
        assert "stopped at patch 4/4" in msg
    if step == "rebase:stop:applied":  # --continue redoes the interrupted stop properly
        res = _rebase(c, "--continue")
        assert res.returncode == 3 and "rebase stopped at patch 4/4" in res.stdout, res.stdout + res.stderr
        assert "<<<<<<<" in (c.fork / GATE).read_text() and git(c.fork, "ls-files", "-u")
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd
    assert snapshot(c.project) == before
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    c.in_sync()
    c.outside_clean()
