"""PCIe-IPC seed against tuned, per served shape (issue 36).

P5 serves flashinfer's PCIe-IPC allreduce with tune_batches = exactly the row counts the server
captures and the SEED launch configurations (SGLANG_PCIE_IPC_TUNE=seed, the default); tuning is a
deliberate step (`python -m sglang.srt.pcie_ipc_tune`, then
SGLANG_PCIE_IPC_TUNE=cache).  The kernel tier measures `pcie_ipc` that way, and with
`[kernel] pcie_ipc_tune = true` also `pcie_ipc_tuned` (the same workspace after ws.tune) in a launch
of its own, seed leg first, under pinned clocks when `[kernel] pin_clocks_mhz` says so.  This module
holds the profile keys, that launch's clocks, and the table + verdict: for each served row count
seed us, tuned us, tuned/seed (graph-mode medians, as decode runs), and whether tuning is worth
keeping."""

from __future__ import annotations

import contextlib
import subprocess

from sglpatch.gpu.shared.profile import usage_error

SEED, TUNED = "pcie_ipc", "pcie_ipc_tuned"
MODE = "graph"
STEP = "python -m sglang.srt.pcie_ipc_tune"


def settings(k: dict) -> dict:
    """The profile's PCIe-IPC keys, checked: served rows (`pcie_ipc_rows`, else one row count,
    `pcie_ipc_max_rows`), whether the tuned leg runs, the clocks to pin for it."""
    rows, tune, mhz = k.get("pcie_ipc_rows"), k.get("pcie_ipc_tune", False), k.get("pin_clocks_mhz")
    if rows is not None and (not isinstance(rows, list) or not rows
                             or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in rows)):
        raise usage_error(f"[kernel] pcie_ipc_rows must be a list of positive row counts (the server's buckets), "
                          f"not {rows!r}")
    if not isinstance(tune, bool):
        raise usage_error(f"[kernel] pcie_ipc_tune must be true or false, not {tune!r}")
    if mhz is not None and (not isinstance(mhz, int) or isinstance(mhz, bool) or mhz <= 0):
        raise usage_error(f"[kernel] pin_clocks_mhz must be a positive number of MHz, not {mhz!r}")
    if TUNED in k.get("backends", []):
        raise usage_error(f"[kernel] backends: {TUNED} runs by `pcie_ipc_tune = true` (in a launch of its own, "
                          f"after the seed leg), not from the list")
    max_rows = int(k.get("pcie_ipc_max_rows", 64))
    return {"rows": sorted(set(rows)) if rows else [max_rows], "rows_given": rows is not None,
            "tune": tune and SEED in k.get("backends", []), "asked": tune, "pin_mhz": mhz}


def _smi(cmd: list[str]) -> tuple[int, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, f"{type(e).__name__}: {e}"
    return r.returncode, ((r.stderr or r.stdout).strip().splitlines() or [""])[0]


def gpu_ids(env: dict, ws: int) -> str:
    vis = [x.strip() for x in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if x.strip()]
    return ",".join(vis[:ws]) if vis and all(x.isdigit() for x in vis) else ",".join(map(str, range(ws)))


@contextlib.contextmanager
def clocks(k: dict, ws: int, env: dict):
    """Around the tuned leg: nothing unless `pin_clocks_mhz`; then nvidia-smi -lgc M,M before and
    -rgc after, in a finally (also when the launch hangs or dies).  Yields the record for the
    report: {"pinned", "line", "error" (the pin failed: no tuned leg), "reset_error"}."""
    mhz = k.get("pin_clocks_mhz")
    if not mhz:
        yield {"pinned": False, "line": "clocks were not pinned (no [kernel] pin_clocks_mhz): the tune ranked its "
               "candidates and both legs ran at the GPUs' own clocks"}
        return
    smi = [k.get("nvidia_smi") or "nvidia-smi", "-i", gpu_ids(env, ws)]
    rc, first = _smi(smi + ["-lgc", f"{mhz},{mhz}"])
    rec = {"pinned": rc == 0, "pin_cmd": smi + ["-lgc", f"{mhz},{mhz}"]}
    if rc:
        rec["error"] = f"not run: `{' '.join(rec['pin_cmd'])}` failed (exit {rc}: {first}); clocks were not pinned"
        rec["line"] = rec["error"]
    else:
        rec["line"] = (f"clocks pinned at {mhz} MHz (`{' '.join(rec['pin_cmd'])}`) for this launch, both legs; "
                       "reset after with -rgc")
    try:
        yield rec
    finally:
        rc, first = _smi(smi + ["-rgc"])
        if rc:
            rec["reset_error"] = f"`{' '.join(smi)} -rgc` failed (exit {rc}: {first}): the clocks may still be pinned"


def medians(rows: list[dict], backend: str, install: str) -> dict[int, float]:
    return {r["rows"]: r["median_us"] for r in rows if r["backend"] == backend and r.get("install", "A") == install
            and r["mode"] == MODE and r.get("status") == "ok"}


def table(rows: list[dict], install: str, served: list[int]) -> list[dict]:
    """One line per served row count: seed us, tuned us, tuned/seed (None where a side has no number)."""
    seed, tuned = medians(rows, SEED, install), medians(rows, TUNED, install)
    out = []
    for n in served:
        s, t = seed.get(n), tuned.get(n)
        out.append({"rows": n, "seed_us": s, "tuned_us": t, "tuned_over_seed": round(t / s, 3) if s and t else None})
    return out


def tune_step(ws: int, hidden: int, buckets: list[int], mhz: int | None) -> str:
    """P5's tuning step for exactly this workspace (P5's tune_command, its width = the widest bucket)."""
    return f"{STEP} --tp {ws} --hidden {hidden} --rows {','.join(map(str, buckets))} --pin-clocks {mhz or 'MHZ'}"


def verdict(tab: list[dict], tolerance: float, step: str) -> tuple[str | None, str | None]:
    """(verdict, why there is none).  Keep tuning when tuned beats seed by more than `tolerance` at
    any served shape; seed is enough when every served shape has both numbers and none does; no
    verdict when a side has no data (at all, or at a shape that would decide it)."""
    if not any(x["seed_us"] for x in tab) or not any(x["tuned_us"] for x in tab):
        side = "seed" if not any(x["seed_us"] for x in tab) else "tuned"
        return None, f"no verdict: the {side} leg has no data at the served rows"
    faster = [x for x in tab if x["seed_us"] and x["tuned_us"] and x["seed_us"] - x["tuned_us"] > tolerance * x["seed_us"]]
    if faster:
        at = ", ".join(f"{x['rows']} rows ({x['tuned_over_seed']:.3f})" for x in faster)
        return (f"keep: tuned is faster than seed by more than {tolerance:.0%} at {at}: run the tuning step "
                f"(`{step}`) and serve with SGLANG_PCIE_IPC_TUNE=cache"), None
    missing = [x["rows"] for x in tab if not (x["seed_us"] and x["tuned_us"])]
    if missing:
        return None, f"no verdict: no seed and tuned pair at rows {missing}, and none of the others decides it"
    return (f"seed is within tolerance ({tolerance:.0%}) at every served shape: no tuning needed "
            "(SGLANG_PCIE_IPC_TUNE=seed, the default)"), None


def compare(rows: list[dict], installs: list[dict], k: dict, ws: int) -> dict | None:
    """report.json's `pcie_ipc_tune`: per install that measured PCIe-IPC, the workspace it built,
    the table, the verdict (or why none), the clocks."""
    if SEED not in k.get("backends", []):
        return None
    s = settings(k)
    tol = float(k["tolerance"])
    out = {"asked": s["asked"], "tolerance": tol, "mode": MODE, "rows_given": s["rows_given"],
           "served_rows": s["rows"], "installs": []}
    for inst in installs:
        info = (inst.get("backend_info") or {}).get(SEED) or {}
        tinfo = (inst.get("backend_info") or {}).get(TUNED) or {}
        if not info and not any(r["backend"] == SEED and r["install"] == inst["key"] for r in rows):
            continue
        served = info.get("rows") or s["rows"]
        buckets = info.get("buckets") or served
        tab = table(rows, inst["key"], served)
        step = tune_step(ws, int(k["hidden"]), buckets, s["pin_mhz"])
        v, why = verdict(tab, tol, step)
        if v is None and not s["asked"]:
            why = "no verdict: the tuned leg was not asked for ([kernel] pcie_ipc_tune = false, the default)"
        elif v is None and TUNED in (inst.get("errors") or {}):
            why += f"; {TUNED}: {inst['errors'][TUNED]}"
        elif v is None and TUNED in (inst.get("absent") or {}):
            why += f"; {TUNED} absent: {inst['absent'][TUNED]}"
        out["installs"].append({"install": inst["key"], "label": inst.get("label", inst["key"]),
                                "how": info.get("how"), "buckets": info.get("buckets"), "max_numel": info.get("max_numel"),
                                "tuned_how": tinfo.get("how"), "table": tab, "verdict": v, "no_verdict": why,
                                "tuning_step": step, "clocks": inst.get("clocks") or {
                                    "pinned": False, "line": "clocks were not pinned (no tuned leg)"}})
    return out


def markdown(d: dict | None) -> list[str]:
    if not d:
        return []
    md = ["### PCIe-IPC: seed against tuned, per served shape", "",
          f"Served rows {d['served_rows']} " + ("(`[kernel] pcie_ipc_rows`, the server's buckets)" if d["rows_given"]
                                               else "(no `[kernel] pcie_ipc_rows`: one row count, `pcie_ipc_max_rows`; "
                                               "copy the buckets from the server's start-up line)")
          + f"; {MODE}-mode medians; verdict: tuned faster than seed by more than the profile's tolerance "
          f"({d['tolerance']:.0%}) at any served shape keeps tuning.", ""]
    if not d["installs"]:
        return md + ["PCIe-IPC measured nowhere (absent from every install).", ""]
    for x in d["installs"]:
        md += [f"**{x['label']}**: {x['how'] or '?'}", ""]
        if x.get("tuned_how"):
            md += [f"Tuned leg: {x['tuned_how']}", ""]
        md += ["| rows | seed us | tuned us | tuned/seed |", "|---|---|---|---|"]
        for r in x["table"]:
            cell = [f"{v:.1f}" if v else "—" for v in (r["seed_us"], r["tuned_us"])]
            ratio = f"{r['tuned_over_seed']:.3f}" if r["tuned_over_seed"] is not None else "—"
            md.append(f"| {r['rows']} | {cell[0]} | {cell[1]} | {ratio} |")
        c = x["clocks"]
        md += ["", f"**Verdict: {x['verdict']}**" if x["verdict"] else f"{x['no_verdict']}.",
               "", f"Clocks: {c['line']}" + (f"; **{c['reset_error']}**" if c.get("reset_error") else ""), ""]
    return md

