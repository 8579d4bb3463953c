"""`sglpatch watch`: its arguments and run function (sglpatch.watch, the
matrix, is imported only when the command runs)."""

from __future__ import annotations

import argparse
import sys

from sglpatch import cliargs, exitcodes
from sglpatch.errors import SglpatchError

NAME = "watch"
HELP = "upstream watch over every release after the pin: per-patch status matrix and dependency pins"
DESCRIPTION = (
    "One row per release after the pin, one column per patch, and each release's dependency pins. "
    "Exit 0 when the newest release needs nothing or only unattended work, 3 when it needs a human. "
    "--line R: the line R's series (lines/R/) against the releases after R's pin."
)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--project", help=cliargs.PROJECT_HELP)
    cliargs.add_line(p)
    p.add_argument("--releases", metavar="A..B|A,B", help="only these releases: a range (inclusive; either side may be empty) or a comma-separated list")
    cliargs.add_json(p, "the matrix")
    p.add_argument("--markdown", metavar="FILE", help="also write a markdown report")
    p.add_argument("--jobs", type=int, metavar="N", help="classify releases in N processes (default: the CPUs, at most 4)")
    p.add_argument("--recheck", action="store_true", help="classify every release again, also those a run with the same "
                   "series, resolutions and sglpatch already classified (kept in the tree cache)")
    p.add_argument("--command-line", help=argparse.SUPPRESS)


def run(args) -> int:
    from sglpatch.watch import report

    if args.jobs is not None and args.jobs < 1:
        raise SglpatchError("--jobs must be 1 or more", exitcodes.USAGE)
    ctx = cliargs.ctx(args)  # --line R: R's series against the releases after R's pin
    print(f"sglpatch: watch: {ctx.named()} ({ctx.line.where})", file=sys.stderr, flush=True)
    return report.main(ctx.project, releases=args.releases, json_out=args.json, md_out=args.markdown,
                      command=args.command_line, jobs=args.jobs, recheck=args.recheck)
