"""`sglpatch regress`: the GPU regression suite by tier (sglpatch.gpu.regress, also
`python -m sglpatch.gpu.regress` on a box with only this package's files)."""

from __future__ import annotations

from sglpatch.gpu import options

NAME = "regress"
HELP = "GPU regression suite: tiers cpu, kernel, server; writes report.json + report.md"
DESCRIPTION = options.REGRESS_DESCRIPTION


def register(p) -> None:
    options.regress_arguments(p)


def run(args) -> int:
    from sglpatch.gpu import regress

    return regress.run_args(args, ["sglpatch", "regress"])
