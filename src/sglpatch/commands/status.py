"""`sglpatch status`: the workdir's pin, its patches, its dirty state and the line it holds."""

from __future__ import annotations

from sglpatch import cliargs, lines
from sglpatch.stack import status

NAME = "status"
HELP = "pin, applied patches, dirty state, and which line the workdir holds"


def register(p) -> None:
    cliargs.add_workdir(p)
    cliargs.add_line(p)


def run(args) -> int:
    ctx = cliargs.ctx(args)
    line, held = ctx.tree_line()
    print("\n".join(status.status(line.root, ctx.workdir)))
    print(lines.status_line(held))
    return 0
