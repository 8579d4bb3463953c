"""argparse value types every command may use. Standard library only: the GPU suite's commands
(profile-report) use them too, on a box without the series side's dependencies."""

from __future__ import annotations

import argparse


def positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value
