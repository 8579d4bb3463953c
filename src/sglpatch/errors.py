"""The one exception type the CLI turns into a one-line message and an exit code."""

from sglpatch import exitcodes


class SglpatchError(Exception):
    """A failure the user can act on; str(e) is a single line saying what and what to do.
    exit_code: one of sglpatch.exitcodes (ERROR unless said)."""

    exit_code = exitcodes.ERROR

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill PID`): unwinds like Ctrl-C, after what this process started has ended."""


def say(msg: str) -> None:
    """Progress and warnings: one line on stderr, prefixed like the errors."""
    import sys

    print(f"sglpatch: {msg}", file=sys.stderr, flush=True)
