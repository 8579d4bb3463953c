"""Tier kernel: allreduce latency per backend (kernel_bench.py under torchrun), the crossover
with NCCL, a comparison with an earlier report, and --stress (every result compared exactly
with NCCL)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from sglpatch.gpu.procs import ManagedProcess, run_step, tail
from sglpatch.gpu.profiles import expand, usage_error
from sglpatch.gpu.report import TierResult

KERNEL_BENCH = Path(__file__).with_name("kernel_bench.py")


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
    python = expand(k["python"] or sys.executable)
    env = dict(base_env)
    env.update({kk: str(v) for kk, v in k.get("env", {}).items()})
    if stress is not None and stress < 0:
        stress = int(k["stress_iterations"])
    cpu_test = k.get("device") == "cpu"
    if cpu_test:
        if not stress:
            raise usage_error('[kernel] device = "cpu" runs only the stress launch: give --stress')
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
    from sglpatch.gpu.plot import plot_kernel

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
