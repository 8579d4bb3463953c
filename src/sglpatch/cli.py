"""Command line: the one table of commands (COMMANDS, one module of sglpatch.commands each, grouped
as --help shows them), the parser assembled from it, and main (the one-line errors and exit
codes). The options the commands share are sglpatch.cliargs' vocabulary."""

from __future__ import annotations

import argparse
import signal
import sys

from sglpatch import __version__, exitcodes
from sglpatch.commands import apply, bisect, check, doctor, export, lines, lock, profile_report, rebase, regress, status, watch
from sglpatch.errors import SglpatchError, Terminated

DESCRIPTION = """\
Keep a patched SGLang as a patch series (patch files, in order) on one pinned SGLang release. Build
the patched tree in a git workdir (default ~/sglang-fork) and install it into your Python;
write your commits there back to patches/; move the series onto a new release; find the
patch that broke something; regression-test on the GPUs.

Start with `scripts/apply.sh` (or `sglpatch apply`); `sglpatch COMMAND --help` shows a
command's options; README.md has the workflow."""


class _Help(argparse.HelpFormatter):
    """Wrapped help that shows an option's default, unless it is empty or the help says it;
    a text of several lines (the exit-code table) is shown as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line + "\n" for line in text.splitlines())
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


COMMANDS = (  # the one table: --help's groups, in order
    ("everyday", (apply, status, export, check, lines, lock)),
    ("moving releases", (rebase, watch)),
    ("finding faults", (bisect, regress, doctor, profile_report)),
)


def _commands_help() -> str:
    width = max(len(m.NAME) for _, mods in COMMANDS for m in mods) + 2
    out = []
    for group, mods in COMMANDS:
        out.append(f"{group}:")
        out += [f"  {m.NAME:<{width}}{m.HELP}" for m in mods]
    return "\n".join(out)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's, by name (its own usage line for its own errors)."""
    parser = argparse.ArgumentParser(prog="sglpatch", description=f"{DESCRIPTION}\n\n{_commands_help()}",
                                     epilog=exitcodes.epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sglpatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of the commands above")
    parsers = {}
    for _, mods in COMMANDS:
        for m in mods:  # every command: defaults shown, its summary on top, the exit codes below
            p = sub.add_parser(m.NAME, description=getattr(m, "DESCRIPTION", None) or m.HELP, formatter_class=_Help,
                               epilog=exitcodes.epilog())
            m.register(p)
            p.set_defaults(func=m.run)
            parsers[m.NAME] = p
    return parser, parsers


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # piped (`| tee`), stdout keeps its place among stderr's lines
        sys.stdout.reconfigure(line_buffering=True)
    parser, parsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage line, not the top-level one (`rebase --dryrun`)
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    old_term = _on_sigterm()
    try:
        if hasattr(args, "line"):  # every command that acts on a series: its line and tree, resolved once
            from sglpatch import context

            args.ctx = context.resolve(args)
        return int(args.func(args) or 0)
    except SglpatchError as e:
        print(f"sglpatch: error: {e}", file=sys.stderr)
        return e.exit_code
    except Terminated:
        print("sglpatch: terminated (SIGTERM); what it had started was stopped first, and nothing is left half-done "
              "that the next run does not finish", file=sys.stderr)
        return exitcodes.INTERRUPTED
    except KeyboardInterrupt:
        print("sglpatch: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _terminate(signum, frame) -> None:
    """`kill PID`: end pip, uv, git and their builds first, then unwind as Ctrl-C does (each command's
    clean-up runs; its lock is released only once nothing it started is left running)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean-up
    from sglpatch import proctree

    proctree.end_descendants()
    raise Terminated()


def _on_sigterm():
    """Install _terminate for SIGTERM; the handler it replaced (None off the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _terminate)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
