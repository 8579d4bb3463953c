"""GPU regression suite: tiers cpu, kernel and server; report.json + report.md.

Exit status of `sglpatch regress` (also what `sglpatch bisect` sees):
  0    every tier that ran passed
  1    a regression or failure (wrong result, crash, below baseline, leftover process)
  125  the requested tier cannot run here (no GPUs, no torch): `git bisect run` skips
  2    a usage error (unknown profile, bad profile file)

Every GPU step runs under a timeout in its own process session; on timeout or when the
step ends, the whole tree it started (tracked by PID and start time, also children that
left the session) is terminated, never anything found by name.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch.errors import SglpatchError

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

TIERS = ("cpu", "kernel", "server")
EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 125
KERNEL_BENCH = Path(__file__).with_name("kernel_bench.py")
DEFAULT_SIZES = [1, 2, 3, 4, 8, 16, 64, 512, 2048]
EXIT_USAGE = 2


def _usage(msg: str) -> SglpatchError:
    """A user error (bad profile, bad flag): exit 2, so bisect does not read it as a regression."""
    return SglpatchError(msg, exit_code=EXIT_USAGE)


# =========================================================================== profiles

DEFAULTS: dict = {
    "target": {"name": "local", "description": "", "gpu_name": None, "gpus": None, "nvlink": None},
    "env": {},
    "cpu": {"python": None, "pytest_python": None, "tests": "tests/patches", "import_check": "sglang", "timeout_s": 1800,
            "pytest_args": []},
    "kernel": {"python": None, "world_size": None, "sizes": DEFAULT_SIZES, "hidden": 7168,
               "backends": ["nccl", "symm_mem", "custom_ar", "flashinfer_fused"],
               "p2p_disabled_run": True, "required_backends": ["nccl"], "samples": 50, "inner": 10,
               "timeout_s": 420, "tolerance": 0.15, "abs_floor_us": 2.0, "baseline": None,
               "env": {}, "device": "cuda",
               # --stress [N]: N iterations per backend and mode (N omitted: stress_iterations)
               "stress_iterations": 10000, "stress_backends": ["custom_ar", "symm_mem"],
               "stress_required": [], "stress_sizes": [1, 2, 3, 4, 8, 16], "stress_modes": ["eager", "graph"],
               "stress_step_timeout_s": 120, "stress_timeout_s": 0},
    "server": None,
}
SERVER_DEFAULTS: dict = {
    "python": None, "host": "127.0.0.1", "port": 30000, "tp": 1, "model_path": "", "seed": 1234,
    "command": ["{python}", "-m", "sglang.launch_server", "--model-path", "{model_path}",
                "--tp", "{tp}", "--host", "{host}", "--port", "{port}", "--random-seed", "{seed}"],
    "launch_args": [], "health_timeout_s": 3600, "request_timeout_s": 900, "stop_grace_s": 30,
    "poll_s": 2.0, "env": {},
    "benchmark": {"num_requests": 8, "warmup_requests": 1, "max_new_tokens": 256,
                  "prompts": ["Write a detailed explanation of how a transformer language model "
                              "generates text, step by step."]},
    "baselines": {"no_spec_tok_s": None, "tolerance": 0.05},
    "modes": [{"name": "no_spec", "args": [], "env": {}, "gate": True}],
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def find_project_root(start: Path | None = None) -> Path:
    """The folder holding targets/ and tests/ of sglpatch (walks up from cwd)."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "targets").is_dir() and (d / "tests").is_dir():
            return d
    src_root = Path(__file__).resolve().parents[2]
    if (src_root / "targets").is_dir():
        return src_root
    return here


def resolve_profile_path(name: str, project: Path) -> Path:
    p = Path(name).expanduser()
    if p.is_file():
        return p
    cand = project / "targets" / (name if name.endswith(".toml") else f"{name}.toml")
    if cand.is_file():
        return cand
    known = sorted(x.stem for x in (project / "targets").glob("*.toml")) if (project / "targets").is_dir() else []
    raise _usage(f"profile {name!r} not found (looked at {p} and {cand}); known: {', '.join(known) or 'none'}")


def load_profile(path: Path | None) -> dict:
    prof = json.loads(json.dumps(DEFAULTS))
    if path is None:
        prof["_path"] = None
        return prof
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise _usage(f"cannot read profile {path}: {e}") from None
    unknown = set(data) - set(DEFAULTS)
    if unknown:
        raise _usage(f"profile {path}: unknown section(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    prof = _merge(prof, {k: v for k, v in data.items() if k != "server"})
    if "server" in data:
        srv = _merge(json.loads(json.dumps(SERVER_DEFAULTS)), data["server"])
        for i, m in enumerate(srv["modes"]):
            if "name" not in m:
                raise _usage(f"profile {path}: server.modes[{i}] has no name")
            m.setdefault("args", [])
            m.setdefault("env", {})
            m.setdefault("gate", True)
        prof["server"] = srv
    for sec in ("env",):
        bad = {k: v for k, v in prof[sec].items() if not isinstance(v, (str, int, float))}
        if bad:
            raise _usage(f"profile {path}: [{sec}] values must be strings or numbers: {sorted(bad)}")
    prof["_path"] = str(path)
    return prof


def _expand(v):
    return os.path.expanduser(str(v))


# =========================================================================== processes


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgid, starttime) from /proc (Linux)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rfind(")") + 2:].split()
        # fields after comm: state(0) ppid(1) pgrp(2) ... starttime is field 22 overall -> rest[19]
        try:
            out[int(d)] = (int(rest[1]), int(rest[2]), int(rest[19]))
        except (IndexError, ValueError):
            continue
    return out


def _starttime(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return int(s[s.rfind(")") + 2:].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rfind(")") + 2:].split()[0] == "Z"
    except OSError:
        return True


class ManagedProcess:
    """A command started in its own session.  `snapshot()` remembers every descendant
    (pid + start time) so that `stop()` can end them even after they left the session
    or were orphaned by a crashed parent."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path, cwd: str | None = None):
        self.cmd = cmd
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        try:
            self.popen = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise _usage(f"cannot start {cmd[0]}: {e}") from None
        self.pid = self.popen.pid
        self.seen: dict[int, int] = {}
        st = _starttime(self.pid)
        if st is not None:
            self.seen[self.pid] = st
        self.stopped = False

    def poll(self):
        return self.popen.poll()

    def snapshot(self) -> None:
        if not os.path.isdir("/proc"):
            return
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _pg, _st) in table.items():
            children.setdefault(ppid, []).append(pid)
        roots = [p for p in self.seen if p in table and table[p][2] == self.seen[p]]
        stack = list(roots)
        while stack:
            p = stack.pop()
            for c in children.get(p, []):
                if c not in self.seen:
                    self.seen[c] = table[c][2]
                    stack.append(c)
        # members of our session's process group that we never saw as descendants
        for pid, (_pp, pg, st) in table.items():
            if pg == self.pid and pid not in self.seen:
                self.seen[pid] = st

    def _alive_tracked(self) -> list[int]:
        return [p for p, st in self.seen.items() if _starttime(p) == st and not _is_zombie(p)]

    def _signal_all(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        for p in self._alive_tracked():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)

    def stop(self, grace_s: float = 15.0) -> list[int]:
        """Terminate the whole tree; returns PIDs still alive afterwards (should be [])."""
        if self.stopped:
            return self._alive_tracked()
        self.snapshot()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.popen.poll()
            if not self._alive_tracked():
                break
            time.sleep(0.1)
        if self._alive_tracked():
            self.snapshot()
            self._signal_all(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self._alive_tracked():
                self.popen.poll()
                time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self._log.close()
        self.stopped = True
        return self._alive_tracked()


def run_step(cmd: list[str], env: dict, log_path: Path, timeout_s: float, cwd: str | None = None) -> dict:
    """Run a command to completion under a timeout; kill its tree on timeout."""
    t0 = time.monotonic()
    mp = ManagedProcess(cmd, env, log_path, cwd=cwd)
    timed_out = False
    while mp.poll() is None:
        mp.snapshot()
        if time.monotonic() - t0 > timeout_s:
            timed_out = True
            break
        time.sleep(0.2)
    survivors = mp.stop(grace_s=10)
    return {"cmd": cmd, "rc": mp.popen.returncode, "timed_out": timed_out, "survivors": survivors,
            "wall_s": round(time.monotonic() - t0, 1), "log": str(log_path)}


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# =========================================================================== report


@dataclass
class TierResult:
    name: str
    status: str = "skipped"  # pass | fail | skipped | cannot_run
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    md: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self.status = "fail"


def _fmt(v, nd=1):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def write_report(report_dir: Path, doc: dict, tiers: list[TierResult]) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    doc = dict(doc)
    doc["tiers"] = {t.name: {"status": t.status, "summary": t.summary, "failures": t.failures, **t.data}
                    for t in tiers}
    (report_dir / "report.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = [f"# sglpatch regress — {doc['status'].upper()}", "",
          f"- date (UTC): {doc['started_utc']} … {doc['finished_utc']}",
          f"- command: `{doc['command']}`",
          f"- profile: {doc.get('profile') or '(none)'} — target: {doc.get('target', {}).get('name')}",
          f"- exit status: {doc['exit_code']}", ""]
    md.append("| tier | status | summary |")
    md.append("|---|---|---|")
    for t in tiers:
        md.append(f"| {t.name} | {t.status} | {t.summary} |")
    md.append("")
    for t in tiers:
        if t.status == "skipped" and not t.md:
            continue
        md.append(f"## tier {t.name}: {t.status}")
        md.append("")
        if t.failures:
            md.append("Failures:")
            md += [f"- {f}" for f in t.failures]
            md.append("")
        md += t.md
        md.append("")
    (report_dir / "report.md").write_text("\n".join(md) + "\n")


# =========================================================================== tier cpu


def tier_cpu(prof: dict, project: Path, report_dir: Path, base_env: dict) -> TierResult:
    tr = TierResult("cpu")
    cfg = prof["cpu"]
    python = _expand(cfg["python"] or sys.executable)
    tests = project / cfg["tests"]
    if not tests.exists():
        tr.fail(f"patch tests not found at {tests}")
        tr.summary = "no patch tests"
        return tr
    if cfg.get("import_check"):
        mod = cfg["import_check"]
        r = subprocess.run([python, "-c", f"import {mod}, sys; print(getattr({mod}, '__file__', ''));"
                            f" print(getattr({mod}, '__version__', ''))"],
                           capture_output=True, text=True, env=base_env, timeout=300, cwd="/")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            tr.fail(f"{mod} does not import with {python}: {last} (install the patched tree first)")
            tr.summary = f"{mod} not importable"
            return tr
        lines = r.stdout.splitlines() + ["", ""]
        tr.data["under_test"] = {"module": mod, "file": lines[0], "version": lines[1], "python": python}
    junit = report_dir / "cpu-junit.xml"
    # pytest runs with sglpatch's own interpreter (the conftest needs sglpatch + GitPython);
    # the interpreter holding the INSTALLED patched sglang is handed over in
    # SGLPATCH_PATCHED_PYTHON for the patch tests' `patched_python` fixture to use.
    runner = _expand(cfg.get("pytest_python") or sys.executable)
    base_env = dict(base_env, SGLPATCH_PATCHED_PYTHON=python)
    cmd = [runner, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={junit}", *map(str, cfg.get("pytest_args", []))]
    res = run_step(cmd, base_env, report_dir / "cpu-pytest.log", cfg["timeout_s"], cwd=str(project))
    tr.data["pytest"] = res
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        for s in suites:
            for k in counts:
                counts[k] += int(s.get(k, 0))
    except (OSError, ET.ParseError):
        pass
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    tr.data["counts"] = counts
    tr.summary = (f"{counts['passed']} passed, {counts['failures']} failed, {counts['errors']} errors, "
                  f"{counts['skipped']} skipped")
    if res["timed_out"]:
        tr.fail(f"pytest timed out after {cfg['timeout_s']} s (killed); log {res['log']}")
    elif res["rc"] == 5:
        tr.fail(f"no patch tests collected from {tests}")
    elif res["rc"] != 0:
        tr.fail(f"pytest exit {res['rc']}: {tr.summary}; log {res['log']}")
    else:
        tr.status = "pass"
    tr.md = [f"- patched sglang from: `{python}` (SGLPATCH_PATCHED_PYTHON); pytest run by `{runner}`", f"- under test: {tr.data.get('under_test')}",
             f"- `{shlex.join(cmd)}`", f"- result: {tr.summary} (log `cpu-pytest.log`, junit `cpu-junit.xml`)"]
    if tr.status == "fail":
        tr.md += ["", "```", tail(report_dir / "cpu-pytest.log", 30), "```"]
    return tr


# =========================================================================== tier kernel


def count_gpus(python: str, env: dict) -> tuple[int, str]:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            n = sum(1 for ln in r.stdout.splitlines() if ln.startswith("GPU "))
            vis = env.get("CUDA_VISIBLE_DEVICES")
            if vis is not None:
                n = min(n, len([x for x in vis.split(",") if x.strip()]))
            return n, "nvidia-smi"
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        r = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120, env=env)
        if r.returncode == 0:
            return int(r.stdout.strip().splitlines()[-1]), "torch"
        return 0, f"torch check failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return 0, f"no nvidia-smi and no torch ({e})"


def kernel_launches(prof: dict, world_size: int, report_dir: Path, python: str) -> list[dict]:
    k = prof["kernel"]
    common = ["--sizes", ",".join(map(str, k["sizes"])), "--hidden", str(k["hidden"]),
              "--samples", str(k["samples"]), "--inner", str(k["inner"])]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size)]
    launches = [{"name": "main", "env": {}, "out": report_dir / "kernel-main.json",
                 "cmd": torchrun + [str(KERNEL_BENCH), *common, "--backends", ",".join(k["backends"]),
                                    "--out", str(report_dir / "kernel-main.json")]}]
    if k.get("p2p_disabled_run", True) and "nccl" in k["backends"]:
        launches.append({"name": "p2p_off", "env": {"NCCL_P2P_DISABLE": "1"},
                         "out": report_dir / "kernel-p2p_off.json",
                         "cmd": torchrun + [str(KERNEL_BENCH), *common, "--backends", "nccl",
                                            "--name-suffix", "_p2p_off",
                                            "--out", str(report_dir / "kernel-p2p_off.json")]})
    return launches


def stress_launch(prof: dict, world_size: int, report_dir: Path, python: str, iterations: int) -> dict:
    """The --stress launch: kernel_bench --stress N over the profile's stress backends."""
    k = prof["kernel"]
    out = report_dir / "kernel-stress.json"
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
           str(KERNEL_BENCH), "--stress", str(iterations), "--stress-sizes", ",".join(map(str, k["stress_sizes"])),
           "--hidden", str(k["hidden"]), "--backends", ",".join(k["stress_backends"]),
           "--modes", ",".join(k["stress_modes"]), "--stress-step-timeout", str(k["stress_step_timeout_s"]),
           "--out", str(out)]
    if k.get("device") == "cpu":
        cmd += ["--device", "cpu"]
    legs = max(1, len(k["stress_backends"]) * len(k["stress_modes"]))
    # a backstop only: a hang is caught per step (worker watchdog, then the log-silence limit below)
    total = float(k["stress_timeout_s"] or 900 + iterations * legs * 0.002)
    return {"name": "stress", "env": {}, "out": out, "cmd": cmd, "timeout_s": total,
            "stall_s": float(k["stress_step_timeout_s"]) + 60.0}


HANG_LINE = re.compile(r"\[kernel_bench\] HANG .*")


def run_watched_step(cmd: list[str], env: dict, log_path: Path, timeout_s: float, stall_s: float,
                     cwd: str | None = None) -> dict:
    """Like run_step, and also ends the tree when its log stays silent for stall_s seconds
    (kernel_bench --stress prints progress every few seconds; silence means a hang)."""
    t0 = time.monotonic()
    mp = ManagedProcess(cmd, env, log_path, cwd=cwd)
    why, size, quiet_since = None, -1, t0
    while mp.poll() is None:
        mp.snapshot()
        now = time.monotonic()
        with contextlib.suppress(OSError):
            cur = Path(log_path).stat().st_size
            if cur != size:
                size, quiet_since = cur, now
        if now - t0 > timeout_s:
            why = f"ran past {timeout_s:.0f} s"
        elif now - quiet_since > stall_s:
            why = f"no output for {stall_s:.0f} s"
        if why:
            break
        time.sleep(0.2)
    survivors = mp.stop(grace_s=10)
    return {"cmd": cmd, "rc": mp.popen.returncode, "timed_out": why is not None, "why": why,
            "survivors": survivors, "wall_s": round(time.monotonic() - t0, 1), "log": str(log_path)}


def stress_failures(doc: dict, required: list[str]) -> list[str]:
    """Failure lines for a kernel_bench --stress result: a mismatch names iteration and rank."""
    out = []
    for r in doc.get("stress", []):
        if r.get("first_mismatch"):
            f, (row, col) = r["first_mismatch"], r["first_mismatch"]["element"]
            out.append(f"STRESS MISMATCH {r['backend']} {r['mode']}: iteration {f['iteration']}, rank {f['rank']}, "
                       f"[{f['rows']},{f['hidden']}] element [{row},{col}]: got {f['got']:g}, NCCL {f['nccl']:g} "
                       f"({r.get('mismatched_iterations')} of {r.get('iterations_done')} iterations wrong "
                       f"before the stop)")
        elif r.get("status") == "error":
            out.append(f"stress {r['backend']} {r['mode']} raised after {r.get('iterations_done', 0)} iterations: "
                       f"{r.get('detail')}")
        elif r.get("status") != "ok":
            out.append(f"stress {r['backend']} {r['mode']}: {r.get('status')}, {r.get('iterations_done')} of "
                       f"{r.get('iterations_requested')} iterations")
    for b, msg in (doc.get("errors") or {}).items():
        out.append(f"stress backend {b} failed to set up: {msg}")
    ran = {r["backend"] for r in doc.get("stress", [])}
    for b in required:
        if b not in ran and b not in (doc.get("errors") or {}):
            out.append(f"required stress backend {b} did not run: {(doc.get('absent') or {}).get(b, 'no result')}")
    if not doc.get("stress") and not out:
        out.append("stress: no backend besides NCCL could run, nothing was stressed: "
                   f"{doc.get('absent') or {}}")
    return out


def run_stress_step(prof: dict, ws: int, report_dir: Path, python: str, env: dict, project: Path,
                    iterations: int, tr: "TierResult") -> dict:
    k = prof["kernel"]
    L = stress_launch(prof, ws, report_dir, python, iterations)
    with contextlib.suppress(FileNotFoundError):
        L["out"].unlink()
    lenv = dict(env, PYTHONUNBUFFERED="1")
    res = run_watched_step(L["cmd"], lenv, report_dir / "kernel-stress.log", L["timeout_s"], L["stall_s"],
                           cwd=str(project))
    res["env_added"] = {}
    hang = None
    with contextlib.suppress(OSError):
        hang = next((m.group(0) for m in HANG_LINE.finditer(Path(res["log"]).read_text(errors="replace"))), None)
    st: dict = {"iterations": iterations, "launch": res, "step_timeout_s": k["stress_step_timeout_s"]}
    if res["timed_out"]:
        tr.fail(f"stress HUNG ({res['why']}; killed; log kernel-stress.log): {hang or tail(Path(res['log']), 1)}")
    elif hang:
        tr.fail(f"stress HUNG (per-step timeout {k['stress_step_timeout_s']} s; log kernel-stress.log): {hang}")
    elif res["rc"] != 0 or not L["out"].exists():
        tr.fail(f"stress launch exited {res['rc']} without a result (log kernel-stress.log): "
                f"{tail(Path(res['log']), 1)}")
    if res["survivors"]:
        tr.fail(f"stress launch: processes {res['survivors']} survived the stop")
    if L["out"].exists() and not res["timed_out"]:
        doc = json.loads(L["out"].read_text())
        st.update({key: doc.get(key) for key in ("stress", "absent", "errors", "hardware", "reference", "sizes",
                                                 "value_bound", "elapsed_s")})
        for f in stress_failures(doc, list(k.get("stress_required", []))):
            tr.fail(f)
    st["hang"] = hang
    return st


def find_crossover(rows: list[dict], mode: str, hidden: int) -> dict | None:
    """Where the custom allreduce (or symm-mem one-shot as its stand-in) stops beating NCCL."""
    ok = [r for r in rows if r.get("status") == "ok" and r["mode"] == mode]
    by = {}
    for r in ok:
        by.setdefault(r["backend"], {})[r["rows"]] = r["median_us"]
    custom = "custom_ar" if by.get("custom_ar") else ("symm_mem" if by.get("symm_mem") else None)
    if custom is None or "nccl" not in by:
        return None
    sizes = sorted(set(by[custom]) & set(by["nccl"]))
    if not sizes:
        return None
    wins = {n: by[custom][n] < by["nccl"][n] for n in sizes}
    # crossover: the smallest size from which custom loses at every larger size too;
    # a lone loss below it (noise, or a real dip) is listed, not taken as the crossover
    first_loss = None
    for i, n in enumerate(sizes):
        if all(not wins[m] for m in sizes[i:]):
            first_loss = n
            break
    below = [n for n in sizes if first_loss is None or n < first_loss]
    cap_rows = max((n for n in below if wins[n]), default=0)
    isolated = [n for n in below if not wins[n]]
    wins_anywhere_above = False
    return {"mode": mode, "custom": custom, "stand_in": custom != "custom_ar",
            "wins_up_to_rows": cap_rows, "first_loss_rows": first_loss,
            "recommended_max_bytes": cap_rows * hidden * 2 if first_loss is not None else None,
            "wins_at_all_sizes": first_loss is None, "wins_again_above_crossover": wins_anywhere_above,
            "losses_below_crossover": isolated,
            "speedup_at_3": (round(by["nccl"][3] / by[custom][3], 2) if 3 in by[custom] and 3 in by["nccl"] else None)}


def compare_kernel_baseline(rows: list[dict], base_doc: dict, hw: dict, tol: float, floor_us: float) -> dict:
    bk = base_doc.get("tiers", {}).get("kernel", base_doc)
    bhw = bk.get("hardware") or {}
    same = (bhw.get("gpu_name") == hw.get("gpu_name") and bhw.get("world_size") == hw.get("world_size"))
    out = {"hardware_matches": same, "baseline_hardware": f"{bhw.get('world_size')}x {bhw.get('gpu_name')}",
           "regressions": [], "compared": 0}
    if not same:
        return out
    old = {(r["backend"], r["mode"], r["rows"]): r for r in bk.get("results", []) if r.get("status") == "ok"}
    for r in rows:
        o = old.get((r["backend"], r["mode"], r["rows"]))
        if r.get("status") != "ok" or not o:
            continue
        out["compared"] += 1
        if r["median_us"] > o["median_us"] * (1 + tol) + floor_us:
            out["regressions"].append(f"{r['backend']} {r['mode']} [{r['rows']},{r['hidden']}]: "
                                      f"{r['median_us']} us vs baseline {o['median_us']} us")
    return out


def tier_kernel(prof: dict, project: Path, report_dir: Path, base_env: dict,
                baseline: Path | None = None, stress: int | None = None) -> TierResult:
    """Latency + correctness launches; with `stress` (iterations, -1 = the profile's
    stress_iterations) also the stress launch.  `[kernel] device = "cpu"` (tests only) runs
    just the stress launch on CPU under gloo."""
    tr = TierResult("kernel")
    k = prof["kernel"]
    python = _expand(k["python"] or sys.executable)
    env = dict(base_env)
    env.update({kk: str(v) for kk, v in k.get("env", {}).items()})
    if stress is not None and stress < 0:
        stress = int(k["stress_iterations"])
    cpu_test = k.get("device") == "cpu"
    if cpu_test:
        if not stress:
            raise _usage('[kernel] device = "cpu" runs only the stress launch: give --stress')
        ngpu, ws = 0, int(k["world_size"] or 2)
    else:
        ngpu, how = count_gpus(python, env)
        ws = int(k["world_size"] or ngpu)
        if ngpu < 2 or ws < 2:
            tr.status = "cannot_run"
            tr.summary = f"needs >= 2 CUDA GPUs, found {ngpu} ({how})"
            return tr
        if ws > ngpu:
            tr.status = "cannot_run"
            tr.summary = f"profile wants world size {ws}, only {ngpu} GPUs visible"
            return tr
    merged: list[dict] = []
    absent: dict[str, str] = {}
    errors: dict[str, str] = {}
    hw: dict = {}
    launches_out = []
    for L in ([] if cpu_test else kernel_launches(prof, ws, report_dir, python)):
        lenv = dict(env)
        lenv.update(L["env"])
        lenv.setdefault("PYTHONUNBUFFERED", "1")
        with contextlib.suppress(FileNotFoundError):
            L["out"].unlink()
        res = run_step(L["cmd"], lenv, report_dir / f"kernel-{L['name']}.log", k["timeout_s"], cwd=str(project))
        res["env_added"] = L["env"]
        launches_out.append(res)
        if res["timed_out"]:
            tr.fail(f"launch {L['name']} hung past {k['timeout_s']} s and was killed "
                    f"(log kernel-{L['name']}.log): {tail(Path(res['log']), 1)}")
            continue
        if res["survivors"]:
            tr.fail(f"launch {L['name']}: processes {res['survivors']} survived the stop")
        if res["rc"] != 0 or not L["out"].exists():
            tr.fail(f"launch {L['name']} exited {res['rc']} without a result (log kernel-{L['name']}.log): "
                    f"{tail(Path(res['log']), 1)}")
            continue
        doc = json.loads(L["out"].read_text())
        if L["name"] == "main" or not hw:
            hw = doc.get("hardware") or {}
        merged += doc["results"]
        absent.update(doc.get("absent", {}))
        errors.update(doc.get("errors", {}))
    tr.data.update({"hardware": hw, "results": merged, "absent": absent, "errors": errors,
                    "launches": launches_out, "hidden": k["hidden"], "sizes": k["sizes"],
                    "world_size": ws, "latency_run": not cpu_test})
    required = set(k.get("required_backends", []))
    for b, msg in errors.items():
        if b in required or b.split("_p2p_off")[0] in ("nccl", "symm_mem", "custom_ar"):
            tr.fail(f"backend {b} failed to set up: {msg}")
    for b in ([] if cpu_test else required):
        present = {r["backend"] for r in merged}
        if b not in present and b not in errors:
            tr.fail(f"required backend {b} did not run: {absent.get(b, 'no result')}")
    for r in merged:
        if r["status"] == "wrong":
            tr.fail(f"WRONG RESULT {r['backend']} {r['mode']} [{r['rows']},{r['hidden']}]: {r.get('detail')}")
        elif r["status"] == "error":
            tr.fail(f"{r['backend']} {r['mode']} [{r['rows']},{r['hidden']}] raised: {r.get('detail')}")
    if stress:
        tr.data["stress"] = run_stress_step(prof, ws, report_dir, python, env, project, stress, tr)
        hw = hw or tr.data["stress"].get("hardware") or {}
        tr.data["hardware"] = hw
    tr.data["crossover"] = {m: find_crossover(merged, m, k["hidden"]) for m in ("graph", "eager")}
    base_path = baseline or (project / k["baseline"] if k.get("baseline") else None)
    if base_path and Path(base_path).is_file():
        cmp = compare_kernel_baseline(merged, json.loads(Path(base_path).read_text()), hw,
                                      k["tolerance"], k["abs_floor_us"])
        cmp["path"] = str(base_path)
        tr.data["baseline"] = cmp
        for reg in cmp["regressions"]:
            tr.fail(f"slower than baseline: {reg}")
    elif base_path:
        tr.data["baseline"] = {"path": str(base_path), "note": "baseline file not found; nothing compared"}
    from sglpatch.plot import plot_kernel

    note = plot_kernel(tr.data, str(report_dir / "kernel.png")) if merged else "plot skipped: no results"
    tr.data["plot"] = "kernel.png" if note is None else None
    tr.data["plot_note"] = note
    if tr.status != "fail":
        tr.status = "pass"
    ok = sum(1 for r in merged if r["status"] == "ok")
    tr.summary = (f"{ok} measurements ok on {ws}x {hw.get('gpu_name', '?')}; "
                  f"{len(tr.failures)} failures; absent: {', '.join(sorted(absent)) or 'none'}")
    if cpu_test:
        tr.summary = f"cpu test mode, {ws} ranks (gloo), no latency launches; {len(tr.failures)} failures"
    if stress:
        rows = tr.data["stress"].get("stress") or []
        tr.summary += (f"; stress {stress} x {len(rows)} backend/mode: "
                       + (", ".join(f"{r['backend']} {r['mode']} {r.get('status')}" for r in rows) or "none ran"))
    tr.md = kernel_markdown(tr.data, prof)
    return tr


def hardware_line(hw: dict) -> str:
    return (f"{hw.get('world_size', '?')}x {hw.get('gpu_name', '?')} (sm {hw.get('compute_capability', '?')}), "
            f"NVLink: {({True: 'yes', False: 'no', None: 'unknown'})[hw.get('nvlink')]}, "
            f"torch {hw.get('torch', '?')}, CUDA {hw.get('cuda_runtime', '?')}, NCCL {hw.get('nccl', '?')}, "
            f"driver {hw.get('driver', '?')}")


def kernel_markdown(d: dict, prof: dict) -> list[str]:
    hw = d.get("hardware") or {}
    md = [f"**Measured on: {hardware_line(hw)}.**", ""]
    tgt = prof.get("target", {})
    if tgt.get("gpu_name") and hw.get("gpu_name") and tgt["gpu_name"] != hw.get("gpu_name"):
        md += [f"> These numbers are from {hw.get('gpu_name')}, not from the profile's target "
               f"({tgt['gpu_name']}); do not read them as target numbers.", ""]
    if d.get("latency_run") is False:
        md += ['Latency launches not run (`[kernel] device = "cpu"`: the stress test mode on CPU, gloo).', ""]
        if d.get("stress"):
            md += stress_markdown(d["stress"])
        return md
    env = {k: v for k, v in (hw.get("env") or {}).items() if k.startswith("NCCL_")}
    md += [f"NCCL env of the main launch: `{env or '{}'}`; the `_p2p_off` rows add `NCCL_P2P_DISABLE=1` "
           f"(separate launch).", "",
           f"Latency per allreduce, median / p90 in us (one sample = {prof['kernel']['inner']} ops back to back; "
           "a sample's time is the last-arriving rank's, i.e. the least over the ranks: that rank waited for "
           "nobody at the collective; every output checked against an exact integer reference).", ""]
    backends = []
    for r in d.get("results", []):
        if r["backend"] not in backends:
            backends.append(r["backend"])
    for mode in ("graph", "eager"):
        md += [f"### {mode} ({'CUDA-graph captured, as in decode' if mode == 'graph' else 'eager'})", "",
               "| rows x hidden | KiB | " + " | ".join(backends) + " |",
               "|---|---|" + "---|" * len(backends)]
        for n in d.get("sizes", []):
            cells = []
            for b in backends:
                r = next((x for x in d["results"] if x["backend"] == b and x["mode"] == mode and x["rows"] == n), None)
                if r is None:
                    cells.append("—")
                elif r["status"] == "ok":
                    cells.append(f"{r['median_us']:.1f} / {r['p90_us']:.1f}")
                else:
                    cells.append(f"**{r['status'].upper()}**")
            md.append(f"| {n} x {d.get('hidden')} | {n * d.get('hidden', 0) * 2 / 1024:.0f} | " + " | ".join(cells) + " |")
        md.append("")
    md += ["### Crossover (recommendation for `SGLANG_PCIE_CUSTOM_AR_MAX_BYTES`)", ""]
    for mode, c in (d.get("crossover") or {}).items():
        if not c:
            md.append(f"- {mode}: no custom/one-shot backend measured next to NCCL")
            continue
        who = c["custom"] + (" (torch symm-mem one-shot as a stand-in for SGLang's custom allreduce)" if c["stand_in"] else "")
        if c["wins_at_all_sizes"]:
            md.append(f"- {mode}: {who} beats NCCL at every measured size; cap >= the largest size measured")
        elif c["wins_up_to_rows"] == 0:
            md.append(f"- {mode}: {who} never beats NCCL (already slower at [{c['first_loss_rows']},{d.get('hidden')}]); "
                      "recommendation: keep it off")
        else:
            md.append(f"- {mode}: {who} beats NCCL up to [{c['wins_up_to_rows']},{d.get('hidden')}], "
                      f"loses from [{c['first_loss_rows']},{d.get('hidden')}]: "
                      f"recommended cap {c['recommended_max_bytes']} bytes"
                      + (f" (NCCL also won at rows {c['losses_below_crossover']}: check p90 / re-run)"
                         if c.get("losses_below_crossover") else ""))
        if c.get("speedup_at_3"):
            md.append(f"  - at [3,{d.get('hidden')}] (verify pass): NCCL / {c['custom']} = {c['speedup_at_3']}x")
    md.append("")
    if d.get("absent"):
        md += ["### Absent backends", ""] + [f"- {b}: {why}" for b, why in sorted(d["absent"].items())] + [""]
    if d.get("errors"):
        md += ["### Backends that failed to set up", ""] + [f"- {b}: {why}" for b, why in sorted(d["errors"].items())] + [""]
    if d.get("baseline"):
        md += ["### Baseline", "", f"- {d['baseline']}", ""]
    if d.get("stress"):
        md += stress_markdown(d["stress"])
    md.append(f"Plot: `{d['plot']}`" if d.get("plot") else f"Plot: {d.get('plot_note')}")
    md += ["", "Launches:"] + [f"- `{' '.join(shlex.quote(c) for c in L['cmd'])}` env+{L['env_added']} "
                               f"rc={L['rc']} timed_out={L['timed_out']} {L['wall_s']} s"
                               for L in d.get("launches", [])]
    return md


def stress_markdown(st: dict) -> list[str]:
    rows = st.get("stress") or []
    md = ["### Stress: every result compared exactly with NCCL", "",
          f"{st.get('iterations')} iterations per backend and mode (rounded up to whole groups), in groups of "
          f"back-to-back ops over rows {st.get('sizes')}; fresh integer inputs in "
          f"[-{st.get('value_bound')}, {st.get('value_bound')}] every iteration, so every sum is exact; each "
          f"result compared exactly with {st.get('reference')} on the same input; per-step timeout "
          f"{st.get('step_timeout_s')} s.", "",
          "| backend | mode | iterations done | mismatched iterations | first mismatch | elapsed s | it/s |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r.get("first_mismatch")
        first = (f"iteration {f['iteration']}, rank {f['rank']}, [{f['rows']},{f['hidden']}] element "
                 f"{f['element']}: got {f['got']:g}, NCCL {f['nccl']:g}") if f else "—"
        status = "" if r.get("status") == "ok" else f" **{str(r.get('status')).upper()}**"
        md.append(f"| {r['backend']} | {r['mode']}{' (' + r['graph_impl'] + ')' if r.get('graph_impl') else ''} | "
                  f"{r.get('iterations_done')} / {r.get('iterations_requested')}{status} | "
                  f"{r.get('mismatched_iterations', '—')} | {first} | {r.get('elapsed_s', '—')} | {r.get('it_per_s', '—')} |")
    if st.get("hang"):
        md += ["", f"**Hang:** `{st['hang']}`"]
    absent = {b: w for b, w in (st.get("absent") or {}).items() if b != "nccl"}
    if absent:
        md += [""] + [f"- not stressed: {b}: {why}" for b, why in sorted(absent.items())]
    L = st.get("launch") or {}
    md += ["", f"Stress launch: `{shlex.join(L.get('cmd', []))}` rc={L.get('rc')} "
               f"timed_out={L.get('timed_out')} {L.get('wall_s')} s (log `kernel-stress.log`)", ""]
    return md


# =========================================================================== tier server

FATAL_ANYWHERE = [re.compile(p) for p in (r"CUDA out of memory", r"torch\.OutOfMemoryError",
                                          r"RuntimeError: NCCL", r"NCCL error:? .*(unhandled|internal|invalid)")]
TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")


class CrashScanner:
    """Reads a server log incrementally.  Reacts to real crash lines only: fatal patterns
    (CUDA OOM, NCCL runtime errors) at once; a top-level Traceback only together with
    the process exiting.  The word "Exception" in a warning means nothing."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.partial = ""
        self.in_tb = False
        self.last_exception_line: str | None = None
        self.last_line = ""

    def scan(self) -> str | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except OSError:
            return None
        text = self.partial + chunk.decode(errors="replace")
        lines = text.split("\n")
        self.partial = lines.pop()
        fatal = None
        for ln in lines:
            ln = ln.rstrip("\r")
            if ln.strip():
                self.last_line = ln
            if TRACEBACK.match(ln):
                self.in_tb = True
                continue
            if self.in_tb and ln and not ln[0].isspace():
                self.last_exception_line = ln
                self.in_tb = False
            if fatal is None and any(p.search(ln) for p in FATAL_ANYWHERE):
                fatal = ln.strip()
        return fatal


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return 0, b""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def wait_healthy(mp: ManagedProcess, base_url: str, timeout_s: float, poll_s: float = 2.0) -> tuple[str, str]:
    """('healthy'|'crash'|'timeout', detail)."""
    scanner = CrashScanner(mp.log_path)
    t0 = time.monotonic()
    while True:
        mp.snapshot()
        fatal = scanner.scan()
        if fatal:
            return "crash", fatal
        rc = mp.poll()
        if rc is not None:
            scanner.scan()
            why = scanner.last_exception_line or scanner.last_line or "no output"
            return "crash", f"server exited with code {rc} while loading: {why}"
        code, _ = http_get(base_url + "/health", timeout=min(5.0, poll_s + 3))
        if code == 200:
            return "healthy", f"healthy after {time.monotonic() - t0:.1f} s"
        if time.monotonic() - t0 > timeout_s:
            return "timeout", (f"not healthy after {timeout_s} s (process alive); last log line: "
                               f"{scanner.last_line[:300]}")
        time.sleep(poll_s)


def generate_stream(host: str, port: int, prompt: str, max_new_tokens: int, timeout: float) -> dict:
    body = json.dumps({"text": prompt, "stream": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                           "ignore_eos": True}})
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t_send = time.perf_counter()
    try:
        conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/generate returned HTTP {resp.status}: {resp.read()[:200]!r}")
        t_first = tok_first = None
        last_meta: dict = {}
        t_last = t_send
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            msg = json.loads(payload)
            meta = msg.get("meta_info", {})
            now = time.perf_counter()
            ntok = int(meta.get("completion_tokens", 0))
            if t_first is None and ntok > 0:
                t_first, tok_first = now, ntok
            last_meta = meta
            t_last = now
    finally:
        conn.close()
    ntok = int(last_meta.get("completion_tokens", 0))
    out = {"completion_tokens": ntok, "e2e_s": t_last - t_send,
           "ttft_s": (t_first - t_send) if t_first else None,
           "spec_verify_ct": last_meta.get("spec_verify_ct")}
    if t_first is not None and ntok > tok_first and t_last > t_first:
        out["decode_tok_s"] = (ntok - tok_first) / (t_last - t_first)
    out["e2e_tok_s"] = ntok / out["e2e_s"] if out["e2e_s"] > 0 else None
    if out["spec_verify_ct"]:
        out["accept_length"] = ntok / float(out["spec_verify_ct"])
    return out


def _find_key(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            r = _find_key(v, key)
            if r is not None:
                return r
    elif isinstance(obj, list):
        for v in obj:
            r = _find_key(v, key)
            if r is not None:
                return r
    return None


def read_verify_profile(path: Path) -> dict | None:
    """P4's JSON lines (draft_ms/verify_ms/extend_ms/cycle_ms, accept_length, tok_s,
    break_even_accept_length); returns the last record plus medians of numeric fields."""
    if not path.is_file():
        return None
    recs = []
    for ln in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            r = json.loads(ln)
            if isinstance(r, dict):
                recs.append(r)
    if not recs:
        return {"records": 0}
    med = {}
    for key in {k for r in recs for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}:
        vals = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
        med[key] = statistics.median(vals)
    return {"records": len(recs), "last": recs[-1], "median_of_records": med,
            "break_even_accept_length": _find_key(recs[-1], "break_even_accept_length")}


def run_benchmark(host: str, port: int, bench: dict, timeout: float) -> dict:
    prompts = bench["prompts"]
    reqs = []
    for i in range(bench["warmup_requests"]):
        generate_stream(host, port, prompts[i % len(prompts)], min(32, bench["max_new_tokens"]), timeout)
    for i in range(bench["num_requests"]):
        reqs.append(generate_stream(host, port, prompts[i % len(prompts)], bench["max_new_tokens"], timeout))
    dec = [r["decode_tok_s"] for r in reqs if r.get("decode_tok_s")]
    e2e = [r["e2e_tok_s"] for r in reqs if r.get("e2e_tok_s")]
    acc = [r["accept_length"] for r in reqs if r.get("accept_length")]
    return {"requests": reqs,
            "tok_s": round(statistics.median(dec), 2) if dec else None,
            "e2e_tok_s": round(statistics.median(e2e), 2) if e2e else None,
            "ttft_s": round(statistics.median([r["ttft_s"] for r in reqs if r.get("ttft_s") is not None]), 4)
            if any(r.get("ttft_s") is not None for r in reqs) else None,
            "accept_length": round(statistics.median(acc), 3) if acc else None}


def server_command(srv: dict, mode: dict, python: str) -> list[str]:
    subs = {"python": python, "model_path": _expand(srv["model_path"]), "tp": srv["tp"], "host": srv["host"],
            "port": srv["port"], "seed": srv["seed"]}
    fmt = lambda a: _expand(str(a).format(**subs))  # noqa: E731
    return [fmt(a) for a in srv["command"]] + [fmt(a) for a in srv["launch_args"]] + [fmt(a) for a in mode["args"]]


def run_server_mode(srv: dict, mode: dict, report_dir: Path, base_env: dict, python: str) -> dict:
    name = mode["name"]
    out: dict = {"mode": name}
    host, port = srv["host"], int(srv["port"])
    if port_in_use(host, port):
        out.update(status="fail", error=f"port {host}:{port} already in use before launch (a server still "
                                        "running?); stop it or change server.port")
        return out
    env = dict(base_env)
    env.update({k: str(v) for k, v in srv.get("env", {}).items()})
    env.update({k: str(v) for k, v in mode.get("env", {}).items()})
    vp = report_dir / f"verify_profile-{name}.jsonl"
    with contextlib.suppress(FileNotFoundError):
        vp.unlink()
    # P4's verify profile is switched on per mode (SGLANG_VERIFY_PROFILE=1 in the mode's env);
    # the file always goes to the report folder
    env["SGLANG_VERIFY_PROFILE_FILE"] = str(vp)
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = server_command(srv, mode, python)
    out["command"] = cmd
    log = report_dir / f"server-{name}.log"
    out["log"] = log.name
    base_url = f"http://{host}:{port}"
    t0 = time.monotonic()
    mp = ManagedProcess(cmd, env, log)
    try:
        state, detail = wait_healthy(mp, base_url, float(srv["health_timeout_s"]), float(srv["poll_s"]))
        out["health"] = {"state": state, "detail": detail, "after_s": round(time.monotonic() - t0, 1)}
        if state != "healthy":
            out.update(status="fail", error=f"{state}: {detail}")
            return out
        try:
            out["benchmark"] = run_benchmark(host, port, srv["benchmark"], float(srv["request_timeout_s"]))
        except Exception as e:  # noqa: BLE001
            mp.snapshot()
            out.update(status="fail", error=f"benchmark failed: {type(e).__name__}: {e}; "
                                            f"server alive: {mp.poll() is None}")
            return out
        code, body = http_get(base_url + "/get_server_info", timeout=30)
        if code == 200:
            with contextlib.suppress(ValueError):
                info = json.loads(body)
                acc = _find_key(info, "avg_spec_accept_length")
                out["server_info_accept_length"] = acc
                if out["benchmark"].get("accept_length") is None and acc is not None:
                    out["benchmark"]["accept_length"] = acc
        mp.snapshot()
        out["status"] = "ok"
        return out
    finally:
        survivors = mp.stop(float(srv["stop_grace_s"]))
        out["tracked_pids"] = sorted(mp.seen)
        out["survivors"] = survivors
        if survivors:
            out["status"] = "fail"
            out["error"] = (out.get("error", "") + f"; processes {survivors} survived the stop").lstrip("; ")
        out["verify_profile"] = read_verify_profile(vp)


def tier_server(prof: dict, project: Path, report_dir: Path, base_env: dict) -> TierResult:
    tr = TierResult("server")
    srv = prof.get("server")
    if not srv:
        tr.status = "cannot_run"
        tr.summary = f"profile {prof.get('_path') or '(none)'} has no [server] section"
        return tr
    python = _expand(srv["python"] or sys.executable)
    env = dict(base_env)
    modes = []
    for mode in srv["modes"]:
        modes.append(run_server_mode(srv, mode, report_dir, env, python))
    base = srv["baselines"]
    tol = float(base.get("tolerance", 0.05))
    ref = base.get("no_spec_tok_s")
    floor = ref * (1 - tol) if ref else None
    no_spec = next((m for m in modes if m["mode"] == srv["modes"][0]["name"]), None)
    md = [f"Baseline from the profile: {ref} tok/s without speculation (tolerance {tol:.0%}).", "",
          "| mode | status | tok/s (decode, median) | e2e tok/s | accept length | verify ms (P4) | break-even accept | vs baseline |",
          "|---|---|---|---|---|---|---|---|"]
    for cfg, m in zip(srv["modes"], modes):
        b = m.get("benchmark") or {}
        tok = b.get("tok_s")
        vp = m.get("verify_profile") or {}
        last = vp.get("last") or {}
        vms = last.get("verify_ms")
        if isinstance(vms, dict):
            vms = vms.get("median", vms.get("p50"))
        if vms is None:
            vms = last.get("verify_ms_median")
        verdict = "—"
        if m.get("status") != "ok":
            tr.fail(f"mode {m['mode']}: {m.get('error')}")
            verdict = "failed"
        elif tok is None:
            tr.fail(f"mode {m['mode']}: no tok/s measured")
        elif floor is not None:
            pays = tok >= floor if m is no_spec else tok > ref
            m["beats_baseline"] = pays
            verdict = (f"{tok / ref:.2f}x of {ref}")
            if m is not no_spec:
                verdict += " — speculation PAYS" if pays else " — speculation does NOT pay"
            if not pays and cfg.get("gate", True):
                tr.fail(f"mode {m['mode']}: {tok} tok/s " + (f"below {floor:.1f} (baseline {ref} - {tol:.0%})"
                                                            if m is no_spec else f"does not beat the {ref} tok/s baseline"))
        md.append(f"| {m['mode']} | {m.get('status')} | {_fmt(tok)} | {_fmt(b.get('e2e_tok_s'))} | "
                  f"{_fmt(b.get('accept_length'), 2)} | {_fmt(vms, 2)} | "
                  f"{_fmt(vp.get('break_even_accept_length'), 2)} | {verdict} |")
    if no_spec and no_spec.get("benchmark") and len(modes) > 1:
        t0 = no_spec["benchmark"].get("tok_s")
        for m in modes[1:]:
            t1 = (m.get("benchmark") or {}).get("tok_s")
            if t0 and t1:
                m["speedup_vs_no_spec_this_run"] = round(t1 / t0, 3)
                md.append(f"\n{m['mode']} vs {no_spec['mode']} in this run: {t1 / t0:.2f}x")
    md += ["", "Commands and logs:"] + [f"- {m['mode']}: `{shlex.join(m.get('command', []))}` "
                                         f"(log `{m.get('log')}`, tracked pids {len(m.get('tracked_pids', []))}, "
                                         f"survivors {m.get('survivors')})" for m in modes]
    tr.data["modes"] = modes
    tr.md = md
    if tr.status != "fail":
        tr.status = "pass"
    tr.summary = "; ".join(f"{m['mode']}: {_fmt((m.get('benchmark') or {}).get('tok_s'))} tok/s"
                           + ("" if m.get("status") == "ok" else " (failed)") for m in modes)
    return tr


# =========================================================================== entry


def run_regress(tier: str = "all", profile: str | None = None, report: str | None = None,
                project: str | None = None, baseline: str | None = None, argv: list[str] | None = None,
                stress: int | None = None) -> dict:
    if tier not in (*TIERS, "all"):
        raise _usage(f"unknown tier {tier!r}; choose cpu, kernel, server or all")
    proj = Path(project).resolve() if project else find_project_root()
    prof_path = resolve_profile_path(profile, proj) if profile else None
    prof = load_profile(prof_path)
    started = datetime.datetime.now(datetime.timezone.utc)
    report_dir = Path(report) if report else Path.cwd() / f"regress-{started.strftime('%Y%m%d-%H%M%S')}"
    report_dir = report_dir.resolve()
    report_dir.mkdir(parents=True, exist_ok=True)
    if baseline and not Path(baseline).is_file():
        raise _usage(f"--baseline {baseline}: no such file (give a previous report.json)")
    base_env = dict(os.environ)
    base_env.update({k: str(v) for k, v in prof["env"].items()})
    wanted = list(TIERS) if tier == "all" else [tier]
    results = []
    for t in TIERS:
        if t not in wanted:
            continue
        if t == "cpu":
            results.append(tier_cpu(prof, proj, report_dir, base_env))
        elif t == "kernel":
            results.append(tier_kernel(prof, proj, report_dir, base_env, Path(baseline) if baseline else None,
                                       stress=stress))
        else:
            results.append(tier_server(prof, proj, report_dir, base_env))
    if any(r.status == "fail" for r in results):
        status, code = "fail", EXIT_FAIL
    elif any(r.status == "pass" for r in results) and (tier == "all" or results[0].status == "pass"):
        status, code = "pass", EXIT_PASS
    else:
        status, code = "cannot_run", EXIT_CANNOT_RUN
    doc = {"schema": "sglpatch.regress/1", "status": status, "exit_code": code,
           "command": shlex.join(argv) if argv else f"sglpatch regress --tier {tier}",
           "cwd": os.getcwd(), "started_utc": started.isoformat(timespec="seconds"),
           "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "profile": str(prof_path) if prof_path else None, "target": prof["target"],
           "profile_env": prof["env"], "project": str(proj)}
    write_report(report_dir, doc, results)
    return {"status": status, "exit_code": code, "report_dir": str(report_dir),
            "tiers": [(r.name, r.status, r.summary, r.failures) for r in results]}


def main(argv: list[str] | None = None) -> int:
    """`python -m sglpatch.regress ...` without the sglpatch CLI (for the GPU box)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from sglpatch.cli import main as cli_main
    except ImportError:  # a GPU box with only this package's files, no CLI dependencies
        cli_main = None
    if cli_main is not None:
        return cli_main(["regress", *args])
    import argparse

    p = argparse.ArgumentParser(prog="python -m sglpatch.regress")
    p.add_argument("--tier", default="all")
    for flag in ("--profile", "--report", "--baseline", "--project"):
        p.add_argument(flag)
    p.add_argument("--stress", type=int, nargs="?", const=-1, default=None, metavar="N")
    a = p.parse_args(args)
    try:
        res = run_regress(a.tier, a.profile, a.report, a.project, a.baseline, ["python", "-m", "sglpatch.regress", *args],
                          stress=a.stress)
    except SglpatchError as e:
        print(f"sglpatch: error: {e}", file=sys.stderr)
        return e.exit_code
    for name, status, summary, failures in res["tiers"]:
        print(f"tier {name}: {status}: {summary}", *[f"  - {f}" for f in failures[:20]], sep="\n")
    print(f"regress: {res['status']} (exit {res['exit_code']}); report: {res['report_dir']}/report.md")
    return res["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
