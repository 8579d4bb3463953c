"""The decision table of the kernel tier: for each allreduce backend measured, its cost per decode
step and per verify pass of the profile's model, and the single-stream tok/s it projects without
speculation and with EAGLE-3.  A projection from measured kernel latencies; the server tier is
what confirms it.

The model is a difference, not a guess at compute (R reductions per forward pass):

    R        = layers x reductions_per_layer                      (61 x 2 = 122 for Kimi-K2.5)
    t_b(n)   = backend b's median latency of one [n, hidden] bf16 allreduce, CUDA-graph mode,
               measured at n or interpolated linearly between the two measured sizes around it
    step'    = step  - R x (t_served(bs)      - t_b(bs))      / 1000     ms, decode rows [bs, hidden]
    cycle'   = cycle - R x (t_served(bs x k)  - t_b(bs x k))  / 1000     ms, verify rows [bs x k, hidden]
    no speculation: 1000 / step' tok/s;  EAGLE-3 at accept length a: 1000 x a / cycle' tok/s
    break-even accept length: cycle' / step'

`served` is the backend that serves today (the profile's `served_backend`, NCCL under the profile's
`[env]`, in the first install).  The step and cycle are the profile's (12.2 ms = 82 tok/s, 30 ms)
or a server-tier report's (`--with-profile`: no_spec's median TPOT, P4's draft + verify + extend
ms).  Only the verify pass's reductions are projected (the 1-layer drafter's are left as measured).
A fused backend (allreduce + residual add + RMSNorm in one kernel) replaces an allreduce and the
add-RMSNorm after it, so its allreduce-equivalent time is t_fused - (t_nccl_add_rmsnorm - t_nccl).
"""

from __future__ import annotations

import json
from pathlib import Path

from sglpatch.gpu.kernel import eligibility
from sglpatch.gpu.shared.profile import usage_error
from sglpatch.gpu.shared.served import version_tuple

DEFAULTS = {"layers": 61, "reductions_per_layer": 2, "batch_size": 1, "draft_tokens": 3,
            "decode_step_ms": 12.2, "spec_cycle_ms": 30.0, "accept_lengths": [2.0, 2.5, 3.0],
            "rank_accept_length": 2.5, "served_backend": "nccl", "mode": "graph", "confirm": {}}
# what is not a candidate: the reference cost of the separate norm, the tests' backends
NOT_CANDIDATES = ("nccl_add_rmsnorm", "selftest_wrong", "selftest_hang")
NORM_REFERENCE = "nccl_add_rmsnorm"

SWITCHES = {
    "nccl": "NCCL, SGLang's fallback (no switch; the profile's [env] NCCL tuning)",
    "nccl_default_env": "NCCL without the profile's NCCL_* settings (drop them from sitecustomize.py)",
    "nccl_p2p_off": "NCCL_P2P_DISABLE=1",
    "custom_ar": "SGLANG_ENABLE_PCIE_CUSTOM_AR=1 (P2: 0.5.9 + this series; cap SGLANG_PCIE_CUSTOM_AR_MAX_BYTES)",
    "symm_mem": "--enable-torch-symm-mem",
    "mscclpp": "--enable-mscclpp",
    "flashinfer_fused": "--enable-flashinfer-allreduce-fusion (P1; flashinfer >= 0.6.17)",
    "pcie_ipc": "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 (0.5.9 + P5 with `scripts/apply.sh --with-flashinfer`, or sglang "
                ">= 0.5.22 natively: flashinfer >= 0.7.0 either way)",
    "pcie_ipc_tuned": "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 SGLANG_PCIE_IPC_TUNE=cache after P5's tuning step (python -m "
                      "sglang.srt.pcie_ipc_tune; the tier's PCIe-IPC section has it)",
    "b12x_oneshot": "SGLANG_ENABLE_B12X_ALLREDUCE=1 (P7, 0.5.9 line; SM120 only)",
    "b12x_fused": "SGLANG_ENABLE_B12X_ALLREDUCE=1 (P7, 0.5.9 line; SM120 only)",
    "b12x_twoshot": "none: P7 serves the one-shot kernel and its fused add+RMSNorm only",
}
B12X_SERVED = ("b12x_oneshot", "b12x_fused")  # what P7 serves under its one switch


def _b12x_switch(backend: str, v: dict) -> str:
    """P7's switch where the install's sglang reads it (versions' sglang_b12x, from its files); else
    what is missing: P7 on the 0.5.9 line, no patch at all on another line (0.5.23)."""
    ver = v.get("sglang")
    if v.get("sglang_b12x") == "P7":
        line = version_tuple(ver)[:3] == (0, 5, 9) or not ver
        return SWITCHES[backend] if line else f"SGLANG_ENABLE_B12X_ALLREDUCE=1 (P7 on sglang {ver}; SM120 only)"
    if not ver:
        return "none on this install (no sglang): SGLANG_ENABLE_B12X_ALLREDUCE=1 needs sglang 0.5.9 + P7"
    if version_tuple(ver)[:3] == (0, 5, 9):
        return (f"none on this install (sglang {ver} without P7): SGLANG_ENABLE_B12X_ALLREDUCE=1 needs 0.5.9 + P7 "
                "(`scripts/apply.sh --with-flashinfer`)")
    return (f"none on sglang {ver}: no patch serves flashinfer's b12x kernels on that line (P7, "
            "SGLANG_ENABLE_B12X_ALLREDUCE=1, is on the 0.5.9 line only)")


def switch(backend: str, versions: dict | None = None) -> str:
    """The switch that serves backend on the install whose worker reported versions (hardware
    versions: sglang, flashinfer-python, sglang_pcie_ipc = "P5" | "upstream" | absent, sglang_b12x =
    "P7" | absent); without versions (an older report) the generic text."""
    v = versions or {}
    if backend in B12X_SERVED and v:
        return _b12x_switch(backend, v)
    if backend != "pcie_ipc" or not v:
        return SWITCHES.get(backend, "?")
    fi = f"flashinfer {v.get('flashinfer-python', '?')}"
    if v.get("sglang_pcie_ipc") == "P5":
        return (f"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 on 0.5.9 + P5 (the series' backport; off by default; {fi}, "
                "from `scripts/apply.sh --with-flashinfer`)")
    if v.get("sglang_pcie_ipc") == "upstream":
        return (f"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 on sglang {v.get('sglang', '?')} natively ({fi}; on by "
                "[[server.version_env]] there)")
    return (f"none on this install (sglang {v.get('sglang', '?')}): SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 needs 0.5.9 + P5 "
            "(`scripts/apply.sh --with-flashinfer`) or sglang >= 0.5.22")


def config(prof: dict) -> dict | None:
    """`[kernel.decision]` over DEFAULTS, or None when the profile has no decision table."""
    d = prof["kernel"].get("decision")
    if d is None:
        return None
    cfg = {**DEFAULTS, **d, "hidden": int(prof["kernel"]["hidden"])}
    for key in ("layers", "reductions_per_layer", "batch_size", "draft_tokens"):
        if not isinstance(cfg[key], int) or cfg[key] <= 0:
            raise usage_error(f"[kernel.decision] {key} must be a positive integer, not {cfg[key]!r}")
    for key in ("decode_step_ms", "spec_cycle_ms"):
        if not isinstance(cfg[key], (int, float)) or cfg[key] <= 0:
            raise usage_error(f"[kernel.decision] {key} must be a positive number of ms, not {cfg[key]!r}")
    return cfg


def latency_at(points: dict[int, float], n: int) -> tuple[float, str] | None:
    """(us, how) at n rows from {rows: median us}: measured, or linear between the measured sizes
    around n; None outside the measured range (never extrapolated)."""
    if n in points:
        return points[n], "measured"
    lo = max((m for m in points if m < n), default=None)
    hi = min((m for m in points if m > n), default=None)
    if lo is None or hi is None:
        return None
    return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo), f"interpolated {lo}..{hi}"


def baseline_from_report(path: str | Path) -> dict:
    """{decode_step_ms, spec_cycle_ms, draft/verify/extend ms, accept_length, source} from a
    server-tier report.json (or its folder): no_spec's median TPOT; the speculating mode's P4
    medians (draft + verify + extend, else its cycle); side A of an --ab report."""
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise usage_error(f"--with-profile {path}: cannot read a report.json there ({e})") from None
    srv = (doc.get("tiers") or {}).get("server") or {}
    modes, side = srv.get("modes"), ""
    if modes is None and (srv.get("ab") or {}).get("sides"):
        first = srv["ab"]["sides"][0]
        modes, side = first.get("modes"), f", side {first.get('label', 'A')}"
    if not modes:
        raise usage_error(f"--with-profile {path}: no server-tier modes in {p}")
    out: dict = {"source": f"server report {p}{side}"}
    for m in modes:
        b = m.get("benchmark") or {}
        med = ((m.get("verify_profile") or {}).get("median_of_records")) or {}
        if med.get("verify_ms_median") is not None and "spec_cycle_ms" not in out:
            phases = [med.get(f"{ph}_ms_median") for ph in ("draft", "verify", "extend")]
            cycle = sum(phases) if all(isinstance(x, (int, float)) for x in phases) else med.get("cycle_ms_median")
            if isinstance(cycle, (int, float)) and cycle > 0:
                out.update(spec_cycle_ms=round(float(cycle), 3), mode_spec=m.get("mode"),
                           draft_ms=phases[0], verify_ms=phases[1], extend_ms=phases[2])
                acc = b.get("accept_length") or med.get("accept_length")
                if isinstance(acc, (int, float)):
                    out["accept_length"] = round(float(acc), 2)
        elif med.get("verify_ms_median") is None and b.get("median_tpot_ms") and "decode_step_ms" not in out:
            out.update(decode_step_ms=round(float(b["median_tpot_ms"]), 3), mode_decode=m.get("mode"))
    if "decode_step_ms" not in out and "spec_cycle_ms" not in out:
        raise usage_error(f"--with-profile {path}: neither a decode TPOT nor a P4 verify profile in {p}")
    return out


def _points(rows: list[dict], mode: str) -> dict[tuple[str, str], dict[int, float]]:
    pts: dict = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("mode") == mode and r.get("median_us") is not None:
            pts.setdefault((r["backend"], r.get("install", "A")), {})[int(r["rows"])] = float(r["median_us"])
    return pts


def project(rows: list[dict], cfg: dict, baseline: dict | None = None, versions: dict[str, dict] | None = None,
            parity: dict | None = None, replay_bad: dict | None = None) -> dict:
    """The decision table as data: ranked candidates, each eligible or not (kernel/eligibility.py:
    parity = the server report's pairs, replay_bad = {(backend, install): why} of this run's
    back-to-back replay check), those not projected and why, warnings, the winner (the fastest
    eligible); versions: {install key: its worker's versions}, which name each candidate's switch."""
    base = {"decode_step_ms": cfg["decode_step_ms"], "spec_cycle_ms": cfg["spec_cycle_ms"], "source": "profile"}
    base.update(baseline or {})
    accepts = sorted({float(a) for a in cfg["accept_lengths"]} | ({base["accept_length"]} if base.get("accept_length") else set()))
    R = cfg["layers"] * cfg["reductions_per_layer"]
    dec_n, ver_n = cfg["batch_size"], cfg["batch_size"] * cfg["draft_tokens"]
    mode = cfg["mode"]
    pts = _points(rows, mode)
    first = min((r.get("install", "A") for r in rows), default="A")
    served = (cfg["served_backend"], first)
    out = {"R": R, "decode_rows": dec_n, "verify_rows": ver_n, "hidden": cfg["hidden"], "mode": mode,
           "baseline": base, "accept_lengths": accepts, "served": f"{served[0]} [{served[1]}]",
           "candidates": [], "not_ranked": [], "warnings": []}
    if served not in pts:
        out["warnings"].append(f"no {mode} measurement of {served[0]} in install {served[1]}: nothing to project from")
        return out
    t_srv = {n: latency_at(pts[served], n) for n in (dec_n, ver_n)}
    if None in t_srv.values():
        out["warnings"].append(f"{served[0]} was not measured around [{dec_n}] and [{ver_n}] rows: no projection")
        return out
    for n, (us, _) in t_srv.items():
        share = R * us / 1000 / (base["decode_step_ms"] if n == dec_n else base["spec_cycle_ms"])
        if share >= 1:
            out["warnings"].append(f"{R} x {served[0]} at [{n},{cfg['hidden']}] = {R * us / 1000:.1f} ms is more than "
                                   "the measured step or cycle: the bench's NCCL is not the served one (env?); "
                                   "the projection does not hold")
    wrong = {(r["backend"], r.get("install", "A")) for r in rows if r.get("status") in ("wrong", "error")}
    keys = sorted({(r["backend"], r.get("install", "A")) for r in rows})
    for key in keys:
        b, inst = key
        if b in NOT_CANDIDATES:
            continue
        reason, t = _effective(key, pts, rows, (dec_n, ver_n), wrong)
        if not reason and key in (replay_bad or {}):
            reason = f"wrong over back-to-back CUDA-graph replays, never a candidate: {replay_bad[key]}"
        if reason:
            out["not_ranked"].append({"backend": b, "install": inst, "why": reason, "eligible": False})
            continue
        d_dec = R * (t_srv[dec_n][0] - t[dec_n][0]) / 1000
        d_ver = R * (t_srv[ver_n][0] - t[ver_n][0]) / 1000
        step = base["decode_step_ms"] - d_dec
        cycle = base["spec_cycle_ms"] - d_ver
        row = {"backend": b, "install": inst, "switch": switch(b, (versions or {}).get(inst)),
               "served": key == served, "fused": any(r.get("fused") for r in rows if r["backend"] == b),
               "t_decode_us": round(t[dec_n][0], 2), "t_decode_how": t[dec_n][1],
               "t_verify_us": round(t[ver_n][0], 2), "t_verify_how": t[ver_n][1],
               "ar_ms_decode": round(R * t[dec_n][0] / 1000, 3), "ar_ms_verify": round(R * t[ver_n][0] / 1000, 3),
               "step_ms": round(step, 3), "cycle_ms": round(cycle, 3),
               **eligibility.of(b, parity, cfg["confirm"].get(b))}
        if step <= 0 or cycle <= 0:
            out["not_ranked"].append({"backend": b, "install": inst,
                                      "why": f"projected step {step:.2f} ms / cycle {cycle:.2f} ms is not positive"})
            continue
        row["tok_s_no_spec"] = round(1000 / step, 1)
        row["tok_s_eagle3"] = {f"{a:g}": round(1000 * a / cycle, 1) for a in accepts}
        row["break_even_accept"] = round(cycle / step, 2)
        out["candidates"].append(row)
    rank_a = float(cfg["rank_accept_length"])
    out["rank_accept_length"] = rank_a
    out["candidates"].sort(key=lambda c: (-1000 * rank_a / c["cycle_ms"], -c["tok_s_no_spec"]))
    for i, c in enumerate(out["candidates"], 1):
        c["rank"] = i
        c["eagle3_pays_at_rank_accept"] = 1000 * rank_a / c["cycle_ms"] > c["tok_s_no_spec"]
    out["parity_source"] = (parity or {}).get("source")
    out["winner"] = next((f"{c['backend']} [{c['install']}]" for c in out["candidates"] if c["eligible"]), None)
    return out


def _effective(key, pts, rows, shapes, wrong):
    """(reason not projected, None) or (None, {n: (allreduce-equivalent us, how)})."""
    b, inst = key
    if key in wrong:
        return "a WRONG result or an error in this run: never a candidate", None
    if key not in pts:
        declined = [r for r in rows if r["backend"] == b and r.get("install", "A") == inst and r.get("status") == "declined"]
        return ("declined: " + declined[0].get("detail", "?")) if declined else "no graph-mode measurement", None
    t = {}
    for n in shapes:
        v = latency_at(pts[key], n)
        if v is None:
            dec = next((r for r in rows if r["backend"] == b and r.get("install", "A") == inst and r["rows"] == n
                        and r.get("status") == "declined"), None)
            return (f"declined at [{n}] rows: {dec['detail']}" if dec else f"not measured around [{n}] rows"), None
        t[n] = v
    if not any(r.get("fused") for r in rows if r["backend"] == b):
        return None, t
    ref = next(((NORM_REFERENCE, i) for i in (inst, min(i for _, i in pts)) if (NORM_REFERENCE, i) in pts), None)
    if ref is None or (("nccl", ref[1]) not in pts):
        return ("fused with add-RMSNorm, and no nccl_add_rmsnorm next to nccl measured (sgl_kernel absent): "
                "nothing to compare it with fairly"), None
    for n in shapes:
        a, c = latency_at(pts[ref], n), latency_at(pts[("nccl", ref[1])], n)
        if a is None or c is None:
            return f"no nccl_add_rmsnorm / nccl at [{n}] rows to take the separate norm's cost from", None
        t[n] = (t[n][0] - (a[0] - c[0]), t[n][1] + f", less the separate add-RMSNorm ({a[0] - c[0]:.1f} us)")
    return None, t


def markdown(d: dict, labels: dict[str, str], confirm: dict[str, str]) -> list[str]:
    """The table for report.md: ranked, each with its switch, then what was not projected."""
    base = d["baseline"]
    acc = d.get("accept_lengths", [])
    md = ["### Decision table: which allreduce, and what EAGLE-3 would give (a PROJECTION)", "",
          f"**A projection from measured kernel latencies, not a measured throughput: the server tier confirms "
          f"it.** Per forward pass {d['R']} allreduces (layers x 2): decode rows [{d['decode_rows']},{d['hidden']}], "
          f"verify rows [{d['verify_rows']},{d['hidden']}] ({d['mode']} mode). Projected step = "
          f"{base['decode_step_ms']} ms - {d['R']} x (t({d['served']}) - t(backend)); projected cycle = "
          f"{base['spec_cycle_ms']} ms - {d['R']} x the same difference at the verify rows (baseline from the "
          f"{base['source']}). EAGLE-3 tok/s = 1000 x accept length / cycle. Ranked by EAGLE-3 tok/s at accept "
          f"length {d.get('rank_accept_length')}.", ""]
    md += [f"- **{w}**" for w in d.get("warnings", [])] + ([""] if d.get("warnings") else [])
    if not d["candidates"]:
        return md + ["No backend could be projected."] + _not_ranked(d, labels)
    md += ["| rank | backend | install | us decode / verify | allreduce ms per decode step / verify pass | "
           "projected step ms | no-spec tok/s | " + " | ".join(f"EAGLE-3 @{a:g}" for a in acc)
           + " | break-even accept | switch | eligible |",
           "|---|---|---|---|---|---|---|" + "---|" * len(acc) + "---|---|---|"]
    for c in d["candidates"]:
        how = "" if c["t_decode_how"] == c["t_verify_how"] == "measured" else " (interp.)"
        name = f"**{c['backend']}**" + (" (as served)" if c["served"] else "") + (" (fused)" if c["fused"] else "")
        md.append(f"| {c['rank']} | {name} | {c['install']} | {c['t_decode_us']:.1f} / {c['t_verify_us']:.1f}{how} | "
                  f"{c['ar_ms_decode']:.2f} / {c['ar_ms_verify']:.2f} | {c['step_ms']:.2f} | {c['tok_s_no_spec']:.1f} | "
                  + " | ".join(f"{c['tok_s_eagle3'][f'{a:g}']:.1f}" for a in acc)
                  + f" | {c['break_even_accept']:.2f} | {c['switch']} | {ELIGIBLE[c.get('eligible')]} |")
    md.append("")
    md += [f"- install {k}: {v}" for k, v in sorted(labels.items())]
    md += ["", "Eligible (no path counts as faster until it has said the same thing as NCCL: its server-tier parity "
           "pairs passed, `[[server.parity]] backends`; " + (f"pairs from `{d['parity_source']}`" if d.get("parity_source")
                                                              else "no server report given: --with-profile REPORT") + "):"]
    md += [f"- {c['backend']} [{c['install']}]: {ELIGIBLE[c.get('eligible')]}: {c.get('why')}" for c in d["candidates"]
           if not c["served"]]
    best = d["candidates"][0]
    cmd = confirm.get(best["backend"])
    how = (f"confirm on the server: `{cmd}`" if cmd else
           "no server-tier mode in the profile turns it on yet ([kernel.decision.confirm])")
    if best.get("eligible"):
        md += ["", f"Winner by this projection: **{best['backend']}** (install {best['install']}), eligible; {how}"]
    else:
        md += ["", f"Fastest by this projection: **{best['backend']}** (install {best['install']}), "
                   f"{'**NOT eligible**' if best.get('eligible') is False else 'not eligible yet'}: {best.get('why')}; "
                   f"{how}", f"Winner among the eligible: **{d.get('winner') or 'none'}**"]
    return md + _not_ranked(d, labels)


ELIGIBLE = {True: "yes", False: "**NO**", None: "not yet"}


def _not_ranked(d: dict, labels: dict[str, str]) -> list[str]:
    if not d["not_ranked"]:
        return [""]
    return ["", "Not projected:"] + [f"- {x['backend']} [{x['install']}]: {x['why']}" for x in d["not_ranked"]] + [""]
