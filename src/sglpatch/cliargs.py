"""The option vocabulary every command shares: one spelling, one meaning, one help text each.

    --workdir DIR, --project DIR, --line RELEASE   which tree (sglpatch.context resolves them once)
    --source auto|git|registry (sdist, wheel)      where an upstream tree comes from
    --json FILE ('-': standard output)             a machine-readable copy of what is printed
    --report-dir DIR                               where a command writes its report folder
    --...-timeout SEC / --timeout SEC              seconds, a positive number

Old spellings stay as aliases that warn once (`deprecated`). Each command's own options live in
its module of sglpatch.commands; an OSError becomes one line here."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from sglpatch.argtypes import deprecated, positive
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
    from sglpatch.project import find_project

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
        from sglpatch.project import find_project

        args.ctx = context.resolve(args)
        if args.ctx is None:
            find_project()  # raises the one line that says why
    return args.ctx


SOURCES = ("auto", "git", "registry", "sdist", "wheel")
SOURCE_HELP = ("where the upstream tree comes from: git (upstream.url), registry (the release's artifact on the package index: "
               "the one a lock pins; for a new release its sdist, else a wheel), sdist or wheel (the registry's, of that kind), "
               "auto (git when the URL answers, else registry; says which)")


def add_source(p: argparse.ArgumentParser, default: str, why: str) -> None:
    """--source, the same choices and meaning on every command; why: this command's default, said."""
    p.add_argument("--source", choices=SOURCES, default=default, help=f"{SOURCE_HELP} (default: {default}: {why})")


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", metavar="FILE", help=f"also write {what} as JSON to FILE ('-': standard output, instead of the text)")


def add_report_dir(p: argparse.ArgumentParser, default: str, old: str | None = None) -> None:
    p.add_argument("--report-dir", metavar="DIR", help=f"where the report folder goes (default: {default})")
    if old:
        deprecated(p, old, "--report-dir", dest="report_dir", metavar="DIR")


def add_timeout(p: argparse.ArgumentParser, flag: str, what: str, default: float | None = None) -> None:
    p.add_argument(flag, type=positive, metavar="SEC", default=default, help=f"{what}, in seconds")
