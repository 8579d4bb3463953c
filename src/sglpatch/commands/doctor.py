"""`sglpatch doctor`: the box checked before a load (sglpatch.gpu.doctor, also
`python -m sglpatch.gpu.doctor`)."""

from __future__ import annotations

from sglpatch.gpu import options

NAME = "doctor"
HELP = ("check the box before a load: stale GPU processes, the serving Python, NCCL settings, driver, P2P per GPU pair, "
        "free memory (run it first on a new box)")
DESCRIPTION = options.DOCTOR_DESCRIPTION


def register(p) -> None:
    options.doctor_arguments(p)


def run(args) -> int:
    from sglpatch.gpu.doctor import run as doctor

    return doctor.run_args(args)
