"""`sglpatch doctor`, checks 4 and 5: topology, a real P2P copy per pair, the allreduce backend
the topology suggests, and free GPU memory against what the profile's model needs.

The topology is `gpu.topology`'s (`nvidia-smi topo -m` / `-p2p r`). The P2P test runs
`doctor_p2p_probe.py` with the serving interpreter in its own session; every pair is held to a
deadline from its "start" line: a pair past it is named as hanging, the child's whole tree is
ended (`sglpatch.proctree`) and a new child goes on with the remaining pairs.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import tempfile
import time
from pathlib import Path

from sglpatch.gpu.shared import topology
from sglpatch.gpu.doctor.checks import Check
from sglpatch.proctree import Tree

P2P_PROBE = Path(__file__).with_name("p2p_probe.py")
# SGLang refuses TP when a GPU has < 0.9 x the free memory of another ("The memory capacity is unbalanced":
# 0.5.9 srt/model_executor/model_runner.py, 0.5.23 srt/distributed/bootstrap.py), unless
# SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK is off (then only a warning)
BALANCE = 0.9
ACS_HINT = ("P2P between them is broken: ACS on a bridge above them redirects peer traffic to the root complex, "
            "or the IOMMU remaps it; check `sudo lspci -vvv | grep -i acsctl` (SrcValid+ / ReqRedir+ on the "
            "bridges: ACS on) and the kernel command line (/proc/cmdline: iommu=pt, intel_iommu=, amd_iommu=)")
EVIDENCE = {  # class -> (what the topology suggests, the measured evidence, sglang version it needs)
    "two-sockets-no-switch": (
        "upstream PCIe-IPC allreduce (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1)",
        "5.3 vs 205.1 us (NCCL) at 12 KiB, 15.3 vs 584.9 us at 96 KiB on 8x SM120 with two NUMA nodes and no "
        "switch (sglang 0.5.23 pcie_ipc_ar.py header); one-shot pull kernels (P2) lose on dual-CPU hosts without "
        "switches (voipmonitor/rtx6kpro hardware/pcie-bandwidth.md)", (0, 5, 21)),
    "switches": (
        "one-shot custom allreduce (P2: SGLANG_ENABLE_PCIE_CUSTOM_AR=1)",
        "9.2 / 16.5 vs 24.2 / 24.5 us (NCCL) at 8 / 32 KB on 8x RTX PRO 6000 behind PCIe switches "
        "(voipmonitor/rtx6kpro hardware/pcie-bandwidth.md)", None),
    "two-sockets-switches": (
        "measure: a one-shot custom allreduce (P2) may win within a socket, the UPI/xGMI hop decides",
        "no public measurement of this class at hand", None),
    "one-socket": (
        "measure: NCCL on the root complex is slow at decode sizes",
        "NCCL 45 / 344 us at 4 / 64 KB on 8x RTX 6000D on the root complex (sglang issue #32479)", None),
    "nvlink": ("SGLang's default custom allreduce over NVLink", "NVLink boxes are not this project's target", None),
}


def query_memory(nvidia_smi: str | None, timeout: float = 30.0) -> list[dict]:
    """[{index, name, total, used, free}] in MiB from nvidia-smi; [] when it does not answer."""
    if not nvidia_smi:
        return []
    try:
        r = subprocess.run([nvidia_smi, "--query-gpu=index,name,memory.total,memory.used,memory.free",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, errors="replace", timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        p = [x.strip() for x in line.split(",")]
        if len(p) >= 5 and p[0].isdigit() and all(x.isdigit() for x in p[2:5]):
            rows.append({"index": int(p[0]), "name": p[1], "total": int(p[2]), "used": int(p[3]), "free": int(p[4])})
    return sorted(rows, key=lambda r: r["index"])


# ------------------------------------------------------------------ 4. topology and P2P


def check_topology(topo: topology.Topology, raw: dict) -> list[Check]:
    rep = topology.report(topo, raw)
    if rep["class"] == "unknown":
        return [Check("topology", "skip", "no `nvidia-smi topo -m` output", data=rep)]
    details = [f"GPU {g}: NUMA {topo.numa.get(g, '?')}, CPUs {topo.cpu_affinity.get(g, '?')}" for g in topo.gpus]
    out = [Check("topology", "ok", f"{rep['class']}: {rep['class_line']}", details=details, data=rep)]
    if topo.p2p:
        if rep["p2p_missing"]:
            out.append(Check("p2p-matrix", "warn", f"nvidia-smi reports no P2P read for {', '.join(rep['p2p_missing'])} "
                             f"({', '.join(sorted({topo.p2p[tuple(map(int, p.split('->')))] for p in rep['p2p_missing']}))})",
                             "those pairs go through host memory; custom allreduce kernels need P2P on every pair"))
        else:
            out.append(Check("p2p-matrix", "ok", f"nvidia-smi reports P2P read OK on all {len(topo.p2p)} directed pairs"))
    return out


def run_p2p(python: str, env: dict, pairs: list[tuple[int, int]] | None, probe: Path = P2P_PROBE,
            pair_timeout: float = 20.0, start_timeout: float = 180.0) -> dict:
    """{"ready": the probe's ready line or None, "pairs": {(a, b): done line | {"hung": s}},
    "untested": {(a, b): why}}; pairs None: every pair the probe's torch sees."""
    todo: list | None = list(pairs) if pairs is not None else None
    res: dict = {"ready": None, "pairs": {}, "untested": {}}
    penv = dict(env, PYTHONUNBUFFERED="1", CUDA_DEVICE_ORDER="PCI_BUS_ID")  # nvidia-smi's numbering
    while todo is None or todo:
        arg = "all" if todo is None else ",".join(f"{a}-{b}" for a, b in todo)
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen([python, str(probe), "--pairs", arg], stdout=subprocess.PIPE, stderr=err,
                                        stdin=subprocess.DEVNULL, env=penv, start_new_session=True)
            except OSError as e:
                res["error"] = f"cannot run {python}: {e}"
                return res
            tree = Tree(proc.pid)
            current, ended, ready = None, None, False
            deadline = time.monotonic() + start_timeout
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            buf = b""
            while ended is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    ended = "deadline"
                    break
                tree.snapshot()
                if not sel.select(min(left, 0.5)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    ended = "exit"
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    kind = ev.get("event")
                    if kind == "ready":
                        ready = True
                        res["ready"] = res["ready"] or ev
                        if not ev.get("gpus"):
                            ended = "no-gpu"
                        elif todo is None:
                            n = ev["gpus"]
                            todo = [(a, b) for a in range(n) for b in range(a + 1, n)]
                    elif kind == "start":
                        current = (ev["a"], ev["b"])
                    elif kind == "done":
                        pair = (ev["a"], ev["b"])
                        res["pairs"][pair] = ev
                        if todo and pair in todo:
                            todo.remove(pair)
                        current = None
                    deadline = time.monotonic() + pair_timeout
            sel.close()
            tree.kill(grace=2.0, reap=proc)
            proc.stdout.close()
            err.seek(0)
            tail = (err.read().decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        if ended == "no-gpu":
            break
        if current is not None:  # this pair hung or killed the probe: the others go on in a new child
            res["pairs"][current] = ({"hung": pair_timeout} if ended == "deadline"
                                     else {"ok": False, "detail": f"the probe died during the pair: {tail}"})
            if current in todo:
                todo.remove(current)
            continue
        if not ready:
            res["no_start"] = True  # GPUs are visible, yet the probe could not initialise them
            res["error"] = (f"the P2P probe did not start within {start_timeout:.0f} s (CUDA initialisation hung?)"
                            if ended == "deadline" else f"the P2P probe ended before it started: {tail}")
            res["untested"].update({p: res["error"] for p in todo or []})
            break
        if todo:
            res["untested"].update({p: f"the probe ended early: {tail}" for p in todo})
            break
    return res


def check_p2p(res: dict | None, cmdline: str, why_skipped: str = "") -> Check:
    if res is None:
        return Check("p2p-copy", "skip", why_skipped or "not run")
    if res.get("error") and not res["pairs"]:
        return Check("p2p-copy", "fail" if res.get("no_start") else "skip", res["error"],
                     "check `nvidia-smi` answers and no process is stuck on the GPUs (gpu-procs)")
    ready = res.get("ready") or {}
    if not res["pairs"] and not res["untested"]:
        return Check("p2p-copy", "skip", ready.get("error") or "fewer than 2 GPUs: no pair to test")
    iommu = " ".join(t for t in cmdline.split() if t.split("=")[0] in ("iommu", "intel_iommu", "amd_iommu")) or "no iommu= setting"
    hung = [p for p, r in res["pairs"].items() if r.get("hung")]
    bad = {p: r for p, r in res["pairs"].items() if not r.get("hung") and not r.get("ok")}
    nopeer = [p for p, r in res["pairs"].items() if r.get("ok") and not (r["ab"]["peer"] and r["ba"]["peer"])]
    details = [f"{a}<->{b}: " + ("HUNG" if r.get("hung") else r.get("detail") if not r.get("ok") else
               f"{r['ab']['gbps']} / {r['ba']['gbps']} GB/s, peer access {r['ab']['peer']}/{r['ba']['peer']}")
               for (a, b), r in sorted(res["pairs"].items())]
    details += [f"{a}<->{b}: not tested ({why})" for (a, b), why in sorted(res["untested"].items())]
    if hung or bad or res["untested"]:
        parts = []
        if hung:
            parts.append(f"pair(s) {', '.join(f'{a}<->{b}' for a, b in hung)} hung past {res['pairs'][hung[0]]['hung']:.0f} s: "
                         f"{ACS_HINT}; this kernel has: {iommu}")
        if bad:
            parts.append("; ".join(f"{a}<->{b}: {r.get('detail')}" for (a, b), r in sorted(bad.items())))
        if res["untested"]:
            parts.append(f"{len(res['untested'])} pair(s) not tested ({next(iter(res['untested'].values()))})")
        return Check("p2p-copy", "fail", "; ".join(parts),
                     "fix ACS / IOMMU on the host (BIOS, or `setpci` on the bridges; iommu=pt); until then "
                     "NCCL_P2P_DISABLE=1 and no custom allreduce", details=details)
    speeds = [(min(r["ab"]["gbps"], r["ba"]["gbps"]), p) for p, r in res["pairs"].items()]
    slow, (sa, sb) = min(speeds)
    text = f"{len(res['pairs'])} pairs copied both ways, values exact; slowest {slow} GB/s ({sa}<->{sb})"
    if nopeer:
        return Check("p2p-copy", "warn", text + f"; no peer access for {', '.join(f'{a}<->{b}' for a, b in nopeer)} "
                     "(copies went through host memory)", "custom allreduce kernels need peer access on every pair",
                     details=details)
    return Check("p2p-copy", "ok", text, details=details)


def kernel_decision(report_dir: Path) -> str | None:
    """What an earlier kernel-tier report measured on this box: its decision table's first row when it
    has one (tiers.kernel.decision), else the fastest backend at the verify shape [3, hidden]."""
    try:
        doc = json.loads((Path(report_dir) / "report.json").read_text())
    except (OSError, ValueError):
        return None
    k = (doc.get("tiers") or {}).get("kernel") or {}
    table = k.get("decision") or k.get("decision_table")
    if isinstance(table, list) and table and isinstance(table[0], dict):
        top = table[0]
        rest = ", ".join(f"{key} {v}" for key, v in top.items() if key != "backend" and isinstance(v, (int, float, str)))
        return f"decision table of {report_dir}: first {top.get('backend')} ({rest[:200]})"
    rows = [r for r in k.get("results") or [] if r.get("status") == "ok" and r.get("rows") == 3]
    for mode in ("graph", "eager"):
        at = sorted((r["median_us"], r["backend"]) for r in rows if r.get("mode") == mode)
        if at:
            return (f"measured in {report_dir} at [3, {rows[0].get('hidden')}] {mode}: "
                    + ", ".join(f"{b} {us:.1f} us" for us, b in at[:5]))
    return None


def check_backend(klass: str, version: tuple[int, ...], kernel_report: Path | None) -> Check:
    measured = kernel_decision(kernel_report) if kernel_report else None
    if klass not in EVIDENCE:
        return Check("allreduce", "skip", f"topology {klass}: nothing to suggest"
                     + (f"; {measured}" if measured else ""))
    what, evidence, needs = EVIDENCE[klass]
    text = f"{klass} suggests {what}: {evidence}"
    fix = ""
    if needs and version and version < needs:
        text += (f"; it needs sglang >= {'.'.join(map(str, needs))}, this interpreter serves "
                 f"{'.'.join(map(str, version))}")
        fix = "the 0.5.23 line (resolutions/0.5.23); compare: scripts/regress.sh --tier server --ab A_PY,B_PY"
    text += f"; {measured}" if measured else "; measure here: scripts/regress.sh --tier kernel"
    return Check("allreduce", "ok", text, fix)


# ------------------------------------------------------------------ 5. free GPU memory


def check_memory(rows: list[dict], prof: dict, env: dict | None = None) -> Check:
    if not rows:
        return Check("gpu-memory", "skip", "nvidia-smi gave no memory figures")
    model = prof.get("model") or {}
    srv = prof.get("server") or {}
    weights, margin = model.get("weights_gib"), float(model.get("margin_gib") or 0)
    details = [f"GPU {r['index']} {r['name']}: {r['free'] / 1024:.1f} of {r['total'] / 1024:.1f} GiB free" for r in rows]
    if not weights:
        return Check("gpu-memory", "skip", f"{len(rows)} GPUs; the profile has no [model] weights_gib to compare with",
                     details=details)
    tp = int(srv.get("tp") or 1)
    if len(rows) < tp:
        return Check("gpu-memory", "fail", f"the profile serves with tp {tp}, {len(rows)} GPU(s) visible",
                     "run on the box the profile is for (or check CUDA_VISIBLE_DEVICES)", details=details)
    used = rows[:tp]
    need = float(weights) / tp + margin
    short = [r for r in used if r["free"] / 1024 < need]
    how = f"{weights} GiB / tp {tp} + {margin:g} GiB margin = {need:.1f} GiB per GPU"
    if short:
        frees = ", ".join(f"{r['free'] / 1024:.1f}" for r in short)
        return Check("gpu-memory", "fail", f"GPU {', '.join(str(r['index']) for r in short)} short of memory "
                     f"({frees} GiB free; needs {how})",
                     "stop what holds it (see gpu-procs; stale workers: sglpatch doctor --kill-stale)", details=details)
    lo, hi = min(r["free"] for r in used), max(r["free"] for r in used)
    if tp > 1 and lo < BALANCE * hi:
        off = str((env or {}).get("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "1")).lower() in ("0", "false")
        return Check("gpu-memory", "warn" if off else "fail",
                     f"free memory unbalanced across the TP GPUs ({lo / 1024:.1f} vs {hi / 1024:.1f} GiB): SGLang "
                     + ("only warns (SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK off)" if off else
                        "refuses the load ('The memory capacity is unbalanced')"),
                     "stop what holds memory on the fuller GPUs (see gpu-procs)", details=details)
    return Check("gpu-memory", "ok", f"every TP GPU has >= {lo / 1024:.1f} GiB free; needs {how}", details=details)
