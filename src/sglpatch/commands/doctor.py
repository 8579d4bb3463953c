"""`sglpatch doctor`: the box checked before a load (sglpatch.gpu.doctor, also
`python -m sglpatch.gpu.doctor`)."""

from __future__ import annotations

from sglpatch.gpu.doctor import run as doctor

NAME = "doctor"
HELP = ("check the box before a load: stale GPU processes, the serving Python, NCCL settings, driver, P2P per GPU pair, "
        "free memory (run it first on a new box)")
DESCRIPTION = doctor.DESCRIPTION


def register(p) -> None:
    doctor.add_arguments(p)


def run(args) -> int:
    return doctor.run_args(args)
