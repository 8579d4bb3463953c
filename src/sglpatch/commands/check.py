"""`sglpatch check`: the series, patches/ and the lock agree, and every patch applies exactly to the
pinned tree (the CI gate)."""

from __future__ import annotations

import sys

from sglpatch import cliargs
from sglpatch.stack import status

NAME = "check"
HELP = "series vs patches/ vs lock; every patch applies exactly (CI gate)"


def register(p) -> None:
    cliargs.add_workdir(p)
    cliargs.add_line(p)
    cliargs.add_source(p, "registry", "a CI gate needs no network")


def run(args) -> int:
    ctx = cliargs.ctx(args)
    workdir = ctx.workdir if args.workdir else None
    print(f"sglpatch: check: {ctx.named()} ({ctx.line.where})", file=sys.stderr, flush=True)
    problems = status.check(ctx.project, workdir, source=ctx.source(args.source))
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        print(f"check: {len(problems)} problem(s)")
        return 1
    print("check: series, patches/, upstream.lock consistent; every patch applies exactly to the pinned tree")
    return 0
