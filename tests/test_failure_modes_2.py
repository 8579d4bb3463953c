"""More hostile input and faults (issue 21): a second real process racing a rebase, commands run
while a rebase is half done, writes through symbolic links, a poisoned or damaged tree cache,
read-only file systems, damaged rebase state, a half-built venv, leftovers of a killed watch.

The same world and the same five guarantees as tests/test_failure_modes.py (whose fixtures and
helpers this file uses; docs/failure-modes.md lists every case). Concurrency is two real
processes and a file barrier: ``SGLPATCH_PAUSE_AT=STEP`` makes one wait at a named step
(``fsutil.crashpoint``) until the test lets it go. Read-only file systems are real (a tmpfs
remounted read-only: root ignores file modes, not a read-only mount).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SDIST_0510_SHA256, git, loosen
from sglpatch.upstream.pin import read_lock
import test_failure_modes as fm
import test_venv_preflight as vp
from test_failure_modes import (
    DEP3,
    DEV,
    GATE,
    P2_FILE,
    REBASE_TARGET,
    Case,
    _exact,
    _heads,
    _mount_tmpfs,
    _rebase,
    _umount,
    ok,
    patch_names,
    refused,
    refused_apply,
    snapshot,
)
from test_venv_preflight import UV, release, wheel

# the fixtures of the first catalogue (each built once per session: fm.once) and the venv tests' env
golden, case, fresh, rb_golden, rb_conflict, rb_after = fm.golden, fm.case, fm.fresh, fm.rb_golden, fm.rb_conflict, fm.rb_after
env = vp.env

T = REBASE_TARGET
KILLED = -signal.SIGKILL


# --------------------------------------------------------------------------------------
# helpers: a barrier, a second process, a private cache, a local index, read-only mounts


class Barrier:
    """A named step where one real process waits (fsutil.crashpoint) until the test says go."""

    def __init__(self, c: Case, name: str = "b"):
        d = c.tmp / "barrier"
        d.mkdir(exist_ok=True)
        c.allowed.add("barrier")
        self.base = d / name

    def env(self, step: str) -> dict:
        return {"SGLPATCH_PAUSE_AT": step, "SGLPATCH_PAUSE_FILE": str(self.base), "SGLPATCH_PAUSE_TIMEOUT": "240"}

    def reached(self, proc: subprocess.Popen, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not Path(f"{self.base}.reached").exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"the process ended (exit {proc.returncode}) before the barrier:\n{out}{err}")
            assert time.monotonic() < deadline, "the barrier was not reached"
            time.sleep(0.05)

    def go(self) -> None:
        Path(f"{self.base}.go").touch()


def popen(c: Case, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sglpatch.cli", *args], cwd=c.tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=c.env(env))


def rebase_args(c: Case, *args: str) -> tuple:
    return ("rebase", "--workdir", str(c.fork), "--project", str(c.project), *(args or ("--onto", T, "--source", "sdist", "--promote")))


def private_cache(c: Case, where: Path | None = None) -> Path:
    """A cache of our own (the shared one stays untouched), holding copies of the two sdists."""
    cache = where or c.tmp / "cache"
    (cache / "sdist").mkdir(parents=True, exist_ok=True)
    for name in ("sglang-0.5.9.tar.gz", f"sglang-{T}.tar.gz"):
        shutil.copy2(c.golden["cache"] / "sdist" / name, cache / "sdist" / name)
    c.allowed.add(cache.relative_to(c.tmp).parts[0])
    return cache


def index_listing(extra: list | None = None) -> list:
    """PEP 691 file entries: the two sdists with their real sha256 (served from the cache copies)."""
    sha59 = read_lock(Path(__file__).resolve().parents[1]).sdist_sha256
    files = [{"filename": "sglang-0.5.9.tar.gz", "url": "/files/sglang-0.5.9.tar.gz", "hashes": {"sha256": sha59}},
             {"filename": f"sglang-{T}.tar.gz", "url": f"/files/sglang-{T}.tar.gz", "hashes": {"sha256": SDIST_0510_SHA256}}]
    return files + (extra or [])


class JsonIndex:
    """A PEP 691 index on 127.0.0.1 that answers /simple/sglang/ with body."""

    def __init__(self, body: bytes):
        outer = self
        self.body = body

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.rstrip("/") == "/simple/sglang":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                    self.send_header("Content-Length", str(len(outer.body)))
                    self.end_headers()
                    self.wfile.write(outer.body)
                else:
                    self.send_response(404)
                    self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index():
    servers = []

    def make(body) -> JsonIndex:
        servers.append(JsonIndex(body if isinstance(body, bytes) else json.dumps(body).encode()))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def closed_port_url() -> str:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/simple"


class ReadOnly:
    """path on its own tmpfs (its content copied in), remounted read-only and back."""

    def __init__(self, path: Path, size: str = "64m"):
        self.path = path
        saved = path.with_name(path.name + ".saved")
        if path.exists():
            shutil.move(path, saved)
        if not _mount_tmpfs(path, size):
            if saved.exists():
                path.rmdir() if path.exists() else None
                shutil.move(saved, path)
            pytest.skip("cannot mount a tmpfs here")
        if saved.exists():
            shutil.copytree(saved, path, dirs_exist_ok=True, symlinks=True)
            shutil.rmtree(saved)

    def ro(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def rw(self) -> None:
        subprocess.run(["mount", "-o", "remount,rw", str(self.path)], check=True)

    def close(self) -> None:
        saved = self.path.with_name(self.path.name + ".saved")
        self.rw()
        shutil.copytree(self.path, saved, symlinks=True)
        _umount(self.path)
        self.path.rmdir()
        shutil.move(saved, self.path)


def no_timing(text: str) -> str:
    return re.sub(r"\d+\.\d+s", "Xs", text)


def workdir_state(wd: Path) -> dict:
    """_exact, also at a conflict stop (an index with unmerged entries has no tree)."""
    out = {"refs": git(wd, "for-each-ref", "--format=%(refname) %(objectname)"), "HEAD": (wd / ".git" / "HEAD").read_bytes(),
           "config": (wd / ".git" / "config").read_bytes(), "index": git(wd, "ls-files", "--stage")}
    out.update({str(p.relative_to(wd)): p.read_bytes() for p in sorted(wd.rglob("*")) if p.is_file() and ".git" not in p.relative_to(wd).parts})
    return out


def saved_answer(files: list) -> str:
    """An index answer as the cache keeps it (index/sglang.json)."""
    return json.dumps([{"filename": f["filename"], "sha256": f["hashes"]["sha256"], "url": f"http://127.0.0.1:9/files/{f['filename']}"}
                       for f in files])


# --------------------------------------------------------------------------------------
# 1. the workdir lock covers every state-changing command, all of it


@pytest.mark.parametrize("first", ["start", "continue"])
def test_abort_while_a_rebase_finishes_is_refused(tmp_path, rb_golden, rb_after, first):
    """A rebase (or its --continue) paused in its finishing step, `upstream` already moved: an
    --abort, another --continue and an export from a second shell are refused by the lock; the
    rebase then completes exactly as an undisturbed one."""
    c = Case(tmp_path, rb_golden)
    bar = Barrier(c)
    if first == "continue":
        assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:progress"}).returncode == KILLED
        args = rebase_args(c, "--continue")
    else:
        args = rebase_args(c)
    proc = popen(c, *args, env=bar.env("rebase:finish:upstream"))
    bar.reached(proc)
    refused(_rebase(c, "--abort"), "another sglpatch command is working on", str(c.fork))
    refused(_rebase(c, "--continue"), "another sglpatch command is working on")
    refused(c.export(), "another sglpatch command is working on")
    bar.go()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert snapshot(c.project) == rb_after["project"]
    assert _heads(c.fork) == rb_after["heads"]
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# 2. no stack command while a rebase is in progress or half-finished


@pytest.mark.parametrize("when", ["killed-in-finish", "stopped-for-you"])
def test_stack_commands_refuse_while_a_rebase_is_in_progress(tmp_path, rb_golden, rb_conflict, rb_after, when):
    if when == "killed-in-finish":  # `upstream` moved, `patched` not yet: an export would write the whole tree
        c = Case(tmp_path, rb_golden)
        assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:finish:upstream"}).returncode == KILLED
    else:
        c = Case(tmp_path, rb_conflict)
        assert _rebase(c).returncode == 3
    before_wd, before = workdir_state(c.fork), snapshot(c.project)
    where = ("--project", str(c.project), "--workdir", str(c.fork))
    for args in (("export",), ("apply", "--no-install", "--source", "sdist"), ("status",), ("lock", "--update-blobs"), ("check",)):
        refused(c.run(*args, *where), "a rebase is in progress", f"sglpatch rebase --workdir {c.fork} --continue", "--abort")
    assert workdir_state(c.fork) == before_wd
    assert snapshot(c.project) == before
    if when == "killed-in-finish":
        ok(_rebase(c, "--continue"))
        assert snapshot(c.project) == rb_after["project"]
    else:
        ok(_rebase(c, "--abort"))
        assert snapshot(c.project) == before
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# 3. --abort restores what the rebase wrote, nothing else


@pytest.mark.parametrize("when", ["stopped-for-you", "killed-late"])
def test_abort_keeps_what_you_added_during_the_rebase(tmp_path, rb_golden, rb_conflict, when):
    c = Case(tmp_path, rb_conflict if when == "stopped-for-you" else rb_golden)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    if when == "stopped-for-you":
        assert _rebase(c).returncode == 3
    else:  # patches/, series, lock, CHANGELOG and the report written by the rebase
        assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:finish:changelog"}).returncode == KILLED
    mine = {"patches/0099-my-experiment.patch": b"my next patch, not in the series yet\n",
            f"resolutions/{T}/NOTES.md": b"what I tried on the conflict\n"}
    for rel, data in mine.items():
        (c.project / rel).write_bytes(data)
    changelog = (c.project / "CHANGELOG.md").read_bytes() + b"- my note, written during the rebase\n"
    (c.project / "CHANGELOG.md").write_bytes(changelog)
    res = ok(_rebase(c, "--abort"))
    for rel in (*mine, "CHANGELOG.md"):
        assert rel in res.stdout, res.stdout
    expected = dict(before, **mine)
    expected["CHANGELOG.md"] = changelog
    assert snapshot(c.project) == expected
    assert _exact(c.fork) == before_wd
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# 4. nothing written through a symbolic link


def test_series_entry_through_a_symlinked_folder(case):
    """patches/sub is a link to a folder outside: its patch is neither read nor rewritten nor deleted."""
    c = case
    names = patch_names(c)
    outside = c.sentinel / "elsewhere"
    outside.mkdir()
    shutil.move(c.project / "patches" / names[1], outside / names[1])
    (c.project / "patches" / "sub").symlink_to(outside)
    (c.project / "series").write_text((c.project / "series").read_text().replace(names[1], f"sub/{names[1]}"))
    planted = snapshot(c.sentinel)
    f = c.fork / P2_FILE  # changed work on patch 2: an export would rewrite its file
    f.write_text(f.read_text() + "# changed\n")
    git(c.fork, *DEV, "commit", "-qa", "--amend", "--no-edit")
    refused(c.export(), f"patches/sub/{names[1]}", "outside")
    refused(c.apply("--force"), f"patches/sub/{names[1]}", "outside")
    assert snapshot(c.sentinel) == planted
    (c.project / "patches" / "sub").unlink()  # the fix: a real folder
    shutil.move(outside, c.project / "patches" / "sub")
    ok(c.export())
    assert b"# changed" in (c.project / "patches" / "sub" / names[1]).read_bytes()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("when", ["before-the-rebase", "during-the-stop"])
def test_resolutions_folder_linked_outside(tmp_path, rb_conflict, when):
    """resolutions/<version> is a link to a folder outside: refused before anything is moved."""
    c = Case(tmp_path, rb_conflict)
    res = c.project / "resolutions" / T
    outside = c.sentinel / "res"

    def link():
        shutil.move(res, outside)
        res.symlink_to(outside)

    before_wd = _exact(c.fork)
    if when == "before-the-rebase":
        link()
        planted = snapshot(c.sentinel)
        refused(_rebase(c), f"resolutions/{T}", "outside")
        assert _exact(c.fork) == before_wd
    else:
        assert _rebase(c).returncode == 3
        link()
        planted = snapshot(c.sentinel)
        git(c.fork, "checkout", "--ours", "--", GATE)  # resolved by hand: keep the new upstream's gate
        heads = _heads(c.fork)
        refused(_rebase(c, "--continue"), f"resolutions/{T}", "outside")
        assert _heads(c.fork) == heads  # nothing moved
    assert snapshot(c.sentinel) == planted
    res.unlink()
    shutil.move(outside, res)
    if when == "during-the-stop":
        ok(_rebase(c, "--continue"))
        assert "[patch." in (res / "resolutions.toml").read_text()  # recorded in the real folder
    else:
        assert _rebase(c).returncode == 3
        ok(_rebase(c, "--abort"))
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("name", ["sglpatch.lock", "sglpatch-tmp", "sglpatch-rebase"])
def test_workdir_lock_scratch_and_state_links_are_refused(tmp_path, rb_golden, name):
    """DIR/.git/NAME is a link to something outside: the lock file is not truncated through it,
    no scratch file and no rebase state goes through it (the rebase would be killed mid-extraction)."""
    c = Case(tmp_path, rb_golden)
    victim = c.sentinel / "victim"
    if name == "sglpatch.lock":
        victim.write_text("precious\n")
    else:
        victim.mkdir()
        (victim / "precious").write_text("precious\n")
    link = c.fork / ".git" / name
    link.unlink(missing_ok=True)  # the lock file of the earlier apply
    link.symlink_to(victim)
    planted = snapshot(c.sentinel)
    before_wd = _exact(c.fork)
    refused(_rebase(c, env={"SGLPATCH_CRASH_AT": "materialize:extract"}), f"{link}", "symbolic link")
    assert snapshot(c.sentinel) == planted
    assert _exact(c.fork) == before_wd
    link.unlink()
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# 5. the tree cache binds each tree to its artifact


@pytest.mark.parametrize("how", ["dry-run", "watch"])
def test_poisoned_tree_cache_is_unpacked_again(tmp_path, rb_golden, how):
    """refs/sglpatch/trees/<sha256 of 0.5.10.post1> pointed at the 0.5.9 tree (a shared CI cache):
    the tree is unpacked again, with one line, and the answer is the honest one."""
    c = Case(tmp_path, rb_golden)
    cache = private_cache(c)
    env = {"SGLPATCH_CACHE": str(cache)}
    if how == "dry-run":
        cmd = rebase_args(c, "--dry-run", "--onto", T, "--source", "sdist")
    else:
        cmd = ("watch", "--project", str(c.project), "--releases", T)
    honest = c.run(*cmd, env=env)
    assert honest.returncode in (0, 2), honest.stdout + honest.stderr
    cg = cache / "trees.git"
    ref = f"refs/sglpatch/trees/{SDIST_0510_SHA256}"
    tree = git(cg, "rev-parse", f"{ref}^{{tree}}")
    git(cg, "fetch", "-q", str(c.fork), "refs/heads/upstream:refs/poison")  # the 0.5.9 tree, as a commit
    git(cg, "update-ref", ref, "refs/poison")
    again = c.run(*cmd, env=env)
    assert again.returncode == honest.returncode, again.stdout + again.stderr
    assert no_timing(again.stdout) == no_timing(honest.stdout)
    lines = [line for line in again.stderr.splitlines() if "tree cache" in line and "again" in line]
    assert len(lines) == 1 and f"sglang-{T}.tar.gz" in lines[0], again.stderr
    assert git(cg, "rev-parse", f"{ref}^{{tree}}") == tree
    c.outside_clean()


@pytest.mark.parametrize("where", ["loose", "pack"])
def test_damaged_object_in_the_tree_cache_is_healed(tmp_path, rb_golden, where):
    """A cached tree's object cut in half, loose or in its pack: the damaged object (or pack) and
    the trees holding it are dropped and unpacked again (one line), the answer is the same."""
    c = Case(tmp_path, rb_golden)
    cache = private_cache(c)
    env = {"SGLPATCH_CACHE": str(cache)}
    cmd = rebase_args(c, "--dry-run", "--onto", T, "--source", "sdist")
    honest = c.run(*cmd, env=env)
    assert honest.returncode in (0, 2), honest.stdout + honest.stderr
    cg = cache / "trees.git"
    packs = sorted((cg / "objects" / "pack").glob("pack-*.pack"))
    assert packs and git(cg, "count-objects").startswith("0 objects"), packs  # the unpack packed its objects
    blob = git(cg, "rev-parse", f"refs/sglpatch/trees/{SDIST_0510_SHA256}:{P2_FILE}")  # a file patch 2 changes
    if where == "loose":
        loosen(cg)
        target, needle = cg / "objects" / blob[:2] / blob[2:], blob
    else:
        idx = {p: subprocess.run(["git", "show-index"], input=p.with_suffix(".idx").read_bytes(), capture_output=True,
                                 check=True).stdout.decode() for p in packs}
        target = next(p for p in packs if f" {blob} " in idx[p])
        needle = target.stem
    data = target.read_bytes()
    target.chmod(0o644)
    target.write_bytes(data[: len(data) // 2])
    again = c.run(*cmd, env=env)
    assert again.returncode == honest.returncode, again.stdout + again.stderr
    assert no_timing(again.stdout) == no_timing(honest.stdout)
    assert "Traceback" not in again.stderr
    assert [line for line in again.stderr.splitlines() if "damaged" in line and needle in line], again.stderr
    assert git(cg, "cat-file", "-t", blob) == "blob" and len(git(cg, "cat-file", "-p", blob)) > 0
    assert subprocess.run(["git", "fsck", "--no-dangling"], cwd=cg, capture_output=True).returncode == 0
    c.outside_clean()


# --------------------------------------------------------------------------------------
# 6. exported files keep their mode


def test_exported_files_keep_their_mode(case):
    c = case
    names = patch_names(c)
    p = c.project / "patches"
    os.chmod(c.project / "series", 0o604)
    os.chmod(p / names[0], 0o664)
    os.chmod(p / names[1], 0o644)
    f = c.fork / P2_FILE
    f.write_text(f.read_text() + "# changed\n")
    git(c.fork, *DEV, "commit", "-qa", "--amend", "--no-edit")
    f.write_text(f.read_text() + "# a third patch\n")
    git(c.fork, *DEV, "commit", "-qam", f"third\n\n{DEP3}")
    old = os.umask(0o027)
    try:
        res = ok(c.export())
    finally:
        os.umask(old)
    new = [n for n in patch_names(c) if n not in names]
    assert f"wrote   patches/{names[1]}" in res.stdout and len(new) == 1
    modes = {n: (p / n).stat().st_mode & 0o777 for n in [*names, *new]}
    assert modes == {names[0]: 0o664, names[1]: 0o644, new[0]: 0o640}  # a new file: what the umask leaves of 0666
    assert (c.project / "series").stat().st_mode & 0o777 == 0o604
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# rough edges: recorded resolutions


BAD_TOML = {
    "patch-not-a-table": b'patch = "x"\n',
    "entry-not-a-table": b'[patch]\n"0001-x.patch" = 3\n',
    "not-utf8": b'[patch."0001-x.patch"]\nwhy = "caf\xe9"\n',
}


@pytest.mark.parametrize("kind", list(BAD_TOML))
def test_malformed_resolutions_toml(tmp_path, rb_golden, kind):
    """A real rebase refuses it with one line; the watch classifies the release anyway and says
    in one line that this folder's records are not used."""
    c = Case(tmp_path, rb_golden)
    f = c.project / "resolutions" / T / "resolutions.toml"
    f.write_bytes(BAD_TOML[kind])
    before_wd = _exact(c.fork)
    refused(_rebase(c), f"resolutions/{T}/resolutions.toml")
    assert _exact(c.fork) == before_wd
    for _ in ("classified", "taken from the tree cache"):  # the second run reuses the first's outcomes
        w = c.run("watch", "--project", str(c.project), "--releases", T)
        assert w.returncode == 0 and "Traceback" not in w.stderr, w.stdout + w.stderr
        assert [line for line in w.stderr.splitlines() if "resolutions.toml" in line and "not used" in line], w.stderr
        assert re.search(rf"^{re.escape(T)} ", w.stdout, re.M), w.stdout
    f.unlink()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "proc-self-mem", "symlinked-file", "symlinked-toml"])
def test_resolution_names_and_links_are_checked(tmp_path, rb_golden, kind):
    c = Case(tmp_path, rb_golden)
    d = c.project / "resolutions" / T
    leak = c.sentinel / "leak.patch"
    leak.write_bytes(b"a file outside the project\n")
    name = {"dotdot": "../../../sentinel/leak.patch", "absolute": str(leak), "proc-self-mem": "/proc/self/mem"}.get(kind, "0001-x.patch")
    toml = f'[patch."{name}"]\naction = "replace"\npatch_sha256 = "{"0" * 64}"\nwhy = "planted"\n'
    if kind == "symlinked-file":
        (d / name).symlink_to(leak)
    if kind == "symlinked-toml":
        (c.sentinel / "r.toml").write_text(toml)
        (d / "resolutions.toml").symlink_to(c.sentinel / "r.toml")
    else:
        (d / "resolutions.toml").write_text(toml)
    needle = {"dotdot": "must be a plain relative path without '..'", "absolute": "absolute paths are not allowed",
              "proc-self-mem": "absolute paths are not allowed"}.get(kind, "symbolic link")
    before_wd = _exact(c.fork)
    refused(_rebase(c), f"resolutions/{T}/", needle)
    assert _exact(c.fork) == before_wd
    for p in (d / "resolutions.toml", d / "0001-x.patch", leak, c.sentinel / "r.toml"):
        if p.is_symlink() or p.exists():
            p.unlink()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# rough edges: the package index and the artifacts it vouches for


BAD_INDEX = {
    "files-not-a-list": {"meta": {}, "files": 3},
    "entry-not-an-object": {"files": [3]},
    "filename-not-a-string": {"files": [{"filename": 3, "url": "/x", "hashes": {}}]},
    "not-an-object": [1, 2],
    "saved-answer-of-the-wrong-shape": None,
}


@pytest.mark.parametrize("kind", list(BAD_INDEX))
def test_index_answer_of_the_wrong_shape(case, index, kind):
    c = case
    cache = private_cache(c)
    if BAD_INDEX[kind] is None:  # the index does not answer; the answer saved last time is damaged
        (cache / "index").mkdir()
        (cache / "index" / "sglang.json").write_text(json.dumps({"files": "x"}))
        url = closed_port_url()
    else:
        url = index(BAD_INDEX[kind]).url
    w = c.run("watch", "--project", str(c.project), "--releases", T, env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": url})
    refused(w, "index")
    c.outside_clean()


def test_vouched_wheel_that_is_not_a_zip(case, index):
    """The index publishes the sha256 of a "wheel" that is not a zip file (and that is what the
    cache holds): one line naming the file."""
    c = case
    cache = private_cache(c)
    junk = b"this is not a zip file\n" * 100
    fn = "sglang-0.5.99-py3-none-any.whl"
    (cache / "wheel").mkdir()
    (cache / "wheel" / fn).write_bytes(junk)
    srv = index({"files": index_listing([{"filename": fn, "url": f"/files/{fn}", "hashes": {"sha256": hashlib.sha256(junk).hexdigest()}}])})
    w = c.run("watch", "--project", str(c.project), "--releases", "0.5.99", env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": srv.url})
    refused(w, fn, "zip")
    c.outside_clean()


def test_concurrent_watch_runs_do_not_share_the_index_temp_file(case, index):
    """Two watches save the index answer at once (one paused between writing its temporary file
    and renaming it): neither loses the fresh answer nor says the index does not answer."""
    c = case
    cache = private_cache(c)
    srv = index({"files": index_listing()})
    env = {"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": srv.url, "SGLPATCH_CRASH_AT": "index:read"}
    cmd = ("watch", "--project", str(c.project), "--releases", T)
    bar = Barrier(c)
    first = popen(c, *cmd, env=dict(env, **bar.env("index:written")))
    bar.reached(first)
    second = c.run(*cmd, env=env)
    bar.go()
    out, err = first.communicate(timeout=120)
    assert first.returncode == KILLED and second.returncode == KILLED, err + second.stderr  # both read the index
    for text in (err, second.stderr):  # not even a failed save: each saves through its own temporary file
        assert "does not answer" not in text and "cannot save" not in text and "Traceback" not in text, text
    assert [p.name for p in (cache / "index").iterdir()] == ["sglang.json"]
    assert len(json.loads((cache / "index" / "sglang.json").read_text())) == 2
    c.outside_clean()


def test_read_only_cache_keeps_the_fresh_index_answer(case, index):
    c = case
    ro = ReadOnly(c.tmp / "cache")
    try:
        cache = private_cache(c)
        subprocess.run(["git", "init", "-q", "--bare", str(cache / "trees.git")], check=True)
        (cache / "index").mkdir()
        (cache / "index" / "sglang.json").write_text(saved_answer(index_listing()[:1]))  # an old answer
        ro.ro()
        srv = index({"files": index_listing()})
        w = c.run("watch", "--project", str(c.project), "--releases", T,
                  env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": srv.url, "SGLPATCH_CRASH_AT": "index:read"})
        assert w.returncode == KILLED, w.stdout + w.stderr  # got as far as reading the index
        assert "does not answer" not in w.stderr, w.stderr
        assert "cannot save" in w.stderr and "Read-only file system" in w.stderr, w.stderr
    finally:
        ro.close()
    c.outside_clean()


def test_unreachable_index_says_nothing_was_verified_online(case):
    """The index does not answer: the answer saved last time (and the sdists it vouched for) are
    used, and stderr says plainly that nothing was verified online."""
    c = case
    cache = private_cache(c)
    (cache / "index").mkdir()
    (cache / "index" / "sglang.json").write_text(saved_answer(index_listing()))
    w = ok(c.run("watch", "--project", str(c.project), "--releases", T, env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": closed_port_url()}))
    lines = [line for line in w.stderr.splitlines() if "nothing was verified online" in line]
    assert len(lines) == 1 and "sglang.json" in lines[0], w.stderr
    c.outside_clean()


# --------------------------------------------------------------------------------------
# rough edges: damaged rebase state, read-only file systems


@pytest.mark.parametrize("kind", ["corrupt", "empty", "extra-key", "wrong-type", "no-format", "format-2"])
def test_damaged_rebase_state_says_how_to_get_out(tmp_path, rb_conflict, kind):
    """A state.json that is damaged, or of a format this sglpatch does not read (an older one
    without "format", a newer one), is refused with one line naming --abort, which still works."""
    c = Case(tmp_path, rb_conflict)
    before_wd, before = _exact(c.fork), snapshot(c.project)
    assert _rebase(c).returncode == 3
    f = c.fork / ".git" / "sglpatch-rebase" / "state.json"
    data = json.loads(f.read_text())
    if kind == "corrupt":
        f.write_text(f.read_text()[:40])
    elif kind == "empty":
        f.write_text("")
    elif kind == "extra-key":
        f.write_text(json.dumps(dict(data, bogus=1)))
    elif kind == "wrong-type":
        f.write_text(json.dumps(dict(data, names=3)))
    elif kind == "no-format":
        assert data.pop("format") == 1
        f.write_text(json.dumps(data))
    else:
        f.write_text(json.dumps(dict(data, format=2)))
    why = {"no-format": "no format number", "format-2": "format 2"}.get(kind, "damaged")
    for args in (("--continue",), ("--skip",), ("--onto", T, "--source", "sdist")):
        refused(_rebase(c, *args), "state.json", why, f"sglpatch rebase --workdir {c.fork} --abort")
    refused(c.export(), "--abort")
    ok(_rebase(c, "--abort"))
    assert _exact(c.fork) == before_wd
    assert snapshot(c.project) == before
    assert not (c.fork / ".git" / "sglpatch-rebase").exists()
    c.in_sync()
    c.outside_clean()


def test_read_only_home_without_a_cache_setting(fresh):
    """No SGLPATCH_CACHE, no XDG_CACHE_HOME, and HOME read-only: one line naming SGLPATCH_CACHE."""
    c = fresh
    ro = ReadOnly(c.home, "1m")
    try:
        ro.ro()
        env = {"SGLPATCH_CACHE": "", "XDG_CACHE_HOME": ""}
        refused(c.apply(env=env), "SGLPATCH_CACHE", str(c.home))
        refused(c.run("watch", "--project", str(c.project), "--releases", T, env=env), "SGLPATCH_CACHE")
    finally:
        ro.close()
    ok(c.apply())
    c.in_sync()
    c.outside_clean()


@pytest.mark.parametrize("when", ["start", "continue"])
def test_read_only_project_during_a_real_rebase(tmp_path, rb_golden, rb_after, when):
    """The project is on a read-only file system: the rebase says so before it moves a branch."""
    c = Case(tmp_path, rb_golden)
    ro = ReadOnly(c.project)
    try:
        args = ("--continue",) if when == "continue" else ()
        if when == "continue":
            assert _rebase(c, env={"SGLPATCH_CRASH_AT": "rebase:progress"}).returncode == KILLED
        heads = _heads(c.fork)
        ro.ro()
        refused(_rebase(c, *args), "read-only", str(c.project))
        assert _heads(c.fork) == heads
        if when == "start":
            assert not (c.fork / ".git" / "sglpatch-rebase").exists()
        ro.rw()
        ok(_rebase(c, *args))
        assert snapshot(c.project) == rb_after["project"]
        assert _heads(c.fork) == rb_after["heads"]
        c.in_sync()
    finally:
        ro.close()
    c.outside_clean()


# --------------------------------------------------------------------------------------
# rough edges: a half-built venv, a killed watch's leftovers, a BOM


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
    registry.pop("UV_DEFAULT_INDEX")  # the editable build needs setuptools from the registry (uv's cache)
    registry.pop("PIP_NO_INDEX")
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


def test_stale_temporary_folders_of_a_killed_run_are_removed(tmp_path, rb_golden):
    """A dry run killed while unpacking leaves its folders in TMPDIR; the next run removes them
    (their process is gone), never those of a run that is still going."""
    c = Case(tmp_path, rb_golden)
    cache = private_cache(c)
    env = {"SGLPATCH_CACHE": str(cache)}
    cmd = rebase_args(c, "--dry-run", "--onto", T, "--source", "sdist")
    assert c.run(*cmd, env=dict(env, SGLPATCH_CRASH_AT="treecache:unpack")).returncode == KILLED
    stale = {p.name for p in c.tmpdir.iterdir()}
    assert {n.split("-")[1] for n in stale} == {"watch", "tree"}, stale
    bar = Barrier(c)
    live = popen(c, *cmd, env=dict(env, **bar.env("treecache:unpack")))
    bar.reached(live)
    theirs = {p.name for p in c.tmpdir.iterdir()} - stale
    assert len(theirs) == 2
    third = c.run(*cmd, env=env)
    assert third.returncode in (0, 2), third.stdout + third.stderr
    assert {p.name for p in c.tmpdir.iterdir()} == theirs  # the killed run's are gone, the live run's are not
    bar.go()
    out, err = live.communicate(timeout=300)
    assert live.returncode == third.returncode, out + err
    c.outside_clean()


def test_series_with_a_byte_order_mark(case):
    series = case.project / "series"
    series.write_bytes(b"\xef\xbb\xbf" + series.read_bytes())
    refused_apply(case, "byte-order mark")
