"""The transcript format of the documents' command blocks (tests/docblocks.py), on small documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from docblocks import commands, unmatched

DOC = """# t

```console
$ echo one \\
  two
one two
[exit 0]
$ false
[exit 1 here: it always fails]
```

```sh
$ not run
```

```console
$ printf 'a\\nb /home/u/x\\nc\\n'
a
c
b ~/x
```
"""


def test_console_blocks_parse_into_commands(tmp_path):
    (tmp_path / "d.md").write_text(DOC)
    got = [(c.line, c.cmd, c.expect, c.exit) for c in commands(tmp_path, "d.md")]
    assert got == [(4, "echo one \\\n  two", ["one two"], 0), (8, "false", [], 1),
                   (17, "printf 'a\\nb /home/u/x\\nc\\n'", ["a", "c", "b ~/x"], 0)]


def test_key_lines_match_in_order_with_wildcards_and_home():
    out = "a\nb /home/u/x\nc\n"
    home = Path("/home/u")
    assert unmatched(["a", "c"], out, home) is None
    assert unmatched(["b ~/x"], out, home) is None and unmatched(["b [..]"], out, home) is None
    assert unmatched(["c", "a"], out, home) == "a"  # in order
    assert unmatched(["b"], out, home) == "b"  # whole lines
    assert unmatched(["[..]x"], out, home) is None


def test_a_block_not_starting_with_a_command_is_an_error(tmp_path):
    (tmp_path / "d.md").write_text("```console\noutput first\n```\n")
    with pytest.raises(ValueError, match="d.md:2: a console block starts with"):
        commands(tmp_path, "d.md")
