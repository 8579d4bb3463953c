"""The series file and the names in it: malformed lines, unknown options, duplicates, missing or
non-UTF-8 files, traversal, a byte-order mark; the names export gives commits.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations



import pytest

from conftest import git
from failure_modes import world as fm
from failure_modes.world import patch_names, refused_apply


@pytest.mark.inproc
def test_series_malformed_line(case):
    with open(case.project / "series", "a") as f:
        f.write("0003-fix$(touch ${HOME}/x).patch\n")
    refused_apply(case, "series:", "characters outside")


@pytest.mark.inproc
def test_series_unknown_option(case):
    first = patch_names(case)[0]
    (case.project / "series").write_text((case.project / "series").read_text().replace(first, first + " -R"))
    refused_apply(case, "unknown option '-R'", first)


@pytest.mark.inproc
def test_series_duplicate_entry(case):
    with open(case.project / "series", "a") as f:
        f.write(patch_names(case)[0] + "\n")
    refused_apply(case, "listed twice")


@pytest.mark.inproc
def test_series_missing_patch_file(case):
    with open(case.project / "series", "a") as f:
        f.write("0003-not-there.patch\n")
    refused_apply(case, "0003-not-there.patch does not exist")


@pytest.mark.inproc
def test_series_not_utf8(case):
    with open(case.project / "series", "ab") as f:
        f.write(b"# caf\xe9\n")
    refused_apply(case, "not UTF-8")


@pytest.mark.inproc
def test_series_name_traversal(case):
    with open(case.project / "series", "a") as f:
        f.write("../../sentinel/evil.patch\n")
    refused_apply(case, "'..'")


@pytest.mark.inproc
def test_series_with_a_byte_order_mark(case):
    series = case.project / "series"
    series.write_bytes(b"\xef\xbb\xbf" + series.read_bytes())
    refused_apply(case, "byte-order mark")


@pytest.mark.inproc
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


@pytest.mark.inproc
def test_a_unicode_subject_is_decoded_not_made_a_patch_name(case):
    from sglpatch.series import Entry, read_patch

    (case.fork / "README.md").write_text("x\n")
    git(case.fork, "add", "README.md")
    git(case.fork, "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "-m", "Füge Ünïcode hinzu: 日本語 ✓")
    out = fm.ok(case.export()).stdout
    assert "wrote   patches/0003-Fuge-Unicode-hinzu.patch" in out, out  # was 0003-UTF-8-q-F-C3-BCge-20-C3-9Cn-...
    assert read_patch(case.project, Entry("0003-Fuge-Unicode-hinzu.patch", 1)).subject == "Füge Ünïcode hinzu: 日本語 ✓"
    assert "0003-Fuge-Unicode-hinzu.patch" in (case.project / "series").read_text().splitlines()
