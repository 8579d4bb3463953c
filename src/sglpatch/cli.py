"""Command line: the parser assembled from each command's module, and main (the one-line errors
and exit codes). Each command's arguments and run function live next to its work: stack_cli
(apply, export, status, check, lock), bisect_cli, rebase_cli, watch_cli, and in the GPU suite
verify_profile (P4's report), sglpatch.gpu: regress, doctor; cliargs holds what they share."""

from __future__ import annotations

import argparse
import sys

from sglpatch import __version__, bisect_cli, exitcodes, lines_cli, rebase_cli, stack_cli, watch_cli
from sglpatch.errors import SglpatchError

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglpatch", description=DESCRIPTION, epilog=exitcodes.epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sglpatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # --- foundation (owner: core) ---------------------------------------
    stack_cli.register(sub)  # apply / export / status / check / lock
    lines_cli.register(sub)  # the lines side by side (issue 27)

    # --- profile-report (owner: P4 helper) --------------------------------
    _add_profile_report(sub)

    # --- regress (owner: regress helper) -----------------------------------
    _add_regress(sub)

    # --- doctor (owner: issue 20) ---------------------------------------------
    _add_doctor(sub)

    # --- bisect (owner: bisect helper) -------------------------------------
    bisect_cli.register(sub)

    # --- rebase (owner: rebase helper) -------------------------------------
    rebase_cli.register(sub)
    watch_cli.register(sub)
    for action in sub._choices_actions:  # every command: defaults shown, its summary on top, the exit codes below
        p = sub.choices[action.dest]
        p.formatter_class = _Help
        p.epilog = exitcodes.epilog()
        if p.description is None:
            p.description = action.help
    return parser


def _add_profile_report(sub) -> None:
    from sglpatch.gpu import profile_report

    p = sub.add_parser("profile-report", help="summarize an EAGLE cycle profile (SGLANG_VERIFY_PROFILE_FILE, patch 0004)",
                       description=profile_report.DESCRIPTION)
    profile_report.add_arguments(p)
    p.set_defaults(func=profile_report.run)


def _add_regress(sub) -> None:
    from sglpatch.gpu import regress

    p = sub.add_parser(
        "regress",
        help="GPU regression suite: tiers cpu, kernel, server; writes report.json + report.md",
        description=regress.DESCRIPTION,
    )
    regress.add_arguments(p)
    p.set_defaults(func=lambda args: regress.run_args(args, ["sglpatch", "regress"]))


def _add_doctor(sub) -> None:
    from sglpatch.gpu.doctor import run as doctor

    p = sub.add_parser("doctor", help="check the box before a load: stale GPU processes, the serving Python, "
                       "NCCL settings, driver, P2P per GPU pair, free memory (run it first on a new box)",
                       description=doctor.DESCRIPTION)
    doctor.add_arguments(p)
    p.set_defaults(func=doctor.run_args)


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # piped (`| tee`), stdout keeps its place among stderr's lines
        sys.stdout.reconfigure(line_buffering=True)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage line, not the top-level one (`rebase --dryrun`)
        parser._subparsers._group_actions[0].choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if hasattr(args, "line"):  # every command that acts on a series: its line and tree, resolved once
            from sglpatch import context

            args.ctx = context.resolve(args)
        return int(args.func(args) or 0)
    except SglpatchError as e:
        print(f"sglpatch: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("sglpatch: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
