"""What the series side's commands share on the command line: the --workdir/--project options,
reading them back, and an OSError as a one-line error. Each command's own arguments and run
function live next to its module (stack_cli, bisect_cli, rebase_cli, watch_cli); sglpatch.cli
only assembles them."""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path

from sglpatch.project import find_project
from sglpatch.errors import SglpatchError

PROJECT_HELP = "project root holding series, patches/, upstream.lock (default: found from cwd)"


def add_workdir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="the fork's git workdir (default: $SGLANG_FORK_DIR or ~/sglang-fork)")
    p.add_argument("--project", help=PROJECT_HELP)


def workdir(args) -> Path:
    return Path(args.workdir or os.environ.get("SGLANG_FORK_DIR") or Path.home() / "sglang-fork").expanduser().absolute()


def project(args) -> Path:
    return Path(args.project).resolve() if getattr(args, "project", None) else find_project()


def add_line(p: argparse.ArgumentParser) -> None:
    p.add_argument("--line", metavar="RELEASE", help="the line to work on: a release under lines/ (`sglpatch lines` lists them); "
                   "its workdir defaults to the primary's with -RELEASE appended (default: the primary series)")


def line(args):
    """The line --line names (sglpatch.lines.Line), the primary without it."""
    from sglpatch import lines

    root = project(args)
    release = getattr(args, "line", None)
    return lines.find(lines.checkout_of(root), release) if release else lines.at(root)


def line_workdir(args, ln) -> Path:
    """--workdir as given, else the line's default (sglpatch.lines.default_workdir)."""
    from sglpatch import lines

    return workdir(args) if args.workdir else lines.default_workdir(workdir(args), ln)


def os_error(e: OSError) -> SglpatchError:
    """A full disk, a permission: one line, not a traceback."""
    hint = "free space and re-run" if e.errno == errno.ENOSPC else "fix that and re-run"
    return SglpatchError(f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "") + f"; {hint}")
