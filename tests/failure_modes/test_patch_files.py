"""The patch files: empty, fuzz, offsets, paths out of the tree or into .git, symbolic links, CRLF,
binary, non-UTF-8 headers, a FIFO in patches/; the modes export keeps.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess


import pytest

from conftest import git
from sglpatch.upstream.pin import read_lock, write_lock
from failure_modes import world as fm
from failure_modes.world import CRLF_FILE, Case, DEP3, DEV, P2_FILE, _new_file_diff, mkpatch, ok, patch_names, refused, refused_apply, snapshot


@pytest.mark.inproc
def test_empty_patch(case):
    case.append_patch("0003-empty.patch", b"")
    refused_apply(case, "0003-empty.patch is empty")


@pytest.mark.inproc
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


@pytest.mark.inproc
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


@pytest.mark.inproc
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


@pytest.mark.inproc
def test_patch_that_does_not_apply(case):
    name = _edit_patch(case, 0, "-            # Fallback for development without build", "-            # Fallback for dev without any build")
    refused_apply(case, name, "hunk #1", "does not apply")


@pytest.mark.inproc
def test_patch_for_missing_file(case):
    diff = (
        "diff --git a/python/sglang/srt/no_such_file.py b/python/sglang/srt/no_such_file.py\n"
        "--- a/python/sglang/srt/no_such_file.py\n+++ b/python/sglang/srt/no_such_file.py\n@@ -1 +1 @@\n-a\n+b\n"
    )
    case.append_patch("0003-missing.patch", mkpatch("missing", diff))
    refused_apply(case, "no_such_file.py does not exist", "-p level")


@pytest.mark.inproc
def test_wrong_strip_level(case):
    name = patch_names(case)[0]
    (case.project / "series").write_text((case.project / "series").read_text().replace(name, name + " -p0"))
    refused_apply(case, name, "a/python/sglang/version.py does not exist", "-p level")


@pytest.mark.inproc
def test_patch_with_dotdot_path(case):
    case.append_patch("0003-up.patch", mkpatch("escape", _new_file_diff("../sentinel/pwned.py")))
    refused_apply(case, "0003-up.patch", "'..'")


@pytest.mark.inproc
def test_patch_with_absolute_path(case):
    target = f"{case.sentinel}/pwned.py"
    diff = f"--- /dev/null\n+++ {target}\n@@ -0,0 +1 @@\n+x = 1\n"
    case.append_patch("0003-abs.patch", mkpatch("absolute", diff), "0003-abs.patch -p0")
    refused_apply(case, "0003-abs.patch", "absolute")


@pytest.mark.inproc
def test_patch_with_octal_quoted_dotdot(case):
    case.append_patch("0003-quoted.patch", mkpatch("quoted", _new_file_diff("", quoted="\\056\\056/sentinel/pwned.py")))
    refused_apply(case, "0003-quoted.patch", "'..'")


@pytest.mark.inproc
def test_patch_rename_out_of_tree(case):
    diff = (
        "diff --git a/python/sglang/version.py b/python/sglang/version.py\nsimilarity index 100%\n"
        "rename from python/sglang/version.py\nrename to ../sentinel/version.py\n"
    )
    case.append_patch("0003-rename.patch", mkpatch("rename out", diff))
    refused_apply(case, "0003-rename.patch", "'..'")


@pytest.mark.inproc
def test_patch_into_dot_git(case):
    case.append_patch("0003-hook.patch", mkpatch("hook", _new_file_diff(".git/hooks/post-checkout", "touch /tmp/pwned\n")))
    refused_apply(case, "0003-hook.patch", ".git")


def _symlink_diff(path: str, target: str) -> str:
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 120000\nindex 0000000..2222222\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1 @@\n+{target}\n\\ No newline at end of file\n"
    )


@pytest.mark.inproc
def test_patch_writing_through_symlink_made_by_earlier_patch(case):
    case.append_patch("0003-link.patch", mkpatch("link", _symlink_diff("python/escape", str(case.sentinel))))
    case.append_patch("0004-through.patch", mkpatch("through", _new_file_diff("python/escape/pwned.py")))
    refused_apply(case, "0004-through.patch", "beyond a symbolic link")
    assert not (case.fork / "python" / "escape").exists()


@pytest.mark.inproc
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


@pytest.mark.inproc
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


@pytest.mark.inproc
def test_crlf_converted_patch(case):
    name = patch_names(case)[0]
    path = case.project / "patches" / name
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    refused_apply(case, name, "CRLF", "dos2unix")


@pytest.mark.inproc
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


@pytest.mark.inproc
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


@pytest.mark.inproc
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


@pytest.mark.inproc
def test_non_utf8_header(case):
    case.append_patch("0003-latin1.patch", mkpatch("caf\xe9", _new_file_diff("python/latin.py")).replace("caf\xe9".encode(), b"caf\xe9"))
    refused_apply(case, "0003-latin1.patch", "not UTF-8", "sglpatch export")


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


@pytest.mark.inproc
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
