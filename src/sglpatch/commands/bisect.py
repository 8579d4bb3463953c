"""`sglpatch bisect`: its arguments and run function; the bisect package (psutil, git bisect run)
is imported only when the command runs."""

from __future__ import annotations

import argparse
import sys

from sglpatch import cliargs, exitcodes
from sglpatch.errors import SglpatchError
from sglpatch.workdir import PATCHED_BRANCH, UPSTREAM_BRANCH

NAME = "bisect"
HELP = "find the first bad patch with git bisect run (CMD: 0 good, 1 bad, 125 skip; 2, a usage error, stops: no verdict)"
DESCRIPTION = (
    "Run CMD at each step of `git bisect run` over GOOD..BAD in the workdir (the editable "
    "install makes the imported sglang that step's tree) and name the first bad patch by its series "
    "name, subject and DEP-3 Description. CMD runs in the current directory with "
    "SGLPATCH_BISECT_COMMIT set. The workdir always ends back on branch patched, clean."
)


def register(p: argparse.ArgumentParser) -> None:
    cliargs.add_workdir(p)
    cliargs.add_line(p)
    p.add_argument("--good", default=UPSTREAM_BRANCH, help=f"a commit where CMD passes (default: {UPSTREAM_BRANCH})")
    p.add_argument("--bad", default=PATCHED_BRANCH, help=f"a commit where CMD fails (default: {PATCHED_BRANCH})")
    cliargs.add_timeout(p, "--timeout", "per-run limit; CMD's process group is killed past it")
    p.add_argument(
        "--on-timeout", choices=["bad", "skip"], default="bad", help="what a run past --timeout counts as (default: bad, a hang is a regression)"
    )
    p.add_argument(
        "--triage", action="store_true", help="first run CMD on GOOD and BAD: regression upstream, in the series, or none"
    )
    cliargs.add_report_dir(p, "<workdir>/.git/sglpatch-bisect/<UTC time>: step logs and the report", old="--log-dir")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the test command")


def run(args) -> int:
    from sglpatch.bisect import driver, report

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise SglpatchError("no command given; usage: sglpatch bisect [options] -- CMD [ARGS...]", exitcodes.USAGE)
    ctx = getattr(args, "ctx", None)  # the line's series names the patches; its workdir is the line's own
    project = ctx.project if ctx and (args.project or args.line) else None
    workdir = ctx.workdir if ctx else cliargs.workdir(args)
    if ctx:
        print(f"sglpatch: bisect: {ctx.named()}, workdir {workdir}", file=sys.stderr, flush=True)
    result = driver.run(
        workdir, cmd, good=args.good, bad=args.bad, timeout=args.timeout, triage=args.triage,
        on_timeout=args.on_timeout, project_root=project, log_dir=args.report_dir,
    )
    sys.stderr.flush()
    print("\n".join(report.format_report(result)), flush=True)
    return result.exit_code
