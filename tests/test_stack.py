"""apply / export / status / check on the real 0.5.9 sdist with real git, quilt, git am and patch."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import copy_project, git, sglpatch_inproc
from sglpatch.stack import build, export, status
from sglpatch.errors import SglpatchError
from sglpatch.upstream.pin import read_lock, write_lock
from sglpatch.series import read_patch, read_series


def snapshot(root: Path, names=None) -> dict[str, bytes]:
    """{path: bytes} of every file under root, or only under its top-level names (the checkout holds the test
    venvs: reading them was 30 CPU-seconds)."""
    tops = [root / n for n in names] if names else [root]
    files = [p for top in tops for p in ([top] if top.is_file() else sorted(top.rglob("*")))]
    return {str(p.relative_to(root)): p.read_bytes() for p in files if p.is_file()}


def refs(wd: Path) -> str:
    return git(wd, "for-each-ref", "--format=%(refname) %(objectname)")


@pytest.fixture
def applied(project_copy, tmp_path):
    wd = tmp_path / "fork"
    build.apply(project_copy, wd, source="sdist")
    return project_copy, wd


def test_apply_one_commit_per_patch_in_order(applied):
    project, wd = applied
    series = read_series(project)
    subjects = git(wd, "log", "--reverse", "--format=%s", "upstream..patched").splitlines()
    assert subjects == [read_patch(project, e).subject for e in series.entries]
    assert git(wd, "rev-parse", "--abbrev-ref", "HEAD") == "patched"
    assert git(wd, "status", "--porcelain", "--untracked-files=no") == ""
    assert (wd / "python" / "sglang" / "srt" / "layers" / "communicator.py").is_file()


def test_apply_is_deterministic_across_workdirs(applied, tmp_path):
    project, wd = applied
    wd2 = tmp_path / "fork2"
    build.apply(project, wd2, source="sdist")
    assert git(wd, "rev-parse", "patched") == git(wd2, "rev-parse", "patched")


def test_second_apply_makes_no_commit_and_export_is_byte_noop(applied):
    project, wd = applied
    before_refs = refs(wd)
    res = build.apply(project, wd, source="sdist")
    assert not res.changed
    assert refs(wd) == before_refs
    before = snapshot(project)
    mtimes = {p: (project / p).stat().st_mtime_ns for p in before}
    out = export.export(project, wd)
    assert out.written == [] and out.removed == [] and not out.series_changed
    assert snapshot(project) == before
    assert {p: (project / p).stat().st_mtime_ns for p in before} == mtimes


def test_committed_series_export_is_noop(project_root, tmp_path):
    """The CI gate: apply + export of the committed series changes no byte."""
    project = copy_project(tmp_path / "p")
    build.apply(project, tmp_path / "fork", source="sdist")
    export.export(project, tmp_path / "fork")
    stack = ("series", "upstream.lock", "patches")
    committed = snapshot(project_root, stack)
    assert len(committed) > 2 and snapshot(project, stack) == committed


def _tree_of_dir(wd: Path, d: Path) -> str:
    env_index = d.parent / "tmp-index"
    env = dict(os.environ, GIT_INDEX_FILE=str(env_index), GIT_CONFIG_GLOBAL=os.devnull)
    subprocess.run(["git", "--work-tree", str(d), "add", "-A", "-f", "."], cwd=wd, env=env, check=True)
    out = subprocess.run(["git", "write-tree"], cwd=wd, env=env, check=True, capture_output=True, text=True).stdout.strip()
    env_index.unlink()
    return out


def _export_upstream(wd: Path, dest: Path) -> None:
    dest.mkdir()
    archive = subprocess.run(["git", "archive", "upstream"], cwd=wd, check=True, capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)


@pytest.mark.skipif(shutil.which("quilt") is None, reason="quilt not installed (.ci/run installs it)")
def test_real_quilt_push_gives_the_same_tree(applied, tmp_path):
    project, wd = applied
    tree = tmp_path / "quilt"
    _export_upstream(wd, tree)
    env = dict(os.environ, QUILT_PATCHES=str(project / "patches"), QUILT_SERIES=str(project / "series"), QUILT_PC=str(tmp_path / "pc"))
    proc = subprocess.run(["quilt", "push", "-a", "--fuzz=0"], cwd=tree, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fuzz" not in proc.stdout.lower() and "offset" not in proc.stdout.lower(), proc.stdout
    assert _tree_of_dir(wd, tree) == git(wd, "rev-parse", "patched^{tree}")


def test_real_git_am_gives_the_same_tree(applied, tmp_path):
    project, wd = applied
    clone = tmp_path / "am"
    git(tmp_path, "clone", "-q", "--branch", "upstream", str(wd), str(clone))
    files = [str(project / "patches" / e.name) for e in read_series(project).entries]
    git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "am", "-q", *files)
    assert git(clone, "rev-parse", "HEAD^{tree}") == git(wd, "rev-parse", "patched^{tree}")
    # same messages and authors as sglpatch's commits
    fmt = "--format=%an <%ae> %ad%n%B"
    assert git(clone, "log", fmt, "origin/upstream..HEAD") == git(wd, "log", fmt, "upstream..patched")


def test_patch_p1_accepts_every_patch_without_fuzz(applied, tmp_path):
    project, wd = applied
    tree = tmp_path / "plain"
    _export_upstream(wd, tree)
    for e in read_series(project).entries:
        data = (project / "patches" / e.name).read_bytes()
        proc = subprocess.run(["patch", "-p1", "-F0", "--no-backup-if-mismatch"], cwd=tree, input=data, capture_output=True)
        out = proc.stdout.decode()
        assert proc.returncode == 0, out
        assert "offset" not in out and "fuzz" not in out, out


def test_uncommitted_edit_survives_every_command(applied):
    project, wd = applied
    target = wd / "python" / "sglang" / "srt" / "server_args.py"
    edited = target.read_bytes() + b"\n# my local experiment\n"
    target.write_bytes(edited)
    with pytest.raises(SglpatchError) as e:
        build.apply(project, wd, source="sdist")
    assert "uncommitted" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SglpatchError):
        build.apply(project, wd, source="sdist", force=True)
    export.export(project, wd)
    status.status(project, wd)
    status.check(project, wd)
    assert target.read_bytes() == edited


def test_unexported_commit_refused_then_exported(applied):
    project, wd = applied
    target = wd / "python" / "sglang" / "srt" / "server_args.py"
    target.write_text(target.read_text() + "\n# tuned for PCIe\n")
    git(wd, "-c", "user.name=Dev", "-c", "user.email=dev@x", "commit", "-qam",
        "server_args: note\n\nDescription: a note\nOrigin: vendor\nForwarded: no\nLast-Update: 2026-11-30")
    head = git(wd, "rev-parse", "patched")
    with pytest.raises(SglpatchError) as e:
        build.apply(project, wd, source="sdist")
    assert "sglpatch export" in str(e.value)
    assert git(wd, "rev-parse", "patched") == head
    n = len(read_series(project).entries)
    res = export.export(project, wd)
    series = read_series(project)
    assert len(series.entries) == n + 1 and res.series_changed
    assert series.entries[-1].name == f"{n + 1:04d}-server_args-note.patch"
    again = build.apply(project, wd, source="sdist")
    assert not again.changed and git(wd, "rev-parse", "patched") == head


def test_force_rebuild_keeps_backup(applied):
    project, wd = applied
    git(wd, "-c", "user.name=Dev", "-c", "user.email=dev@x", "commit", "-q", "--allow-empty", "-m", "wip")
    head = git(wd, "rev-parse", "patched")
    build.apply(project, wd, source="sdist", force=True)
    assert git(wd, "rev-parse", "patched") != head
    assert head in git(wd, "for-each-ref", "--format=%(objectname)", "refs/sglpatch/backup/")


def test_series_change_rebuilds(applied):
    project, wd = applied
    series_path = project / "series"
    lines = series_path.read_text().splitlines()
    last = [i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")][-1]
    series_path.write_text("\n".join(lines[:last] + lines[last + 1 :]) + "\n")
    n = len(read_series(project).entries)
    res = build.apply(project, wd, source="sdist")
    assert res.changed
    assert len(git(wd, "rev-list", "upstream..patched").splitlines()) == n


def test_offset_is_an_error_naming_patch_file_and_hunk(project_copy, tmp_path):
    entry = read_series(project_copy).entries[0]
    path = project_copy / "patches" / entry.name
    text = path.read_text()
    first = text.index("\n@@ -") + 1
    header_end = text.index("\n", first)
    header = text[first:header_end]
    old_start = int(header.split()[1].split(",")[0][1:])
    shifted = header.replace(f"-{old_start}", f"-{old_start + 3}", 1)
    path.write_text(text[:first] + shifted + text[header_end:])
    with pytest.raises(SglpatchError) as e:
        build.apply(project_copy, tmp_path / "fork", source="sdist")
    msg = str(e.value)
    assert entry.name in msg and "hunk #1" in msg and "offset of -3 lines" in msg and "python/" in msg


def test_lock_blob_mismatch_is_named(project_copy, tmp_path):
    lock = read_lock(project_copy)
    path = sorted(lock.blobs)[0]
    lock.blobs[path] = "0" * 40
    write_lock(project_copy, lock)
    with pytest.raises(SglpatchError) as e:
        build.apply(project_copy, tmp_path / "fork", source="sdist")
    assert f"blobs.{path!r}" in str(e.value)


def test_sdist_sha256_mismatch_is_named(project_copy, tmp_path, monkeypatch, sdist_059):
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "sdist").mkdir(parents=True)
    shutil.copy(sdist_059, tmp_path / "cache" / "sdist" / sdist_059.name)
    lock = read_lock(project_copy)
    lock.sdist_sha256 = "ab" * 32
    write_lock(project_copy, lock)
    with pytest.raises(SglpatchError) as e:
        build.apply(project_copy, tmp_path / "fork", source="sdist")
    assert "sdist.sha256" in str(e.value)


def test_git_source_from_file_url_matches_sdist_tree(applied, tmp_path):
    project, wd = applied
    mirror = tmp_path / "mirror"
    git(tmp_path, "clone", "-q", "--branch", "upstream", str(wd), str(mirror))
    git(mirror, "tag", "v0.5.9")
    sha = git(mirror, "rev-parse", "HEAD")
    lock = read_lock(project)
    lock.url = f"file://{mirror}"
    lock.commit = sha
    write_lock(project, lock)
    wd2 = tmp_path / "fork-git"
    build.apply(project, wd2, source="git")
    assert git(wd2, "rev-parse", "upstream") == sha
    assert git(wd2, "rev-parse", "patched^{tree}") == git(wd, "rev-parse", "patched^{tree}")
    # a tag that moved away from the locked commit is refused
    lock.commit = "f" * 40
    write_lock(project, lock)
    with pytest.raises(SglpatchError) as e:
        build.apply(project, tmp_path / "fork-git2", source="git")
    assert "upstream.commit" in str(e.value)


def test_second_apply_while_one_runs_is_refused(applied):
    project, wd = applied
    fd = os.open(wd / ".git" / "sglpatch.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(SglpatchError) as e:
            build.apply(project, wd, source="sdist")
        assert "another sglpatch" in str(e.value)
    finally:
        os.close(fd)


def test_foreign_directories_are_refused(project_copy, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SglpatchError) as e:
        build.apply(project_copy, foreign, source="sdist")
    assert "not a git repository made by sglpatch" in str(e.value)
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "x").write_text("x")
    with pytest.raises(SglpatchError):
        build.apply(project_copy, repo, source="sdist")
    assert (foreign / "notes.txt").read_text() == "mine"


def test_detached_head_refused(applied):
    project, wd = applied
    git(wd, "checkout", "-q", "--detach", "patched~1")
    with pytest.raises(SglpatchError) as e:
        build.apply(project, wd, source="sdist")
    assert "detached" in str(e.value)


def test_cli_check_status_and_one_line_errors(applied, tmp_path):
    project, wd = applied
    proc = sglpatch_inproc("check", "--project", str(project))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = sglpatch_inproc("status", "--project", str(project), "--workdir", str(wd))
    assert proc.returncode == 0 and "in sync with the series" in proc.stdout
    (project / "patches" / "stray.patch").write_text("x")
    proc = sglpatch_inproc("check", "--project", str(project))
    assert proc.returncode == 1 and "stray.patch is not listed" in proc.stdout
    proc = sglpatch_inproc("apply", "--project", str(tmp_path), "--workdir", str(wd), "--no-install")
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("sglpatch: error:")
