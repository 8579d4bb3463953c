"""Which allreduce backend served a server's small (decode / verify) tensors, from the evidence
the server gives: the lines its allreduce set-up logs, plus the env and flags that selected it.

The lines are the real modules' messages:
- P2 (patches/0002, `custom_all_reduce.py`): "Custom allreduce on N PCIe-only GPUs for tensors up
  to B bytes (...), NCCL above." (switch: SGLANG_ENABLE_PCIE_CUSTOM_AR=1);
- upstream PCIe-IPC (0.5.21+, `pcie_ipc_ar.py`): "FlashInfer PCIe-IPC all-reduce enabled (world=N,
  ...)" / "FlashInfer PCIe-IPC workspace built (...)"; its give-ups "... falling back to NCCL
  all-reduce." / "... failed: ...; reductions stay on NCCL" (switch: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1);
- P5 (patches/0005, 0.5.9's `pcie_ipc_allreduce.py`): "PCIe-IPC allreduce on N GPUs: workspace X MiB per
  GPU, bf16 reductions up to M elements (...); buckets [...]; <seed|cache|tune> launch configurations
  (SGLANG_PCIE_IPC_TUNE; ...)" (an older P5: "... on N GPUs for bf16 reductions up to M elements"); its
  give-up "PCIe-IPC allreduce is off on all N ranks because ..." (the same switch); it prints 0.5.23's
  start-up line below as well;
- SGLang's "Custom allreduce is disabled because ..." warning: the custom kernel is off, so NCCL
  serves unless PCIe-IPC took over;
- flashinfer's allreduce fusion (P1 on 0.5.9: "FlashInfer workspace initialized for rank R, world_size
  N"; 0.5.23: "FlashInfer AllReduce Fusion enabled and workspace initialized: backend=...")
  serves the allreduces fused with the residual add + RMSNorm (--enable-flashinfer-allreduce-fusion,
  0.5.23 also --flashinfer-allreduce-fusion-backend); reported beside the main backend.  P1 on 0.5.23
  switches the fusion off on SM120 when SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 ("FlashInfer allreduce
  fusion is disabled because SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 hands ...": the fusion line then says so).

SGLang tries its custom allreduce before PCIe-IPC, so when both are on, P2 takes the small tensors.

P1 on 0.5.23 (issue 18), P5 and P7 on 0.5.9 log one start-up line that names the path outright, read
first when present: "Decode/verify allreduce: <trtllm fused | custom allreduce | PCIe-IPC | b12x one-shot |
NCCL> (world_size=N)." (`flashinfer_comm_fusion.log_decode_allreduce_path`, after the workspaces are
built; P7 serves flashinfer's b12x one-shot allreduce and its fused add+RMSNorm under one switch,
SGLANG_ENABLE_B12X_ALLREDUCE=1). A fused path serves the plain decode reductions too (set_flashinfer_allreduce_only).
Whose PCIe-IPC it is (P5's backport or upstream's) is what the served sglang carries (`ipc_by`,
from served.pcie_ipc_server): the log lines alone do not say.
"""

from __future__ import annotations

import re
from pathlib import Path

P2 = re.compile(r"Custom allreduce on \d+ PCIe-only GPUs for tensors up to (\d+) bytes")
CUSTOM_OFF = re.compile(r"Custom allreduce is disabled")
IPC_ON = re.compile(r"FlashInfer PCIe-IPC all-reduce enabled|FlashInfer PCIe-IPC workspace built|"
                    r"PCIe-IPC allreduce on \d+ GPUs(: workspace [\d.]+ MiB per GPU| for bf16 reductions)")
# P5's workspace line: what it built and which launch configurations it runs
IPC_DETAIL = re.compile(r"PCIe-IPC allreduce on (?P<world>\d+) GPUs: workspace (?P<mib>[\d.]+) MiB per GPU.*?"
                        r"buckets \[(?P<buckets>[\d, ]*)\]; (?P<policy>seed|cache|tune) launch configurations")
IPC_GAVE_UP = re.compile(r"PCIe-IPC.*(falling back to NCCL|reductions stay on NCCL)|"
                         r"PCIe-IPC all-reduce skipped|leaving PCIe-IPC all-reduce off|PCIe-IPC allreduce is off on all")
FUSION_ON = re.compile(r"FlashInfer AllReduce Fusion enabled|FlashInfer workspace initialized for rank")
FUSION_OFF = re.compile(r"FlashInfer allreduce fusion (is )?disabled|AllReduce fusion disabled|Skipping allreduce fusion")
STARTUP = re.compile(r"Decode/verify allreduce: ([A-Za-z0-9 -]+?) \(world_size=\d+\)")
SWITCHES = ("SGLANG_ENABLE_PCIE_CUSTOM_AR", "SGLANG_PCIE_CUSTOM_AR_MAX_BYTES", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
            "SGLANG_PCIE_IPC_MAX_NUMEL", "SGLANG_PCIE_IPC_TUNE", "SGLANG_ENABLE_B12X_ALLREDUCE")
FUSION_FLAG = "--enable-flashinfer-allreduce-fusion"
FUSION_BACKEND_FLAG = "--flashinfer-allreduce-fusion-backend"

P2_NAME, IPC_NAME, NCCL_NAME, UNKNOWN = ("custom allreduce (P2)", "PCIe-IPC (upstream)", "NCCL",
                                         "unknown (no evidence in the log)")
FUSED_NAME, CA_NAME = "flashinfer trtllm fused (P1)", "custom allreduce (upstream)"
P5_IPC_NAME = "PCIe-IPC (P5, the 0.5.9 backport)"
B12X_NAME = "b12x one-shot (P7)"
STARTUP_NAMES = {"PCIe-IPC": IPC_NAME, "NCCL": NCCL_NAME, "trtllm fused": FUSED_NAME, "custom allreduce": CA_NAME,
                 "b12x one-shot": B12X_NAME}
# the kernel tier's backend names (kernel/decision.py) -> what the server's evidence calls that path;
# a parity pair that names a backend counts for it only when its mode b was served by it
SERVED_AS = {"pcie_ipc": (IPC_NAME, P5_IPC_NAME), "pcie_ipc_tuned": (IPC_NAME, P5_IPC_NAME),
             "custom_ar": (P2_NAME, CA_NAME), "flashinfer_fused": (FUSED_NAME,),
             "b12x_oneshot": (B12X_NAME,), "b12x_fused": (B12X_NAME,)}


def _first(lines: list[str], pat: re.Pattern) -> str | None:
    return next((ln.strip() for ln in lines if pat.search(ln)), None)


def allreduce_backend(log_path: Path, env: dict, args: list[str], ipc_by: str | None = None) -> dict:
    """{"backend", "evidence" (the log line), "fusion" (None / the line), "selected_by" (env and
    flag)} for one server run; ipc_by "P5" names a PCIe-IPC backend as P5's."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    sel = {k: env[k] for k in SWITCHES if k in env}
    args = [str(a) for a in args]
    if FUSION_FLAG in args:
        sel[FUSION_FLAG] = True
    for i, a in enumerate(args):  # 0.5.23: --flashinfer-allreduce-fusion-backend NAME
        if a.startswith(FUSION_BACKEND_FLAG):
            sel[FUSION_BACKEND_FLAG] = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
    out: dict = {"selected_by": sel, "fusion": None}
    p2, ipc_on, ipc_off = _first(lines, P2), _first(lines, IPC_ON), _first(lines, IPC_GAVE_UP)
    off = _first(lines, CUSTOM_OFF)
    startup = _first(lines, STARTUP)
    if startup:  # the start-up line of P1 on 0.5.23 names the path itself
        path = STARTUP.search(startup).group(1)
        out.update(backend=STARTUP_NAMES.get(path, f"flashinfer {path}" if path.endswith(" fused") else path),
                   evidence=startup)
        if path.endswith(" fused"):
            out["fusion"] = startup
    elif p2:
        cap = int(P2.search(p2).group(1))
        out.update(backend=P2_NAME if cap > 0 else NCCL_NAME, evidence=p2)
        if ipc_on:
            out["note"] = "PCIe-IPC is on too, but SGLang tries its custom allreduce first: P2 takes the small tensors"
    elif ipc_on and not ipc_off:
        out.update(backend=IPC_NAME, evidence=ipc_on)
    elif ipc_off:
        out.update(backend=NCCL_NAME, evidence=ipc_off)
    elif off:
        out.update(backend=NCCL_NAME, evidence=off)
    else:
        out.update(backend=UNKNOWN, evidence=None)
    if out["backend"] == IPC_NAME and ipc_by == "P5":
        out["backend"] = P5_IPC_NAME
    detail = _first(lines, IPC_DETAIL)
    if detail:  # P5's workspace: its size, buckets and launch configurations (SGLANG_PCIE_IPC_TUNE)
        m = IPC_DETAIL.search(detail)
        out["pcie_ipc"] = {"world_size": int(m["world"]), "workspace_mib": float(m["mib"]),
                           "buckets": [int(x) for x in m["buckets"].replace(",", " ").split()],
                           "launch_configurations": m["policy"], "line": detail}
    fused = None if startup else _first(lines, FUSION_ON)
    if out["fusion"]:
        pass
    elif fused:
        out["fusion"] = fused
    elif sel.get(FUSION_FLAG) or sel.get(FUSION_BACKEND_FLAG):
        out["fusion"] = _first(lines, FUSION_OFF) or "flag set, no fusion line in the log"
    return out


def served_as(ev: dict | None, backend: str) -> bool | None:
    """Whether the evidence shows `backend` (a kernel-tier name) serving; None when no evidence
    line is known for that backend (mscclpp, symm_mem: the log names nothing)."""
    names = SERVED_AS.get(backend)
    if names is None:
        return None
    ev = ev or {}
    if backend == "flashinfer_fused" and ev.get("fusion") and FUSION_ON.search(ev["fusion"]):
        return True
    policy = (ev.get("pcie_ipc") or {}).get("launch_configurations")
    if backend == "pcie_ipc_tuned" and policy == "seed":  # P5's workspace line says it ran seed ones
        return False
    return ev.get("backend") in names


def describe(ev: dict | None) -> str:
    if not ev:
        return "—"
    s = ev["backend"]
    if ev.get("fusion") and FUSION_ON.search(ev["fusion"]):
        s += " + flashinfer allreduce fusion (add-norm allreduces)"
    return s
