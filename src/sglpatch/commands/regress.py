"""`sglpatch regress`: the GPU regression suite by tier (sglpatch.gpu.regress, also
`python -m sglpatch.gpu.regress` on a box with only this package's files)."""

from __future__ import annotations

from sglpatch.gpu import regress

NAME = "regress"
HELP = "GPU regression suite: tiers cpu, kernel, server; writes report.json + report.md"
DESCRIPTION = regress.DESCRIPTION


def register(p) -> None:
    regress.add_arguments(p)


def run(args) -> int:
    return regress.run_args(args, ["sglpatch", "regress"])
