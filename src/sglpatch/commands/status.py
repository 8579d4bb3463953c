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
    line, wd = ctx.line, ctx.workdir
    held = ctx.held()
    print("\n".join(status.status((held if held and not args.line else line).root, wd)))  # without --line: the one it holds
    print(lines.status_line(held))
    return 0
