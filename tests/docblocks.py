"""The command blocks of the README and the runbook, as tests (issue 51).

The Markdown is parsed by markdown-it-py (CommonMark; the parser of MyST, rich and
pytest-markdown-docs), never by hand: each fenced block whose info string starts with `console`
is a transcript in the shape of trycmd's:

    ```console
    $ scripts/apply.sh --python ~/ml-env/bin/python3
    ~/ml-env/bin/python3 imports sglang 0.5.9 from ~/sglang-fork/python/sglang/__init__.py
    [exit 0]
    ```

* `$ ` starts a command (a line ending in `\\` goes on); it runs in bash as the user runs it.
* The lines after it are key lines of its output (stdout and stderr together): each must match a
  whole line of the output, in this order, not necessarily next to each other. `[..]` matches any
  text within a line; `~/` is the user's home.
* `[exit N]` (optionally followed by words, e.g. `[exit 125 here: no GPU; 0 on the box]`) is the
  exit code the command must give; without it, 0.

Blocks of other kinds (`sh`, plain) are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from markdown_it import MarkdownIt

EXIT = re.compile(r"^\[exit (\d+)(?:[ :;,].*)?\]$")


@dataclass
class Command:
    doc: str
    line: int  # 1-based line of the `$` in the document
    cmd: str
    expect: list[str] = field(default_factory=list)
    exit: int = 0

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def commands(root: Path, doc: str) -> list[Command]:
    """Every command of every console block of root/doc, in order."""
    out: list[Command] = []
    for tok in MarkdownIt("commonmark").parse((root / doc).read_text()):
        if tok.type != "fence" or tok.info.split()[:1] != ["console"]:
            continue
        first = tok.map[0] + 2  # the fence line, then the content
        cur: Command | None = None
        cont = False
        for i, text in enumerate(tok.content.splitlines()):
            if cont and cur is not None:
                cur.cmd += "\n" + text
                cont = text.endswith("\\")
            elif text.startswith("$ "):
                cur = Command(doc, first + i, text[2:])
                out.append(cur)
                cont = text.endswith("\\")
            elif cur is None:
                raise ValueError(f"{doc}:{first + i}: a console block starts with `$ COMMAND`, not {text!r}")
            elif m := EXIT.match(text.strip()):
                cur.exit = int(m.group(1))
            elif text.strip():
                cur.expect.append(text.rstrip())
    return out


def pattern(line: str, home: Path) -> re.Pattern:
    text = line.replace("~/", f"{home}/")
    return re.compile("".join(".*?" if part == "[..]" else re.escape(part) for part in re.split(r"(\[\.\.\])", text)))


def unmatched(expect: list[str], output: str, home: Path) -> str | None:
    """The first expected line that does not match (in order), else None."""
    lines = [ln.rstrip() for ln in output.splitlines()]
    pos = 0
    for want in expect:
        pat = pattern(want, home)
        while pos < len(lines) and not pat.fullmatch(lines[pos]):
            pos += 1
        if pos == len(lines):
            return want
        pos += 1
    return None
