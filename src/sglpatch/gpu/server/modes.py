"""What a server-tier mode needs from the install that serves it, checked before a 547 GB load:

    [[server.modes]]
    name = "no_spec_ep8_deepep"
    requires_import = ["deep_ep"]   # modules the server's interpreter must import
    min_sglang = "0.5.21"           # the served sglang's version must be at least this
    requires_pcie_ipc = true        # the served sglang has a PCIe-IPC adapter: 0.5.9 + P5, or >= 0.5.22
    requires_switch = "SGLANG_ENABLE_B12X_ALLREDUCE"   # the served sglang's sources read it (0.5.9 + P7)

A mode whose needs are not met is not run and is listed with the reason (not a failure): on
--ab, each side checks its own interpreter, so a 0.5.23-only mode runs on that side only."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sglpatch.gpu.shared.served import B12X_SWITCH, pcie_ipc_server, reads_switch, version_tuple

NATIVE_PCIE_IPC = "0.5.22"  # 0.5.21 ships pcie_ipc_ar.py, but its flashinfer 0.6.18 has no PCIe-IPC module
SWITCH_BY = {B12X_SWITCH: "sglang 0.5.9 + P7"}  # what serves a switch that only a patch reads

CHECK = ("import importlib, sys\n"
         "for m in sys.argv[1:]:\n"
         "    try:\n"
         "        importlib.import_module(m)\n"
         "    except Exception as e:\n"
         "        print(f'{m}: {type(e).__name__}: {e}'); sys.exit(1)\n")


def unmet(mode: dict, python: str, env: dict, sglang_version: str | None, served: dict | None = None) -> str | None:
    """None when the mode can run with this install, else one line saying why not."""
    lo = mode.get("min_sglang")
    if lo and (not version_tuple(sglang_version) or version_tuple(sglang_version) < version_tuple(lo)):
        return f"needs sglang >= {lo}; {python} serves sglang {sglang_version or '?'}"
    if mode.get("requires_pcie_ipc"):
        by = pcie_ipc_server(served or {})
        if by is None or (by == "upstream" and version_tuple(sglang_version) < version_tuple(NATIVE_PCIE_IPC)):
            return (f"needs a PCIe-IPC allreduce: sglang 0.5.9 + P5 (`scripts/apply.sh --with-flashinfer`) or sglang >= "
                    f"{NATIVE_PCIE_IPC}; {python} serves sglang {sglang_version or '?'} "
                    + ("whose pinned flashinfer has no PCIe-IPC module" if by else "without one"))
    sw = mode.get("requires_switch")
    f = (served or {}).get("sglang_file")
    if sw and not (f and reads_switch(Path(f).parent, str(sw))):
        return (f"needs an sglang that reads {sw} ({SWITCH_BY.get(sw, 'a patch that serves it')}); {python} serves "
                f"sglang {sglang_version or '?'} whose sources never read it: the switch would be ignored and NCCL "
                "would serve")
    mods = [str(m) for m in mode.get("requires_import") or []]
    if not mods:
        return None
    try:
        p = subprocess.run([python, "-c", CHECK, *mods], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot check its imports with {python}: {e}"
    if p.returncode != 0:
        why = (p.stdout.strip().splitlines() or p.stderr.strip().splitlines() or ["?"])[-1]
        return f"does not import in {python}: {why}"
    return None


def split(modes: list[dict], python: str, env: dict, sglang_version: str | None,
          served: dict | None = None) -> tuple[list[dict], list[dict]]:
    """(modes to run, [{"mode", "why"}] of those not run)."""
    run, skipped = [], []
    for m in modes:
        why = unmet(m, python, env, sglang_version, served)
        if why:
            skipped.append({"mode": m["name"], "why": why})
        else:
            run.append(m)
    return run, skipped
