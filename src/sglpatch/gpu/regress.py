"""GPU regression suite: tiers cpu, kernel and server; report.json + report.md.

Exit status of `sglpatch regress` (also what `sglpatch bisect` sees; sglpatch.exitcodes):
  0    every tier that ran passed
  1    a regression or failure (wrong result, crash, below baseline, leftover process)
  2    a usage error (unknown profile, bad profile file, a --python that is not a Python)
  125  the requested tier cannot run here (no GPUs, no torch, no Python with sglang and its
       dependencies): `git bisect run` skips

Every GPU step runs under a timeout in its own process session; on timeout or when the
step ends, the whole tree it started (tracked by PID and start time, also children that
left the session) is terminated, never anything found by name.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path

from sglpatch import exitcodes
from sglpatch.pythonenv import interpreter
from sglpatch.errors import SglpatchError
from sglpatch.gpu.cpu.tier import CpuTier
from sglpatch.gpu.options import REGRESS_DESCRIPTION as DESCRIPTION
from sglpatch.gpu.options import TIERS
from sglpatch.gpu.options import regress_arguments as add_arguments
from sglpatch.gpu.kernel.tier import KernelTier
from sglpatch.gpu.server.ab import ServerABTier
from sglpatch.gpu.server.tier import ServerTier
from sglpatch.gpu.shared.plan import RunPlan, Tier
from sglpatch.gpu.shared.profile import expand, find_project_root, load_profile, resolve_profile_path, usage_error
from sglpatch.gpu.shared import verdict
from sglpatch.gpu.shared.report import write_report

EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_RUN = exitcodes.OK, exitcodes.ERROR, exitcodes.CANNOT_RUN


def run_regress(tier: str = "all", profile: str | None = None, report: str | None = None,
                project: str | None = None, baseline: str | None = None, argv: list[str] | None = None,
                stress: int | None = None, modes: str | None = None, parity_with: str | None = None,
                ab: str | None = None, doctor: bool = False, python: str | None = None, quick: bool = False,
                with_profile: str | None = None, workdir: str | None = None) -> dict:
    """python: the Python under test, every tier; ab: "A,B", the installs the kernel or server tier compares
    ("A,B" as python: the old spelling, warned); workdir:
    where to read the Python `apply` installed into (the cpu tier's default); None: not read."""
    if tier not in (*TIERS, "all"):
        raise usage_error(f"unknown tier {tier!r}; choose cpu, kernel, server or all")
    if (quick or with_profile) and tier not in ("kernel", "all"):
        raise usage_error("--quick and --with-profile belong to the kernel tier: use --tier kernel")
    pythons = [p for p in (python or "").split(",") if p.strip()]
    if len(pythons) > 1:  # the old kernel-tier spelling of --ab
        if ab:
            raise usage_error("--python A,B and --ab A,B both given: name the installs once, with --ab A,B")
        print("sglpatch: warning: --python A,B is spelled --ab A,B now (every tier that compares installs); "
              "read as --ab", file=sys.stderr)
        ab, pythons, python = python, [], None
    if ab and tier not in ("kernel", "server"):
        raise usage_error("--ab A,B compares installs in the kernel or the server tier: use it with --tier kernel or "
                          "--tier server (the cpu tier tests one install: --python PATH)")
    if ab and tier == "kernel":  # the kernel tier runs its bench in each interpreter and merges the rows
        pythons, ab = [p for p in ab.split(",") if p.strip()], None
    proj = Path(project).resolve() if project else find_project_root()
    prof_path = resolve_profile_path(profile, proj) if profile else None
    prof = load_profile(prof_path)
    if baseline and not Path(baseline).is_file():
        raise usage_error(f"--baseline {baseline}: no such file (give a previous report.json)")
    for p in pythons:  # the Python(s) under test: checked before anything is written
        interpreter.check_python(p.strip())
    python = ",".join(expand(p.strip()) for p in pythons) or None
    if len(pythons) == 1:
        for t in ("kernel", "server"):
            if prof.get(t):
                prof[t]["python"] = python
    started = datetime.datetime.now(datetime.timezone.utc)
    here = Path.cwd().resolve()  # inside the checkout: its top, where .gitignore's /regress-*/ keeps it out of git
    stamp = started.strftime("%Y%m%d-%H%M%S")
    if not report and os.environ.get("SGLPATCH_REGRESS_DIR"):  # scripts/regress.sh's, and bisect's per step
        report = str(Path(os.environ["SGLPATCH_REGRESS_DIR"]).expanduser() / stamp)
    report_dir = Path(report) if report else (proj if here.is_relative_to(proj) else here) / f"regress-{stamp}"
    report_dir = report_dir.resolve()
    plan = RunPlan(profile=prof, profile_path=prof_path, project=proj, report_dir=report_dir,
                   base_env={**os.environ, **{k: str(v) for k, v in prof["env"].items()}}, python=python,
                   workdir=Path(workdir).expanduser() if workdir else None,
                   baseline=Path(baseline) if baseline else None, stress=stress, quick=quick,
                   with_profile=with_profile, modes=modes, parity_with=parity_with, ab=ab, doctor=doctor)
    existed = report_dir.exists()
    report_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _run_tiers(plan, tier, argv, started)
    except BaseException:
        if not existed and report_dir.is_dir() and not any(report_dir.iterdir()):
            report_dir.rmdir()  # a run stopped before it wrote anything leaves no empty folder
        raise


def tier_classes(plan: RunPlan, tier: str) -> list[type[Tier]]:
    """The tiers asked for, in their order: cpu, kernel, server (or the server tier's A/B run)."""
    known = {"cpu": CpuTier, "kernel": KernelTier, "server": ServerABTier if plan.ab else ServerTier}
    return [known[t] for t in TIERS if tier in ("all", t)]


def _run_tiers(plan: RunPlan, tier: str, argv: list[str] | None, started: datetime.datetime) -> dict:
    results = []
    for cls in tier_classes(plan, tier):
        t = cls(plan)  # each tier: check, run if it can, report
        if t.check():
            t.run()
        results.append(t.report())
    status = verdict.run_status([r.status for r in results], every_tier_asked=tier == "all")
    code = verdict.EXIT[status]
    prof = plan.profile
    doc = {"schema": "sglpatch.regress/1", "status": status, "exit_code": code,
           "command": shlex.join(argv) if argv else f"sglpatch regress --tier {tier}",
           "cwd": os.getcwd(), "started_utc": started.isoformat(timespec="seconds"),
           "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "profile": str(plan.profile_path) if plan.profile_path else None, "target": prof["target"],
           "profile_env": prof["env"], "project": str(plan.project)}
    write_report(plan.report_dir, doc, results)
    return {"status": status, "exit_code": code, "report_dir": str(plan.report_dir),
            "tiers": [(r.name, r.status, r.summary, r.failures, r.data.get("cannot_run")) for r in results]}


def run_args(args: argparse.Namespace, prog: list[str]) -> int:
    """Run what add_arguments parsed; print one line per tier and where the report is."""
    argv = [*prog, "--tier", args.tier]
    for flag in ("profile", "report_dir", "baseline", "project", "modes", "parity_with", "ab", "python", "with_profile",
                 "workdir"):
        if getattr(args, flag):
            argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if args.no_doctor:
        argv.append("--no-doctor")
    if args.stress is not None:
        argv += ["--stress"] + ([str(args.stress)] if args.stress >= 0 else [])
    if args.quick:
        argv.append("--quick")
    res = run_regress(tier=args.tier, profile=args.profile, report=args.report_dir, project=args.project,
                      baseline=args.baseline, argv=argv, stress=args.stress, modes=args.modes,
                      parity_with=args.parity_with, ab=args.ab, doctor=not args.no_doctor, python=args.python,
                      quick=args.quick, with_profile=args.with_profile,
                      workdir=args.workdir or os.environ.get("SGLANG_FORK_DIR") or str(Path.home() / "sglang-fork"))
    for name, status, summary, failures, why in res["tiers"]:
        print(f"tier {name}: {status}: {summary}", *[f"  - {f}" for f in failures[:20]], *([f"  - cannot run here: {why}"] if why else []),
              sep="\n")
    print(f"regress: {res['status']} (exit {res['exit_code']}); report: {res['report_dir']}/report.md")
    return res["exit_code"]


def main(argv: list[str] | None = None) -> int:
    """`python -m sglpatch.gpu.regress ...`: the same as `sglpatch regress`, without the series side's
    dependencies (for a GPU box that has only this package's files)."""
    p = argparse.ArgumentParser(prog="python -m sglpatch.gpu.regress", description=DESCRIPTION, epilog=exitcodes.epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_args(args, ["python", "-m", "sglpatch.gpu.regress"])
    except SglpatchError as e:
        print(f"sglpatch: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
