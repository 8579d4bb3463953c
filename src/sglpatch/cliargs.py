"""What the series side's commands share on the command line: the --workdir/--project options,
reading them back, and an OSError as a one-line error. Each command's own arguments and run
function live next to its module (stack_cli, bisect_cli, rebase_cli, watch_cli); sglpatch.cli
only assembles them."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from sglpatch.project import find_project
from sglpatch.errors import SglpatchError

PROJECT_HELP = "project root holding series, patches/, upstream.lock (default: found from cwd)"


def add_workdir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="the fork's git workdir (default: $SGLANG_FORK_DIR or ~/sglang-fork)")
    p.add_argument("--project", help=PROJECT_HELP)


def workdir(args) -> Path:
    """--workdir, else the base workdir (sglpatch.linepath.base)."""
    from sglpatch import linepath

    return linepath.base(args.workdir)


def project(args) -> Path:
    return Path(args.project).resolve() if getattr(args, "project", None) else find_project()


def add_line(p: argparse.ArgumentParser) -> None:
    p.add_argument("--line", metavar="RELEASE", help="the line to work on: a release under lines/ (`sglpatch lines` lists them); "
                   "its workdir defaults to the primary's with -RELEASE appended (default: the primary series)")


def os_error(e: OSError) -> SglpatchError:
    """A full disk, a permission: one line, not a traceback."""
    hint = "free space and re-run" if e.errno == errno.ENOSPC else "fix that and re-run"
    return SglpatchError(f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "") + f"; {hint}")


def ctx(args):
    """The context main resolved (sglpatch.context); the project's own error when there is none."""
    if getattr(args, "ctx", None) is None:
        from sglpatch import context

        args.ctx = context.resolve(args)
        if args.ctx is None:
            find_project()  # raises the one line that says why
    return args.ctx
