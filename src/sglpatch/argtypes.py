"""argparse pieces every command may use: value types, old option spellings kept as aliases that
warn once, and --json's output. The standard library and sglpatch.errors only: the GPU suite's
commands (doctor, regress, profile-report) use them too, on a box without the series side's
dependencies."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sglpatch.errors import SglpatchError


def positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def python_path(text: str) -> str:
    """argparse type of --python: a path is the caller's, made absolute here (the interpreter is asked
    from /), its links kept (a venv's bin/python is one: abspath, never realpath); a bare name
    (python3) stays for PATH to find."""
    exe = os.path.expanduser(text)
    return os.path.abspath(exe) if os.sep in exe else exe


def python_paths(text: str) -> str:
    """argparse type of a comma-separated list of interpreters (regress --ab A,B)."""
    return ",".join(python_path(p.strip()) if p.strip() else p for p in text.split(","))


_warned: set[str] = set()


class _Deprecated(argparse.Action):
    """An old spelling: stores into the new option's dest and warns once per process."""

    def __init__(self, option_strings, dest, new: str, **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string not in _warned:
            _warned.add(option_string)
            print(f"sglpatch: warning: {option_string} is an old spelling of {self.new}; it still works, and will be removed", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated(p: argparse.ArgumentParser, old: str, new: str, dest: str, **kw) -> None:
    """old as a hidden alias of new (same dest), warning once when used."""
    p.add_argument(old, action=_Deprecated, new=new, dest=dest, help=argparse.SUPPRESS, **kw)


def write_json(dest: str, text: str) -> None:
    """A --json value: '-' prints text to standard output, else it is written to the file dest
    (one line when it cannot be: a missing folder, no permission)."""
    if dest == "-":
        print(text)
        return
    try:
        Path(dest).write_text(text + "\n")
    except OSError as e:
        raise SglpatchError(f"--json {dest}: {e.strerror or e}") from None
