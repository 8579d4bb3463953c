"""The record of the compiled extensions written beside a line's tree (sglpatch.extrecord), on a real
git workdir: one entry per CPython, removal only of what sglpatch wrote (verified by hash), a
damaged or planted record one line naming it with nothing deleted (issue 52, items 1 and 2)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import git
from sglpatch import extrecord
from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import Git

PIN_A, PIN_B = "a" * 64, "b" * 64
SO = "python/sglang/srt/x.cpython-{v}-x86_64-linux-gnu.so"


@pytest.fixture
def wd(tmp_path):
    d = tmp_path / "fork"
    (d / "python" / "sglang").mkdir(parents=True)
    (d / "python" / "sglang" / "__init__.py").write_text("")
    (d / ".gitignore").write_text("*.so\n")
    git(d, "init", "-q")
    git(d, "add", "-A")
    git(d, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tree")
    return d


def exts(v: str, n: int = 2) -> dict[str, bytes]:
    return {SO.format(v=v).replace("x.", f"m{k}."): f"so {v} {k}".encode() for k in range(n)}


def test_each_python_keeps_its_entry_and_a_move_removes_them_all(wd, capsys):
    """3.12, then 3.13 (the probe: only 3.13's were listed, 3.12's stayed beside the 0.5.9 tree)."""
    extrecord.add(wd, PIN_A, "cp312", exts("312"))
    extrecord.add(wd, PIN_A, "cp313", exts("313", 3))
    assert sorted(extrecord.read(wd)) == ["cp312", "cp313"]
    assert len(list(wd.rglob("*.so"))) == 5
    extrecord.drop_other_pins(Git(wd), PIN_A)  # the same pin: nothing goes
    assert len(list(wd.rglob("*.so"))) == 5
    extrecord.drop_other_pins(Git(wd), PIN_B)
    assert not list(wd.rglob("*.so")) and not (wd / ".git" / extrecord.NAME).exists()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"sglpatch: removed 2 compiled extension(s) for Python 3.12 that an install of another release left beside {wd}'s tree",
                   f"sglpatch: removed 3 compiled extension(s) for Python 3.13 that an install of another release left beside {wd}'s tree"]


def test_only_what_sglpatch_wrote_goes(wd, capsys):
    files = exts("312", 4)
    extrecord.add(wd, PIN_A, "cp312", files)
    changed, tracked, linked = (wd / r for r in list(files)[:3])
    changed.write_bytes(b"the user's own build")
    git(wd, "add", "-f", str(tracked))
    outside = wd.parent / "outside.so"
    outside.write_bytes(files[str(linked.relative_to(wd))])
    linked.unlink()
    linked.symlink_to(outside)
    extrecord.drop_other_pins(Git(wd), PIN_B)
    assert changed.read_bytes() == b"the user's own build" and tracked.exists() and linked.is_symlink() and outside.exists()
    assert not (wd / list(files)[3]).exists()
    line = capsys.readouterr().err.strip()
    assert line.startswith("sglpatch: removed 1 compiled extension(s) for Python 3.12") and "; kept 3: " in line, line
    assert "(changed since sglpatch wrote it)" in line and "(tracked by git)" in line and "(a symbolic link)" in line


@pytest.mark.parametrize("planted", [
    {"cp312": {"pin": PIN_A, "files": {"notes.txt": "0" * 64}}},
    {"cp312": {"pin": PIN_A, "files": {".git/refs/heads/mywork": "0" * 64}}},
    {"cp312": {"pin": PIN_A, "files": {"python/sglang/../../x.cpython-312.so": "0" * 64}}},
    {"cp312": {"pin": PIN_A, "files": {SO.format(v="312"): "not a hash"}}},
    {"cp312": {"pin": "short", "files": {}}},
    {"../x": {"pin": PIN_A, "files": {}}},
], ids=["untracked-file", "a-branch", "dotdot", "no-hash", "no-pin", "bad-key"])
def test_a_damaged_or_planted_record_is_one_line_and_deletes_nothing(wd, planted):
    (wd / "notes.txt").write_text("mine")
    git(wd, "branch", "mywork")
    rec = wd / ".git" / extrecord.NAME
    rec.write_text(json.dumps({"schema": extrecord.SCHEMA, **planted}))
    before = sorted(p for p in wd.rglob("*"))
    with pytest.raises(SglpatchError) as e:
        extrecord.drop_other_pins(Git(wd), PIN_B)
    msg = str(e.value)
    assert msg.startswith(f"{rec} is not a record sglpatch wrote (") and "nothing was deleted" in msg and "\n" not in msg
    assert sorted(p for p in wd.rglob("*")) == before and (wd / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("text", ["not json {", "{}", "[1]", '{"schema": "sglpatch.extensions/2", "cp312": []}', "x" * 10])
def test_garbage_records_are_refused(wd, text):
    (wd / ".git" / extrecord.NAME).write_text(text)
    with pytest.raises(SglpatchError, match="is not a record sglpatch wrote"):
        extrecord.read(wd)


def test_a_record_of_the_first_format_is_read_and_its_files_kept(wd, capsys):
    rel = SO.format(v="312")
    (wd / rel).parent.mkdir(parents=True)
    (wd / rel).write_bytes(b"so")
    (wd / ".git" / extrecord.NAME).write_text(f"{PIN_A} cp312\n{rel}\n")
    extrecord.drop_other_pins(Git(wd), PIN_B)
    assert (wd / rel).exists() and not (wd / ".git" / extrecord.NAME).exists()
    err = capsys.readouterr().err
    assert "removed 0 compiled extension(s) for Python 3.12" in err and f"kept 1: {rel} (recorded without a hash" in err, err


def test_a_fifo_or_link_at_the_record_is_refused(wd, tmp_path):
    rec = wd / ".git" / extrecord.NAME
    os.mkfifo(rec)
    with pytest.raises(SglpatchError, match="not a regular file"):
        extrecord.read(wd)
    rec.unlink()
    rec.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SglpatchError, match="is a symbolic link"):
        extrecord.read(wd)
