"""sglpatch.gitcmd.patchpaths: the files a patch writes and reads, as git apply reads them, asked
per patch or for a whole series at once (read_together, what Project.load does), with real git
and patches git itself wrote: creations, deletions, renames, copies, quoted names, -p0 and -p2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import git
from sglpatch.gitcmd import GitError, patchpaths
from sglpatch.project import Project


def diff(repo: Path, *flags: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "diff", "--cached", "--binary", *flags], capture_output=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def patches(tmp_path_factory) -> dict[str, tuple[bytes, int]]:
    """Patches git wrote, each with its -pN: name -> (text, strip)."""
    repo = tmp_path_factory.mktemp("repo")
    git(repo, "init", "-q")
    (repo / "keep.py").write_text("".join(f"line {i}\n" for i in range(40)))
    (repo / "gone.py").write_text("bye\n")
    (repo / "old name.py").write_text("".join(f"moved {i}\n" for i in range(40)))
    (repo / "src.py").write_text("".join(f"copied {i}\n" for i in range(40)))
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    (repo / "keep.py").write_text("".join(f"line {i}\n" for i in range(41)))
    (repo / "new\u00e9.py").write_text("hello\n")  # a name git quotes ("new\303\251.py")
    (repo / "gone.py").unlink()
    (repo / "old name.py").rename(repo / "new name.py")
    (repo / "copy.py").write_text((repo / "src.py").read_text() + "more\n")
    (repo / "src.py").write_text((repo / "src.py").read_text() + "changed\n")
    git(repo, "add", "-A")
    out = {"all": (diff(repo, "-M", "-C", "-C"), 1), "p0": (diff(repo, "--no-prefix", "-M"), 0),
           "p2": (diff(repo, "--src-prefix=x/a/", "--dst-prefix=x/b/", "--no-renames"), 2)}
    for one in ("keep.py", "gone.py", "new\u00e9.py"):
        out[one] = (diff(repo, "--", one), 1)
    return out


def alone(data: bytes, strip: int) -> tuple[list[str], list[str]]:
    patchpaths._KNOWN.clear()
    return patchpaths.patch_paths(data, strip)


def test_paths_of_one_patch_as_git_apply_reads_them(patches):
    written, read = alone(*patches["all"])
    # git's order (by path); a creation reads its new path, a deletion writes its old one
    assert written == ["copy.py", "gone.py", "keep.py", "new name.py", "new\u00e9.py", "src.py"]
    assert read == ["src.py", "gone.py", "keep.py", "old name.py", "new\u00e9.py", "src.py"]
    # -p0 with the rename; -p2 without renames: old name.py deleted, new name.py created
    assert alone(*patches["p0"]) == (["copy.py", "gone.py", "keep.py", "new name.py", "new\u00e9.py", "src.py"],
                                     ["copy.py", "gone.py", "keep.py", "old name.py", "new\u00e9.py", "src.py"])
    both = ["copy.py", "gone.py", "keep.py", "new name.py", "new\u00e9.py", "old name.py", "src.py"]
    assert alone(*patches["p2"]) == (both, both)


def test_a_series_at_once_answers_as_each_alone_with_two_git_runs_per_strip(patches, request):
    want = {name: alone(*p) for name, p in patches.items()}
    patchpaths._KNOWN.clear()
    runs = request.getfixturevalue("git_runs")  # counted from here on
    patchpaths.read_together(list(patches.values()))
    # strip 1: all, keep.py, gone.py, newé.py (four patches, two runs); p0 and p2 are alone in theirs
    assert [(a[3], a[4] == "-R") for a in runs] == [("-p1", False), ("-p1", True)]
    assert {name: patchpaths.patch_paths(*p) for name, p in patches.items()} == want
    assert len(runs) == 2 + 2 * 2  # the two single ones asked alone, the four from memory


def test_a_patch_git_refuses_keeps_nothing_and_is_named_alone(patches, tmp_path, monkeypatch):
    bad = b"diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n-a\n"
    patchpaths._KNOWN.clear()
    patchpaths.read_together([patches["keep.py"], (bad, 1), patches["gone.py"]])
    assert patchpaths._KNOWN == {}
    with pytest.raises(GitError, match="corrupt patch at line 6"):
        patchpaths.patch_paths(bad, 1)
    assert patchpaths.patch_paths(*patches["gone.py"]) == (["gone.py"], ["gone.py"])


def test_a_project_reads_its_series_with_two_git_runs(project_root, git_runs):
    patchpaths._KNOWN.clear()
    project = Project.load(project_root)
    assert len(project.patches) >= 2 and [a[0] for a in git_runs] == ["apply", "apply"]
    patchpaths._KNOWN.clear()
    from sglpatch.series import read_patch

    assert [read_patch(project_root, e).files for e in project.series.entries] == [p.files for p in project.patches]
