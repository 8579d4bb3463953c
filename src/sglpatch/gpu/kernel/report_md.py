"""report.md of the kernel tier: hardware and topology, the installs, the latency tables (a column
per backend and install), the decision table, PCIe-IPC seed against tuned, the crossover, absent
backends, stress."""

from __future__ import annotations

import shlex

from sglpatch.gpu.kernel import decision, eligibility, pcie_tune

VERSION_KEYS = ("torch", "flashinfer-python", "sglang", "sgl-kernel", "sglang-kernel", "mscclpp")


def hardware_line(hw: dict) -> str:
    return (f"{hw.get('world_size', '?')}x {hw.get('gpu_name', '?')} (sm {hw.get('compute_capability', '?')}), "
            f"NVLink: {({True: 'yes', False: 'no', None: 'unknown'})[hw.get('nvlink')]}, "
            f"torch {hw.get('torch', '?')}, CUDA {hw.get('cuda_runtime', '?')}, NCCL {hw.get('nccl', '?')}, "
            f"driver {hw.get('driver', '?')}")


def topology_markdown(t: dict | None) -> list[str]:
    if not t:
        return []
    md = ["### Topology", "", f"**Class: `{t['class']}`** — {t['class_line']}", ""]
    if t.get("numa"):
        md.append("NUMA node per GPU: " + ", ".join(f"GPU{g} {n if n is not None else '?'}" for g, n in t["numa"].items()))
    if t.get("p2p"):
        md.append("P2P read (nvidia-smi topo -p2p r): " + ("every pair OK" if not t.get("p2p_missing") else
                                                           f"**not OK: {', '.join(t['p2p_missing'])}**"))
    raw = t.get("raw") or {}
    for name, title in (("matrix", "nvidia-smi topo -m"), ("p2p", "nvidia-smi topo -p2p r")):
        if raw.get(name):
            md += ["", f"<details><summary>{title}</summary>", "", "```", raw[name].rstrip("\n"), "```", "",
                   "</details>"]
    if not raw.get("matrix"):
        md.append("(no `nvidia-smi topo -m` output here)")
    return md + [""]


def installs_markdown(installs: list[dict]) -> list[str]:
    if not installs:
        return []
    md = ["### Installs (each row of the tables below is labelled with its install)", "",
          "| install | interpreter | " + " | ".join(VERSION_KEYS) + " | NCCL |", "|---|---|" + "---|" * (len(VERSION_KEYS) + 1)]
    for inst in installs:
        hw = inst.get("hardware") or {}
        v = hw.get("versions") or {}
        md.append(f"| {inst['label']} | `{inst['python']}` | " + " | ".join(v.get(x, "—") for x in VERSION_KEYS)
                  + f" | {hw.get('nccl', '—')} |")
    for inst in installs:
        de = inst.get("default_env")
        if de:
            inside = de.get("still_set_inside") or {}
            md.append(f"\n`nccl_default_env` rows: NCCL with {', '.join(de['removed'])} removed"
                      + (f"; the interpreter set {sorted(inside)} again itself (a sitecustomize?): removed in the "
                         "worker before NCCL started" if inside else ""))
    return md + [""]


def _columns(d: dict) -> list[tuple[str, str]]:
    cols: list[tuple[str, str]] = []
    for r in d.get("results", []):
        key = (r["backend"], r.get("install", "A"))
        if key not in cols:
            cols.append(key)
    return cols


def latency_tables(d: dict, prof: dict) -> list[str]:
    cols = _columns(d)
    multi = len(d.get("installs") or []) > 1
    head = [f"{b} [{i}]" if multi else b for b, i in cols]
    by = {(r["backend"], r.get("install", "A"), r["mode"], r["rows"]): r for r in d.get("results", [])}
    sizes = sorted({r["rows"] for r in d.get("results", [])}) or d.get("sizes", [])
    md = []
    for mode in ("graph", "eager"):
        md += [f"### {mode} ({'CUDA-graph captured, as in decode' if mode == 'graph' else 'eager'})", "",
               "| rows x hidden | KiB | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(cols)]
        for n in sizes:
            cells = []
            for b, i in cols:
                r = by.get((b, i, mode, n))
                if r is None:
                    cells.append("—")
                elif r["status"] == "ok":
                    cells.append(f"{r['median_us']:.1f} / {r['p90_us']:.1f}")
                else:
                    cells.append(f"**{r['status'].upper()}**")
            md.append(f"| {n} x {d.get('hidden')} | {n * d.get('hidden', 0) * 2 / 1024:.0f} | " + " | ".join(cells) + " |")
        md.append("")
    return md


def replay_markdown(rows: list[dict], multi: bool) -> list[str]:
    """The back-to-back replay check: per backend and size, N graph replays without a host sync, each
    compared with NCCL on the same inputs (a fused path: its residual exactly, its norm to 2 bf16 ulps)."""
    if not rows:
        return []
    md = ["### Back-to-back CUDA-graph replays against NCCL (no host sync between replays)", "",
          "Each backend's op (a fused one: allreduce + residual add + RMSNorm) captured in a CUDA graph with a fresh "
          "input drawn on the device, replayed back to back, every replay's output compared with NCCL's allreduce "
          "of the same inputs: the hazard an end barrier guards. A difference fails the tier and the backend is "
          "never eligible.", "", "| backend | rows | replays | result |", "|---|---|---|---|"]
    for r in rows:
        name = r["backend"] + (f" [{r.get('install')}]" if multi else "")
        what = {"ok": "same as NCCL", "declined": f"declined: {r.get('detail')}"}.get(r.get("status"))
        md.append(f"| {name} | {r.get('rows') or '—'} | {r.get('replays')} | "
                  f"{what or '**' + str(r.get('status')).upper() + '**: ' + eligibility.replay_line(r)} |")
    return md + [""]


def crossover_markdown(d: dict) -> list[str]:
    md = ["### Crossover (recommendation for `SGLANG_PCIE_CUSTOM_AR_MAX_BYTES`)", ""]
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
    return md + [""]


def kernel_markdown(d: dict, prof: dict) -> list[str]:
    hw = d.get("hardware") or {}
    md = [f"**Measured on: {hardware_line(hw)}.**", ""]
    tgt = prof.get("target", {})
    if tgt.get("gpu_name") and hw.get("gpu_name") and tgt["gpu_name"] != hw.get("gpu_name"):
        md += [f"> These numbers are from {hw.get('gpu_name')}, not from the profile's target "
               f"({tgt['gpu_name']}); do not read them as target numbers.", ""]
    if d.get("quick"):
        md += ["> `--quick`: the decision sizes only, few samples: a smoke run, not a measurement to keep.", ""]
    md += topology_markdown(d.get("topology"))
    if d.get("latency_run") is False:
        md += ['Latency launches not run (`[kernel] device = "cpu"` with `--stress`: the stress test mode on CPU, '
               "gloo).", ""]
        if d.get("stress"):
            md += stress_markdown(d["stress"])
        return md
    md += installs_markdown(d.get("installs") or [])
    env = {k: v for k, v in (hw.get("env") or {}).items() if k.startswith("NCCL_")}
    md += [f"NCCL env of the main launch: `{env or '{}'}`; the `_p2p_off` rows add `NCCL_P2P_DISABLE=1`, the "
           "`_default_env` rows remove the profile's NCCL_* settings (separate launches).", "",
           f"Latency per allreduce, median / p90 in us (one sample = {prof['kernel']['inner']} ops back to back; "
           "a sample's time is the last-arriving rank's, i.e. the least over the ranks: that rank waited for "
           "nobody at the collective; every output checked against an exact integer reference, the sum NCCL "
           "returns; fused rows (allreduce + add + RMSNorm) exact on the residual, two bf16 ulps on the norm).", ""]
    md += latency_tables(d, prof)
    md += replay_markdown(d.get("replay") or [], len(d.get("installs") or []) > 1)
    if d.get("decision"):
        labels = {i["key"]: i["label"] for i in d.get("installs") or []}
        md += decision.markdown(d["decision"], labels, (decision.config(prof) or {}).get("confirm", {}))
    md += pcie_tune.markdown(d.get("pcie_ipc_tune"))
    md += crossover_markdown(d)
    for inst in d.get("installs") or [{"label": "", "absent": d.get("absent"), "errors": d.get("errors")}]:
        tag = f" (install {inst['label']})" if inst["label"] else ""
        if inst.get("absent"):
            md += [f"### Absent backends{tag}", ""] + [f"- {b}: {why}" for b, why in sorted(inst["absent"].items())] + [""]
        if inst.get("errors"):
            md += [f"### Backends that failed to set up or hung{tag}", ""] + \
                  [f"- {b}: {why}" for b, why in sorted(inst["errors"].items())] + [""]
    if d.get("baseline"):
        md += ["### Baseline", "", f"- {d['baseline']}", ""]
    if d.get("stress"):
        md += stress_markdown(d["stress"])
    md.append(f"Plot: `{d['plot']}`" if d.get("plot") else f"Plot: {d.get('plot_note')}")
    md += ["", "Launches:"] + [f"- `{shlex.join(L['cmd'])}` env+{L.get('env_added')} env-{L.get('env_removed', [])} "
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
