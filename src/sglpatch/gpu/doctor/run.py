"""`sglpatch doctor`: is this box ready for a load? One line per check, the fix on the same line.

    sglpatch doctor [--python PY] [--profile P] [--json FILE] [--kill-stale [--yes]] [--kernel-report DIR]

Checks, in order (`procs`, `checks`, `gpu` beside this file):
  1. gpu-procs   every process holding /dev/nvidia*; stale SGLang / torch workers fail (--kill-stale ends them)
  2. sglang, torch, flashinfer, sgl-kernel, env, env-traps: the serving interpreter, run in a child
  3. driver, nvcc, jit-kernels (the served sglang's JIT kernels that include flashinfer headers, built
     for the profile's [target] cuda_arch, default 12.0: compile and link only; the verdict kept for the same tree,
     flashinfer, nvcc and arch unless --recheck-jit; not built where no GPU is visible), shm, memlock, build-jobs
  4. topology, p2p-matrix, p2p-copy (a real copy per pair, each under a deadline), allreduce
  5. gpu-memory  free memory per GPU against the profile's [model] weights_gib / tp + margin

Exit status: 0 nothing failed; 1 a check failed; 125 no GPU is visible here (the GPU checks
could not run; the failed checks are still listed), unless stale workers hold a device; 2 a
usage error.  `sglpatch regress --tier server` runs the doctor first and refuses the load when
a check fails (`--no-doctor` skips it).

Every fact from outside is injectable (`Box`): the nvidia-smi program, the /proc root, the
device glob, the /dev/shm path, the P2P probe script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sglpatch import exitcodes
from sglpatch.pythonenv import jit_kernels, preflight
from sglpatch.argtypes import write_json
from sglpatch.gpu.options import DOCTOR_DESCRIPTION as DESCRIPTION
from sglpatch.gpu.options import doctor_arguments as add_arguments
from sglpatch.errors import SglpatchError, say
from sglpatch.gpu.doctor import checks as dc
from sglpatch.gpu.doctor import gpu as dg
from sglpatch.gpu.doctor import gpu_holders as dp
from sglpatch.gpu.shared import topology
from sglpatch.gpu.shared.profile import expand, find_project_root, load_profile, resolve_profile_path
from sglpatch.gpu.shared.report import TierResult
from sglpatch.gpu.shared.served import imported_sglang, version_tuple

EXIT_OK, EXIT_FAIL, EXIT_CANNOT_RUN = exitcodes.OK, exitcodes.ERROR, exitcodes.CANNOT_RUN


@dataclass
class Box:
    """Where the doctor reads the box (tests point each at a fake)."""

    nvidia_smi: str | None = None  # None: the one on PATH, if any
    proc_root: Path = Path("/proc")
    dev_glob: str = "/dev/nvidia*"
    shm: Path = Path("/dev/shm")
    p2p_probe: Path = dg.P2P_PROBE
    p2p_timeout: float = 20.0
    p2p_start_timeout: float = 180.0
    p2p: bool = True
    jit: bool = True  # build the JIT kernels that include flashinfer headers (sglpatch.pythonenv.jit_kernels)
    recheck_jit: bool = False  # build them again, not the verdict kept (sglpatch.pythonenv.jit_cache)
    reapers: frozenset = dp.REAPER_PIDS  # the PIDs that adopt orphans (a subreaper's too, where one runs)

    def smi(self) -> str | None:
        """The nvidia-smi to run: the one given when it is an executable file, else the one on PATH."""
        if self.nvidia_smi:
            return self.nvidia_smi if os.path.isfile(self.nvidia_smi) and os.access(self.nvidia_smi, os.X_OK) else None
        return shutil.which("nvidia-smi")


def check_procs(sc: dict, ended: list[str]) -> dc.Check:
    procs, smi_only = sc["procs"], sc["smi_only"]
    stale = [p for p in procs if p.stale]
    details = [p.line() for p in procs] + [f"pid {pid}: {mib} MiB per nvidia-smi, not visible here (the host's or "
                                           f"another container's PID)" for pid, mib in sorted(smi_only.items())] + ended
    n_ended = sum(1 for e in ended if e.startswith("ended"))
    done = f"ended {n_ended} stale process(es); " if n_ended else ""
    data = {"procs": [p.to_json() for p in procs], "smi_only": smi_only, "ended": ended}
    if stale:
        names = ", ".join(f"pid {p.pid} ({dp.one_line(p.cmdline.split()[0]) if p.cmdline.split() else '?'}, "
                          f"{p.gpu_mem_mib if p.gpu_mem_mib is not None else '?'} MiB, age {dp.age(p.age_s)})" for p in stale)
        return dc.Check("gpu-procs", "fail", f"{done}{len(stale)} stale SGLang/torch worker(s) (parent gone) hold the "
                        f"GPUs: {names}", "sglpatch doctor --kill-stale (ends exactly these: process group, then PID)",
                        details, data)
    if not sc["devices"]:
        return dc.Check("gpu-procs", "skip", f"{done}no /dev/nvidia* device here", details=details, data=data)
    if procs:
        names = ", ".join(f"pid {p.pid} ({dp.one_line(p.cmdline.split()[0]) if p.cmdline.split() else '?'}"
                          + (f"; kept: {p.evidence}" if p.worker and p.evidence else "") + ")" for p in procs)
        return dc.Check("gpu-procs", "warn", f"{done}{len(procs)} live process(es) hold the GPUs, none stale: {names}",
                        "stop the server that owns them before a load (they hold GPU memory)", details, data)
    if smi_only:
        return dc.Check("gpu-procs", "warn", f"{done}nvidia-smi names {len(smi_only)} GPU process(es) not visible here",
                        "end them where they run (the host: `nvidia-smi`, then kill by PID there)", details, data)
    if sc["unreadable"]:
        return dc.Check("gpu-procs", "warn", f"{done}{sc['unreadable']} processes' descriptors unreadable",
                        "run the doctor as root to see every process", details, data)
    return dc.Check("gpu-procs", "ok", f"{done}no process holds {', '.join(sc['devices'][:3])}"
                    + (" ..." if len(sc["devices"]) > 3 else ""), details=details, data=data)


def _kill_stale(box: Box, yes: bool, ask, out) -> list[str]:
    stale = [p for p in dp.scan(box.dev_glob, str(box.proc_root), box.smi(), box.reapers)["procs"] if p.stale]
    if not stale:
        return []
    out(f"doctor: {len(stale)} stale worker(s) to end (process group, then PID; SIGTERM, SIGKILL after 10 s):")
    for p in stale:
        out(f"  {p.line()}")
    if not yes:
        try:
            answer = ask(f"end these {len(stale)} process(es)? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            out("doctor: nothing ended (not confirmed; --yes ends without asking)")
            return []
    lines = dp.end_stale(stale)
    for line in lines:
        out(f"doctor: {line}")
    return lines


def run_doctor(python: str, prof: dict, project: Path, box: Box | None = None, env: dict | None = None,
               kill_stale: bool = False, yes: bool = False, kernel_report: Path | None = None,
               ask=input, out=print) -> dict:
    """Run every check; print each line as it is known (`out`); return the report document."""
    box = box or Box()
    env = dict(os.environ) if env is None else env
    smi = box.smi()
    checks: list[dc.Check] = []

    def add(*cs: dc.Check) -> None:
        for c in cs:
            checks.append(c)
            out(c.line())

    ended = _kill_stale(box, yes, ask, out) if kill_stale else []
    add(check_procs(dp.scan(box.dev_glob, str(box.proc_root), smi, box.reapers), ended))
    info = dc.probe_python(python, env)
    served = imported_sglang(python, env, project)
    rows, exe = preflight.gpus(smi) if smi else ([], "")
    topo, raw = topology.read(smi) if smi and rows else (topology.Topology(), {})
    klass = topology.classify(topo)[0]
    launch_args = [str(a) for a in (prof.get("server") or {}).get("launch_args", [])]
    add(dc.check_sglang(served), dc.check_torch(info, bool(rows)), *dc.check_kernels(info, served),
        dc.check_env(info, env, prof.get("env") or {}), dc.check_traps(info.get("env") or env, launch_args, klass))
    arch = str((prof.get("target") or {}).get("cuda_arch") or jit_kernels.ARCH)
    held = any(c.name == "gpu-procs" and c.state == "fail" for c in checks)  # the exit-status rule below: 125 without either
    add(dc.check_driver(info, rows, exe), dc.check_nvcc(info, rows, exe),
        dc.check_jit(python, env, arch, served.get("workdir"), box.jit, box.recheck_jit, gpus=bool(rows) or held), dc.check_shm(box.shm),
        dc.check_memlock(info), dc.check_build_jobs(info, dc.meminfo(box.proc_root)))
    add(*dg.check_topology(topo, raw))
    res, why = None, ""
    if not box.p2p:
        why = "not run (--no-p2p)"
    elif not rows:
        why = "no GPU visible (nvidia-smi " + ("answered none)" if smi else "not found)")
    elif len(rows) < 2:
        why = "one GPU: no pair to test"
    elif (info.get("torch") or {}).get("error") or info.get("error"):
        why = "the serving interpreter has no working torch"
    else:
        # CUDA_VISIBLE_DEVICES renumbers the GPUs: then every pair the probe's torch sees, in its numbering
        pairs = None if (info.get("env") or env).get("CUDA_VISIBLE_DEVICES") is not None else (topo.pairs() or None)
        which = f"{len(pairs)} GPU pair(s)" if pairs else "every GPU pair torch sees"
        say(f"doctor: P2P copy test on {which}, {box.p2p_timeout:g} s each at most")
        res = dg.run_p2p(python, env, pairs, box.p2p_probe, box.p2p_timeout, box.p2p_start_timeout)
    try:
        cmdline = (Path(box.proc_root) / "cmdline").read_text()
    except OSError:
        cmdline = ""
    add(dg.check_p2p(res, cmdline, why))
    add(dg.check_backend(klass, version_tuple(served.get("sglang_version")), kernel_report))
    add(dg.check_memory(dg.query_memory(smi) if rows else [], prof, info.get("env") or env))
    fails = [c for c in checks if c.state == "fail"]
    # no GPU: the GPU checks could not run, so 125 (not 1 for a Python that lacks what a GPU box has),
    # unless stale workers hold a device here (those fail wherever nvidia-smi is missing)
    code = EXIT_FAIL if fails and (rows or held) else (EXIT_OK if rows else EXIT_CANNOT_RUN)
    status = {EXIT_OK: "ok", EXIT_FAIL: "fail", EXIT_CANNOT_RUN: "cannot_run"}[code]
    counts = {s: sum(1 for c in checks if c.state == s) for s in dc.STATES}
    out(f"doctor: {status} (exit {code}): " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + ("" if rows else "; no GPU visible here, the GPU checks did not run"))
    return {"schema": "sglpatch.doctor/1", "status": status, "exit_code": code, "python": python,
            "profile": prof.get("_path"), "nvidia_smi": smi, "counts": counts,
            "checks": [c.to_json() for c in checks], "topology": topology.report(topo, raw)}


def serving_python(prof: dict, given: str | None) -> str:
    """--python, else the profile's [server] / [kernel] / [cpu] python, else this interpreter."""
    for v in (given, (prof.get("server") or {}).get("python"), prof["kernel"].get("python"), prof["cpu"].get("python")):
        if v:
            return expand(v)
    return sys.executable


def gate_server(prof: dict, python: str, project: Path, report_dir: Path, env: dict) -> TierResult | None:
    """The doctor before a server-tier load (its lines on stderr, its JSON in report_dir/doctor.json):
    None when nothing failed, else the server tier's result refusing the load, naming the checks."""
    say(f"doctor: checking the box before the load ({python}); --no-doctor skips this")
    doc = run_doctor(python, prof, project, env={k: str(v) for k, v in env.items()},
                     out=lambda line: None if line.startswith("ok") else say(line))
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "doctor.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    fails = [c for c in doc["checks"] if c["state"] == "fail"]
    if doc["exit_code"] == EXIT_CANNOT_RUN:  # no GPU visible: no load can start here (125, whatever else failed)
        tr = TierResult("server")
        tr.set_outcome("cannot_start")
        tr.summary = "the doctor finds no GPU here: the server tier cannot start (doctor.json); no load was started"
        tr.failures = [f"doctor: fail {c['name']}: {c['text']}" for c in fails]
        tr.data["doctor"], tr.data["cannot_run"] = "doctor.json", tr.summary
        return tr
    if not fails:
        return None
    tr = TierResult("server", status="cannot_run",
                    summary=f"the doctor refused the load: {', '.join(c['name'] for c in fails)} failed "
                    f"(doctor.json); fix them, or pass --no-doctor")
    tr.failures = [f"doctor: fail {c['name']}: {c['text']}" + (f"; fix: {c['fix']}" if c["fix"] else "") for c in fails]
    tr.data["doctor"] = "doctor.json"
    return tr


def run_args(args: argparse.Namespace) -> int:
    try:
        proj = Path(args.project).resolve() if args.project else find_project_root()
    except SglpatchError:
        if args.profile and not Path(args.profile).expanduser().is_file():
            raise
        proj = Path.cwd()
    prof = load_profile(resolve_profile_path(args.profile, proj) if args.profile else None)
    if args.kernel_report and not (Path(args.kernel_report) / "report.json").is_file():
        raise SglpatchError(f"--kernel-report {args.kernel_report}: no report.json there", exit_code=exitcodes.USAGE)
    box = Box(nvidia_smi=args.nvidia_smi, proc_root=Path(args.proc_root), dev_glob=args.dev_glob, shm=Path(args.shm),
              p2p_probe=Path(args.p2p_probe) if args.p2p_probe else dg.P2P_PROBE, p2p_timeout=args.p2p_timeout,
              p2p=not args.no_p2p, jit=not args.no_jit, recheck_jit=args.recheck_jit,
              reapers=frozenset(int(x) for x in args.reapers.split(",") if x.strip().isdigit()))
    doc = run_doctor(serving_python(prof, args.python), prof, proj, box, kill_stale=args.kill_stale, yes=args.yes,
                     kernel_report=Path(args.kernel_report) if args.kernel_report else None)
    if args.json:
        write_json(args.json, json.dumps(doc, indent=1, default=str))
    return doc["exit_code"]


def main(argv: list[str] | None = None) -> int:
    """`python -m sglpatch.gpu.doctor`: the same as `sglpatch doctor`, without the series side's dependencies."""
    p = argparse.ArgumentParser(prog="python -m sglpatch.gpu.doctor", description=DESCRIPTION)
    add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_args(args)
    except SglpatchError as e:
        print(f"sglpatch: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
