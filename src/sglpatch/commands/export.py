"""`sglpatch export`: write the workdir's commits (upstream..patched) back to the patch files and
series of the line the tree holds (sglpatch.stack.export.export; a tree on another pin is refused there)."""

from __future__ import annotations

import sys

from sglpatch import cliargs, lines
from sglpatch.stack import export

NAME = "export"
HELP = "write upstream..patched back to patches/ and series (byte-stable) of the line the workdir holds"


def register(p) -> None:
    cliargs.add_workdir(p)
    cliargs.add_line(p)


def run(args) -> int:
    ctx = cliargs.ctx(args)
    wd = ctx.workdir
    line, _ = ctx.tree_line()  # export.export checks the tree's pin against that line's lock
    print(f"sglpatch: export: {ctx.named(line)}, workdir {wd}", file=sys.stderr, flush=True)
    try:
        res = export.export(line.root, wd)
    except OSError as e:
        raise cliargs.os_error(e) from None
    total = len(res.written) + len(res.unchanged)
    print(
        f"exported {total} patches: {len(res.written)} written, {len(res.unchanged)} unchanged, "
        f"{len(res.removed)} removed; series {'updated' if res.series_changed else 'unchanged'}"
    )
    where = "" if line.primary else f"{lines.LINES_DIR}/{line.release}/"
    for name in res.written:
        print(f"  wrote   {where}patches/{name}")
    for name in res.removed:
        print(f"  removed {where}patches/{name}")
    return 0
