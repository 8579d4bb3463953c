"""The latency launches of the kernel tier: which torchrun commands run (per interpreter, with
which env), running them (a hung or dead backend is named and the remaining backends are
relaunched), and merging every launch's rows into one list, each row labelled with its install.

Launches per interpreter (`--ab A,B`, default `[kernel] python`):

- `main`: every backend of `[kernel] backends`, under `[env]` + `[kernel.env]` (NCCL as served);
- first interpreter only: `p2p_off` (NCCL with NCCL_P2P_DISABLE=1) and `default_env` (NCCL with
  every NCCL_* variable of the profile removed, also inside the worker in case a sitecustomize
  set them again: the user's tuning against NCCL's defaults);
- `pcie_ipc` (each interpreter, only with `[kernel] pcie_ipc_tune = true`): PCIe-IPC's seed leg
  (moved out of `main`), then `pcie_ipc_tuned` (the same workspace after ws.tune), in one fresh
  process at the same clocks (kernel/pcie_tune.py); its failures are that backend's, never the tier's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

from sglpatch.gpu.kernel import pcie_tune
from sglpatch.gpu.shared.step_runner import run_step, tail
from sglpatch.gpu.shared.profile import expand, usage_error

SRC_ROOT = Path(__file__).resolve().parents[3]  # the folder holding the sglpatch package
HANG_LINE = re.compile(r"\[kernel_bench\] HANG .*")
QUICK = {"samples": 8, "inner": 4, "warmup": 2}
MAX_RELAUNCHES = 4


def interpreters(k: dict, python_arg: str | None) -> list[dict]:
    """[{"key": "A", "python": path}, ...] from --ab A,B (regress hands it over as the plan's python) or [kernel] python."""
    raw = [p.strip() for p in python_arg.split(",") if p.strip()] if python_arg else [k.get("python") or sys.executable]
    out = []
    for i, p in enumerate(raw):
        path = expand(p)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise usage_error(f"--python: {p} is not an executable interpreter")
        out.append({"key": chr(ord("A") + i), "python": path})
    if len({x["python"] for x in out}) != len(out):
        raise usage_error(f"--python names the same interpreter twice: {python_arg}")
    return out


def missing_default(k: dict) -> str | None:
    """Why the profile's own `[kernel] python` cannot run here (not installed on this box), or None."""
    p = k.get("python")
    if not p or (os.path.isfile(expand(p)) and os.access(expand(p), os.X_OK)):
        return None
    return (f"the profile's [kernel] python {p} is not on this machine: give --python PATH (a Python with torch "
            f"and sglang) or set [kernel] python in the profile")


def quick_sizes(prof: dict) -> list[int]:
    """--quick: the decode and verify rows of the decision table (batch, batch x draft tokens)."""
    d = prof["kernel"].get("decision") or {}
    bs, dt = int(d.get("batch_size", 1)), int(d.get("draft_tokens", 3))
    return sorted({bs, bs * dt})


def worker_env(env: dict) -> dict:
    """The worker imports sglpatch.gpu.kernel.microbench from this checkout (stdlib + torch only)."""
    out = dict(env)
    out["PYTHONPATH"] = str(SRC_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def profile_nccl_vars(prof: dict) -> list[str]:
    return sorted({n for n in {**prof.get("env", {}), **prof["kernel"].get("env", {})} if n.startswith("NCCL_")})


def pcie_ipc_args(k: dict) -> list[str]:
    """PCIe-IPC's served rows (the server's buckets: P5's width is the widest), else its width in rows."""
    if k.get("pcie_ipc_rows"):
        return ["--pcie-ipc-rows", ",".join(map(str, k["pcie_ipc_rows"]))]
    return ["--pcie-ipc-max-rows", str(k.get("pcie_ipc_max_rows", 64))]


def replay_args(prof: dict, quick: bool) -> list[str]:
    """The back-to-back replay check (microbench/replay.py): N replays per backend and size; --quick
    at the decision sizes."""
    k = prof["kernel"]
    n = int(k.get("replay_iterations") or 0)
    sizes = quick_sizes(prof) if quick else (k.get("replay_sizes") or k["stress_sizes"])
    return ["--replay", str(n), "--replay-sizes", ",".join(map(str, sizes))]


def common_args(prof: dict, quick: bool) -> list[str]:
    k = prof["kernel"]
    sizes = quick_sizes(prof) if quick else k["sizes"]
    samples, inner = (min(k["samples"], QUICK["samples"]), min(k["inner"], QUICK["inner"])) if quick else \
        (k["samples"], k["inner"])
    out = ["--sizes", ",".join(map(str, sizes)), "--hidden", str(k["hidden"]), "--samples", str(samples),
           "--inner", str(inner), "--step-timeout", str(k.get("step_timeout_s", 600)),
           "--b12x-max-bytes", str(k.get("b12x_max_bytes", 8 * 1024 * 1024)),
           "--stress-sizes", ",".join(map(str, k["stress_sizes"])), *replay_args(prof, quick)]
    out += pcie_ipc_args(k)
    if quick:
        out += ["--warmup", str(QUICK["warmup"])]
    if k.get("device") == "cpu":
        out += ["--device", "cpu"]
    return out


def torchrun_bench(python: str, world_size: int, report_dir: Path) -> list[str]:
    """torchrun starting the kernel bench on world_size ranks of one host, up to the bench's own
    arguments; torchrun's log folder in the report's scratch (without one it makes a
    torchelastic_* folder in TMPDIR per launch and leaves it there)."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
            "--log-dir", str(Path(report_dir) / "scratch" / "torchelastic"), "-m", "sglpatch.gpu.kernel.bench"]


def kernel_launches(prof: dict, world_size: int, report_dir: Path, interp: dict, first: bool,
                    quick: bool = False) -> list[dict]:
    k = prof["kernel"]
    py, key = interp["python"], interp["key"]
    torchrun = [*torchrun_bench(py, world_size, report_dir), *common_args(prof, quick)]
    tag = "" if key == "A" else f"-{key}"
    tune = pcie_tune.settings(k)["tune"]
    main = [b for b in k["backends"] if not (tune and b == pcie_tune.SEED)]
    launches = [{"name": f"main{tag}", "env": {}, "unset": [], "backends": main, "suffix": "", "cmd": torchrun}]
    if first and k.get("p2p_disabled_run", True) and "nccl" in k["backends"]:
        launches.append({"name": "p2p_off", "env": {"NCCL_P2P_DISABLE": "1"}, "unset": [], "backends": ["nccl"],
                         "suffix": "_p2p_off", "cmd": torchrun})
    nccl_vars = profile_nccl_vars(prof)
    if first and k.get("default_env_run", True) and "nccl" in k["backends"] and nccl_vars:
        launches.append({"name": "default_env", "env": {}, "unset": nccl_vars, "backends": ["nccl"],
                         "suffix": "_default_env", "cmd": torchrun})
    if tune:  # seed first in a fresh process (flashinfer's autotuner keeps winners in memory), same clocks
        launches.append({"name": f"pcie_ipc{tag}", "env": {}, "unset": [], "backends": [pcie_tune.SEED, pcie_tune.TUNED],
                         "suffix": "", "cmd": torchrun, "soft": pcie_tune.TUNED, "pin": True})
    launches = [L for L in launches if L["backends"]]
    for L in launches:
        L["install"] = key
        L["out"] = report_dir / f"kernel-{L['name']}.json"
    return launches


def _attempt_cmd(L: dict, backends: list[str], out: Path, scratch: Path) -> list[str]:
    cmd = L["cmd"] + ["--backends", ",".join(backends), "--out", str(out), "--scratch-dir", str(scratch)]
    if L["suffix"]:
        cmd += ["--name-suffix", L["suffix"]]
    if L["unset"]:
        cmd += ["--unset-env", ",".join(L["unset"])]
    return cmd


def run_launch(L: dict, env: dict, timeout_s: float, report_dir: Path, project: Path, fail) -> dict:
    """Run one launch; when it hangs or dies inside a backend, name that backend (an error, with
    the worker's HANG line when there is one) and relaunch the backends not yet measured.
    Returns {"doc": merged worker doc or None, "attempts": [...]}.  `fail(msg)` records a failure.
    A `soft` launch (the tuned leg's) fails no tier: its exit without a result or after it is one
    error line of its backends (`soft`, or those it had not measured); survivors still fail."""
    lenv = worker_env({kk: v for kk, v in env.items() if kk not in L["unset"]})
    lenv.update(L["env"])
    scratch = report_dir / "scratch"
    scratch.mkdir(exist_ok=True)
    todo, merged, attempts = list(L["backends"]), None, []

    def launch_fail(msg: str, labels: list[str]) -> None:
        nonlocal merged
        if not L.get("soft"):
            return fail(msg)
        merged = merged or {"results": [], "absent": {}, "errors": {}, "done": [], "complete": False}
        for b in labels:
            merged.setdefault("errors", {}).setdefault(b, msg)
    for n in range(1 + MAX_RELAUNCHES):
        stem = f"kernel-{L['name']}" + (f"-r{n + 1}" if n else "")
        out, log = report_dir / f"{stem}.json", report_dir / f"{stem}.log"
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        res = run_step(_attempt_cmd(L, todo, out, scratch), lenv, log, timeout_s, cwd=str(project))
        res.update(env_added=L["env"], env_removed=L["unset"], backends=todo)
        attempts.append(res)
        if res["survivors"]:
            fail(f"launch {L['name']}: processes {res['survivors']} survived the stop")
        doc = json.loads(out.read_text()) if out.exists() else None
        if doc is not None:
            merged = doc if merged is None else _merge_docs(merged, doc)
        why = (f"ran past {timeout_s:.0f} s and was killed" if res["timed_out"] else f"exited {res['rc']}")
        if doc is not None and doc.get("complete"):
            if res["rc"] != 0 or res["timed_out"]:
                launch_fail(f"launch {L['name']} {why} after writing its result (log {log.name}): {last_word(log)}",
                            [L.get("soft", "")])
            break
        hang = None
        with contextlib.suppress(OSError):
            hang = next((m.group(0) for m in HANG_LINE.finditer(log.read_text(errors="replace"))), None)
        stuck = (doc or {}).get("in_progress")
        if stuck is None:
            launch_fail(f"launch {L['name']} {why} without a result (log {log.name}): {hang or last_word(log)}",
                        [b + L["suffix"] for b in todo if b + L["suffix"] not in (doc or {}).get("done", [])])
            break
        label = stuck
        merged.setdefault("errors", {})[label] = f"launch {why} in this backend (log {log.name}): {hang or last_word(log)}"
        merged.setdefault("hung", []).append(label)
        done = set(doc.get("done", [])) | {label}
        todo = [b for b in todo if b + L["suffix"] not in done]
        if not todo:
            break
    return {"doc": merged, "attempts": attempts}


def last_word(log: Path) -> str:
    """The log's last line that says something (torchrun ends a failure with a rule of '='): e.g.
    "traceback : Signal 6 (SIGABRT) received by PID 11896"."""
    lines = [ln.strip() for ln in tail(log, 40).splitlines()]
    return next((ln for ln in reversed(lines) if ln.strip("=-") and ln), "")


def _merge_docs(a: dict, b: dict) -> dict:
    out = dict(a)
    out["results"] = a.get("results", []) + b.get("results", [])
    out["replay"] = a.get("replay", []) + b.get("replay", [])
    for key in ("absent", "errors", "backend_info"):
        out[key] = {**a.get(key, {}), **b.get(key, {})}
    out["done"] = a.get("done", []) + b.get("done", [])
    out["complete"] = b.get("complete", False)
    return out


def install_label(key: str, python: str, hw: dict) -> str:
    """"A: sglang 0.5.9 + P5 (~/ml-env)" from the worker's versions (+ P5: it carries the PCIe-IPC backport)."""
    v = (hw or {}).get("versions") or {}
    home = os.path.expanduser("~")
    venv = str(Path(python).parent.parent)
    venv = "~" + venv[len(home):] if venv.startswith(home) else venv
    what = f"sglang {v['sglang']}" if v.get("sglang") else f"torch {v.get('torch', (hw or {}).get('torch', '?'))}"
    what += " + P5" if v.get("sglang_pcie_ipc") == "P5" else ""
    return f"{key}: {what} ({venv})"
