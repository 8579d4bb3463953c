"""Tier kernel: allreduce latency per backend and install (kernel_bench under torchrun, in each
interpreter of --ab A,B), the topology, the crossover with NCCL, the decision table (which
allreduce, and what EAGLE-3 would give: kernel/decision.py), a comparison with an earlier report,
and --stress (every result compared exactly with NCCL)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

from sglpatch.gpu.kernel import decision, eligibility, pcie_tune
from sglpatch.gpu.kernel import launch as kernel_launch
from sglpatch.gpu.shared import topology
from sglpatch.gpu.kernel.launch import HANG_LINE, worker_env
from sglpatch.gpu.kernel.report_md import hardware_line, kernel_markdown, stress_markdown  # noqa: F401 — re-exported
from sglpatch.gpu.shared.plan import Tier
from sglpatch.gpu.shared.step_runner import ManagedProcess, tail
from sglpatch.gpu.shared.profile import usage_error
from sglpatch.gpu.shared.report import TierResult

KERNEL_BENCH = Path(__file__).with_name("bench.py")  # the worker, run as -m sglpatch.gpu.kernel.bench


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


def stress_launch(prof: dict, world_size: int, report_dir: Path, python: str, iterations: int) -> dict:
    """The --stress launch: kernel_bench --stress N over the profile's stress backends."""
    k = prof["kernel"]
    out = report_dir / "kernel-stress.json"
    cmd = [*kernel_launch.torchrun_bench(python, world_size, report_dir),
           "--stress", str(iterations), "--stress-sizes", ",".join(map(str, k["stress_sizes"])),
           "--hidden", str(k["hidden"]), "--backends", ",".join(k["stress_backends"]),
           "--modes", ",".join(k["stress_modes"]), "--stress-step-timeout", str(k["stress_step_timeout_s"]),
           *kernel_launch.pcie_ipc_args(k), "--out", str(out)]
    if k.get("device") == "cpu":
        cmd += ["--device", "cpu"]
    legs = max(1, len(k["stress_backends"]) * len(k["stress_modes"]))
    # a backstop only: a hang is caught per step (worker watchdog, then the log-silence limit below)
    total = float(k["stress_timeout_s"] or 900 + iterations * legs * 0.002)
    return {"name": "stress", "env": {}, "out": out, "cmd": cmd, "timeout_s": total,
            "stall_s": float(k["stress_step_timeout_s"]) + 60.0}


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
    lenv = worker_env(env)
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


def topology_block(k: dict) -> dict:
    """The topology section of the report (shared/topology.py): class, NUMA per GPU, P2P, raw texts."""
    topo, raw = topology.read(k.get("nvidia_smi") or "nvidia-smi")
    return topology.report(topo, raw)


def world_size(k: dict, python: str, env: dict, tr: TierResult) -> int | None:
    if k.get("device") == "cpu":
        return int(k["world_size"] or 2)
    ngpu, how = count_gpus(python, env)
    ws = int(k["world_size"] or ngpu)
    if ngpu < 2 or ws < 2:
        tr.status, tr.summary = "cannot_run", f"needs >= 2 CUDA GPUs, found {ngpu} ({how})"
        return None
    if ws > ngpu:
        tr.status, tr.summary = "cannot_run", f"profile wants world size {ws}, only {ngpu} GPUs visible"
        return None
    return ws


def run_install(prof: dict, ws: int, report_dir: Path, project: Path, env: dict, interp: dict, first: bool,
                quick: bool, tr: TierResult) -> tuple[dict, list[dict]]:
    """Every launch of one interpreter: (its install record, its rows labelled with its key)."""
    k = prof["kernel"]
    inst = {"key": interp["key"], "python": interp["python"], "hardware": None, "absent": {}, "errors": {},
            "hung": [], "launches": [], "backend_info": {}, "replay": []}
    rows: list[dict] = []
    for L in kernel_launch.kernel_launches(prof, ws, report_dir, interp, first, quick):
        with pcie_tune.clocks(k, ws, env) if L.get("pin") else contextlib.nullcontext() as clk:
            if clk and clk.get("error"):  # pinning was asked and failed: no tuned leg, one line
                L = {**L, "backends": [b for b in L["backends"] if b != pcie_tune.TUNED]}
                inst["errors"][pcie_tune.TUNED] = clk["error"]
            r = kernel_launch.run_launch(L, env, float(k["timeout_s"]), report_dir, project, tr.fail)
        if clk:
            inst["clocks"] = clk
            if clk.get("reset_error"):
                tr.fail(f"launch {L['name']}: {clk['reset_error']}; reset them: nvidia-smi -rgc")
        inst["launches"] += r["attempts"]
        doc = r["doc"]
        if doc is None:
            continue
        if inst["hardware"] is None or L["name"].startswith("main"):
            inst["hardware"] = doc.get("hardware") or inst["hardware"]
        if L["unset"]:
            inst["default_env"] = {"removed": L["unset"], "still_set_inside": doc.get("env_unset") or {}}
        for row in doc.get("results", []):
            rows.append({**row, "install": interp["key"]})
        inst["replay"] += [{**row, "install": interp["key"]} for row in doc.get("replay", [])]
        inst["absent"].update(doc.get("absent", {}))
        inst["errors"].update(doc.get("errors", {}))
        inst["backend_info"].update(doc.get("backend_info", {}))
        inst["hung"] += doc.get("hung", [])
    inst["label"] = kernel_launch.install_label(interp["key"], interp["python"], inst["hardware"])
    return inst, rows


NCCL_LABELS = ("nccl", "nccl_p2p_off", "nccl_default_env")


def judge(tr: TierResult, k: dict, installs: list[dict], rows: list[dict], cpu_test: bool) -> None:
    """Failures: a wrong result or an error row anywhere; a required backend (first install) that
    did not run, errored or hung; NCCL failing to set up; a back-to-back replay that differed from
    NCCL or raised (microbench/replay.py).  Another backend that errors or hangs
    in its set-up is reported, not a failure (an optional candidate, e.g. symm_mem without P2P
    atomics)."""
    required = set(k.get("required_backends", []))
    for inst in installs:
        tag = "" if len(installs) == 1 else f" [{inst['label']}]"
        for b, msg in inst["errors"].items():
            if b in NCCL_LABELS or (b in required and inst is installs[0]):
                tr.fail(f"backend {b}{tag} " + ("HUNG" if b in inst["hung"] else "failed to set up") + f": {msg}")
    present = {r["backend"] for r in rows if r["install"] == installs[0]["key"]}
    for b in ([] if cpu_test else sorted(required)):
        if b not in present and b not in installs[0]["errors"]:
            tr.fail(f"required backend {b} did not run: {installs[0]['absent'].get(b, 'no result')}")
    for (_b, inst), why in eligibility.replay_failures([r for i in installs for r in i.get("replay", [])]).items():
        tag = "" if len(installs) == 1 else f" [{inst}]"
        tr.fail(f"REPLAY {'MISMATCH' if 'differ from NCCL' in why else 'ERROR'}{tag}: {why}")
    for r in rows:
        tag = "" if len(installs) == 1 else f" [{r['install']}]"
        if r["status"] == "wrong":
            tr.fail(f"WRONG RESULT {r['backend']}{tag} {r['mode']} [{r['rows']},{r['hidden']}]: {r.get('detail')}")
        elif r["status"] == "error":
            tr.fail(f"{r['backend']}{tag} {r['mode']} [{r['rows']},{r['hidden']}] raised: {r.get('detail')}")


class KernelTier(Tier):
    """Latency + correctness launches in each interpreter (--python "A[,B]", default [kernel]
    python); with --stress (iterations, -1 = the profile's stress_iterations) also the stress
    launch (first interpreter).  `[kernel] device = "cpu"` (tests) runs under gloo on CPU: the
    latency launches, or with --stress only the stress launch."""

    name = "kernel"

    def check(self) -> bool:
        plan, tr = self.plan, self.result
        k = self.k = plan.profile["kernel"]
        if not plan.python and (missing := kernel_launch.missing_default(k)):
            return self.cannot_run(missing)  # not a usage error: the user gave no --python
        self.interps = kernel_launch.interpreters(k, plan.python)
        self.cfg = decision.config(plan.profile)
        pcie_tune.settings(k)  # the PCIe-IPC keys: a bad one is a usage error before anything runs
        self.spec_base = decision.baseline_from_report(plan.with_profile) if plan.with_profile else None
        self.parity = eligibility.parity_from_report(plan.with_profile) if plan.with_profile else None
        if plan.with_profile and self.cfg is None:
            raise usage_error("--with-profile needs a [kernel.decision] table in the profile (layers, step, cycle)")
        self.env = dict(plan.base_env)
        self.env.update({kk: str(v) for kk, v in k.get("env", {}).items()})
        self.stress = int(k["stress_iterations"]) if plan.stress is not None and plan.stress < 0 else plan.stress
        self.cpu_test = k.get("device") == "cpu"
        self.ws = world_size(k, self.interps[0]["python"], self.env, tr)
        return self.ws is not None

    def run(self) -> None:
        plan, tr, k, ws = self.plan, self.result, self.k, self.ws
        latency = not (self.cpu_test and self.stress)
        tr.data.update({"topology": topology_block(k), "hidden": k["hidden"], "world_size": ws, "latency_run": latency,
                        "quick": plan.quick, "sizes": kernel_launch.quick_sizes(plan.profile) if plan.quick else k["sizes"]})
        installs, rows = [], []
        for i, interp in enumerate(self.interps if latency else []):
            inst, got = run_install(plan.profile, ws, plan.report_dir, plan.project, self.env, interp, i == 0,
                                    plan.quick, tr)
            installs.append(inst)
            rows += got
        first = installs[0] if installs else {"hardware": {}, "absent": {}, "errors": {}, "key": "A"}
        hw = first.get("hardware") or {}
        tr.data.update({"hardware": hw, "results": rows, "absent": first["absent"], "errors": first["errors"],
                        "installs": installs, "launches": [L for inst in installs for L in inst["launches"]],
                        "replay": [r for inst in installs for r in inst["replay"]]})
        if installs:
            judge(tr, k, installs, rows, self.cpu_test)
        if self.stress:
            tr.data["stress"] = run_stress_step(plan.profile, ws, plan.report_dir, self.interps[0]["python"], self.env,
                                                plan.project, self.stress, tr)
            tr.data["hardware"] = hw or tr.data["stress"].get("hardware") or {}
        tr.data["pcie_ipc_tune"] = pcie_tune.compare(rows, installs, k, ws) if installs else None
        first_rows = [r for r in rows if r["install"] == first["key"]]
        tr.data["crossover"] = {m: find_crossover(first_rows, m, k["hidden"]) for m in ("graph", "eager")}
        if self.cfg and rows:
            versions = {i["key"]: (i.get("hardware") or {}).get("versions") or {} for i in installs}
            tr.data["decision"] = decision.project(rows, self.cfg, self.spec_base, versions, self.parity,
                                                   eligibility.replay_failures(tr.data["replay"]))
        base_path = plan.baseline or (plan.project / k["baseline"] if k.get("baseline") else None)
        if base_path and Path(base_path).is_file():
            cmp = compare_kernel_baseline(first_rows, json.loads(Path(base_path).read_text()), tr.data["hardware"],
                                          k["tolerance"], k["abs_floor_us"])
            cmp["path"] = str(base_path)
            tr.data["baseline"] = cmp
            for reg in cmp["regressions"]:
                tr.fail(f"slower than baseline: {reg}")
        elif base_path:
            tr.data["baseline"] = {"path": str(base_path), "note": "baseline file not found; nothing compared"}
        self.installs, self.rows = installs, rows

    def report(self) -> TierResult:
        tr = self.result
        if "results" not in tr.data:
            return tr
        from sglpatch.gpu.shared.plot import plot_kernel

        rows = self.rows
        note = plot_kernel(tr.data, str(self.plan.report_dir / "kernel.png")) if rows else "plot skipped: no results"
        tr.data["plot"] = "kernel.png" if note is None else None
        tr.data["plot_note"] = note
        if tr.status != "fail":
            tr.status = "pass"
        tr.summary = summary(tr, self.installs, rows, self.ws, tr.data["hardware"], self.stress)
        tr.md = kernel_markdown(tr.data, self.plan.profile)
        return tr


def summary(tr: TierResult, installs: list[dict], rows: list[dict], ws: int, hw: dict, stress: int | None) -> str:
    if not tr.data["latency_run"]:
        out = f"cpu test mode, {ws} ranks (gloo), no latency launches; {len(tr.failures)} failures"
    else:
        ok = sum(1 for r in rows if r["status"] == "ok")
        absent = sorted(set.intersection(*(set(inst["absent"]) for inst in installs))) if installs else []
        out = (f"{ok} measurements ok on {ws}x {hw.get('gpu_name', '?')} from {len(installs)} install(s); "
               f"{len(tr.failures)} failures; absent{' from every install' if len(installs) > 1 else ''}: "
               f"{', '.join(absent) or 'none'}")
        d = tr.data.get("decision") or {}
        best = (d.get("candidates") or [None])[0]
        if best:
            a = f"{d['rank_accept_length']:g}"
            out += (f"; projected fastest {best['backend']} [{best['install']}]: {best['tok_s_no_spec']} tok/s "
                    f"no spec, EAGLE-3 {best['tok_s_eagle3'].get(a)} tok/s at accept {a} (a projection"
                    + ("; it does not hold here, see the warnings)" if d.get("warnings") else ")")
                    + f", eligible: {decision.ELIGIBLE[best.get('eligible')]}; eligible winner {d.get('winner')}")
    if stress:
        srows = tr.data["stress"].get("stress") or []
        out += (f"; stress {stress} x {len(srows)} backend/mode: "
                + (", ".join(f"{r['backend']} {r['mode']} {r.get('status')}" for r in srows) or "none ran"))
    return out
