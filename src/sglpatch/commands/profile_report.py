"""`sglpatch profile-report`: P4's EAGLE cycle profile summarized (the work is in
sglpatch.gpu.profile_report, standard library only, which runs on any machine)."""

from __future__ import annotations

from sglpatch.gpu import profile_report as report

NAME = "profile-report"
HELP = "summarize an EAGLE cycle profile (SGLANG_VERIFY_PROFILE_FILE, patch 0004)"
DESCRIPTION = report.DESCRIPTION


def register(p) -> None:
    report.add_arguments(p)


def run(args) -> int:
    return report.run(args)
