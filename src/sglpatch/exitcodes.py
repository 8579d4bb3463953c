"""The exit codes of every `sglpatch` command and every scripts/*.sh, written once.

Standard library only: scripts/lib.sh prints the table with any python3 (before the tool's own
venv exists), and the GPU suite uses it on a box without the series side's dependencies.
`python -m sglpatch.exitcodes` prints the table as the --help texts and README.md show it.
"""

from __future__ import annotations

OK = 0  # done; a check passed; a dry run or watch finds nothing a human must do
ERROR = 1  # an error (a one-line reason on stderr); a regression; a bisect left open
USAGE = 2  # a wrong or missing option or value, no project here, an unknown profile, --python not a Python
HUMAN = 3  # a human is needed: a conflict without a recorded resolution
CANNOT_RUN = 125  # this machine cannot run it (no GPU or driver, no torch, no Python with sglang): git bisect run skips
INTERRUPTED = 130  # Ctrl-C, or SIGTERM (kill PID)

TABLE: tuple[tuple[int, str], ...] = (
    (OK, "done; passed; a dry run or watch finds nothing for a human (unattended work included)"),
    (ERROR, "an error, said in one line; regress: a regression; bisect: no conclusion (skips)"),
    (USAGE, "usage: a wrong or missing option, no project here, unknown profile, bad --python"),
    (HUMAN, "a human is needed: a conflict without a recorded resolution (rebase stops, resumable)"),
    (CANNOT_RUN, "cannot run here: no GPU or driver (also when other checks fail), no torch, no Python with sglang (git bisect run skips)"),
    (INTERRUPTED, "interrupted (Ctrl-C) or terminated (kill PID): what it started is stopped first"),
)


def lines() -> list[str]:
    """The table as the --help epilogs, the scripts' --help and README.md show it."""
    return ["exit codes (every sglpatch command and scripts/*.sh but test.sh):"] + [f"  {code:<4} {text}" for code, text in TABLE]


def epilog() -> str:
    return "\n".join(lines())


if __name__ == "__main__":
    print(epilog())
