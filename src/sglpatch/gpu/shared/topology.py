"""The GPU topology of a box, from `nvidia-smi topo -m` and `nvidia-smi topo -p2p r`.

Standard library only (the kernel bench and the doctor use it on boxes without GitPython).

`parse_matrix(text)` reads the link matrix (GPU rows only; NIC rows and the legend are
ignored, ANSI colour codes stripped), `parse_p2p(text)` the P2P read-capability matrix, and
`classify(topo)` names the class that decides which small-allreduce kernel can win:

| class | when | what public measurements say |
|---|---|---|
| `nvlink` | some GPU pair shows `NV#` | NVLink kernels (not this project's target) |
| `switches` | every GPU pair is `PIX` / `PXB` (under PCIe switches) | one-shot pull kernels beat NCCL (9-26 us vs ~24 us, 8-64 KB) |
| `one-socket` | no `SYS` pair, some pair crosses a host bridge (`PHB` / `NODE`) | root-complex P2P |
| `two-sockets-switches` | some `SYS` pair, the same-socket pairs all `PIX` / `PXB` | switches per socket, UPI/xGMI between |
| `two-sockets-no-switch` | some `SYS` pair, some same-socket pair `PHB` / `NODE` | one-shot pull loses to NCCL; PCIe-IPC wins (5.3 vs 205 us at 12 KiB) |
| `single-gpu` / `unknown` | one GPU / nothing parsed | |
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LINK = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|NA|N/A)$")
SWITCH_LINKS = ("PIX", "PXB")
HOST_LINKS = ("PHB", "NODE")

CLASS_TEXT = {
    "nvlink": "NVLink between GPUs",
    "switches": "PCIe switches (every GPU pair under a switch)",
    "one-socket": "one socket, no PCIe switches between some pairs (root complex)",
    "two-sockets-switches": "two sockets, PCIe switches within each socket",
    "two-sockets-no-switch": "two sockets without PCIe switches",
    "single-gpu": "one GPU",
    "unknown": "unknown (no `nvidia-smi topo -m` output)",
}


@dataclass
class Topology:
    gpus: list[int] = field(default_factory=list)
    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (a, b), a != b
    numa: dict[int, int | None] = field(default_factory=dict)
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    p2p: dict[tuple[int, int], str] = field(default_factory=dict)  # "OK", "CNS", ...

    def pairs(self) -> list[tuple[int, int]]:
        return [(a, b) for i, a in enumerate(self.gpus) for b in self.gpus[i + 1:]]

    def to_json(self) -> dict:
        return {
            "gpus": self.gpus,
            "links": {f"{a}-{b}": self.links.get((a, b)) for a, b in self.pairs()},
            "numa": {str(g): n for g, n in self.numa.items()},
            "cpu_affinity": {str(g): c for g, c in self.cpu_affinity.items()},
            "p2p": {f"{a}->{b}": s for (a, b), s in sorted(self.p2p.items())},
        }


def _rows(text: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, GPU rows as cells) of an nvidia-smi matrix; tab-separated."""
    lines = [ANSI.sub("", ln).rstrip("\n") for ln in (text or "").splitlines()]
    header: list[str] = []
    rows: list[list[str]] = []
    for ln in lines:
        cells = [c.strip() for c in ln.split("\t")]
        if not header and any(re.fullmatch(r"GPU\d+", c) for c in cells[1:]):
            header = cells
            continue
        if header and re.fullmatch(r"GPU\d+", cells[0]):
            rows.append(cells)
    if not header:  # space-separated (some drivers, copy/paste): split on runs of 2+ spaces
        for ln in lines:
            cells = [c.strip() for c in re.split(r"\t| {2,}", ln.strip())]
            if not header and cells and re.fullmatch(r"GPU\d+", cells[0]) and len(cells) > 1 \
                    and re.fullmatch(r"GPU\d+", cells[1]):
                header = [""] + cells
                continue
            if header and cells and re.fullmatch(r"GPU\d+", cells[0]):
                rows.append(cells)
    return header, rows


def parse_matrix(text: str) -> Topology:
    header, rows = _rows(text)
    topo = Topology()
    if not header:
        return topo
    cols = {name: i for i, name in enumerate(header) if name}
    gpu_cols = [(int(name[3:]), i) for name, i in cols.items() if re.fullmatch(r"GPU\d+", name)]
    numa_col = cols.get("NUMA Affinity")
    cpu_col = cols.get("CPU Affinity")
    for cells in rows:
        g = int(cells[0][3:])
        topo.gpus.append(g)
        for other, i in gpu_cols:
            if other != g and i < len(cells) and LINK.match(cells[i]):
                topo.links[(min(g, other), max(g, other))] = cells[i]
        if numa_col is not None and numa_col < len(cells):
            topo.numa[g] = int(cells[numa_col]) if cells[numa_col].isdigit() else None
        if cpu_col is not None and cpu_col < len(cells):
            topo.cpu_affinity[g] = cells[cpu_col]
    topo.gpus.sort()
    return topo


def parse_p2p(text: str, topo: Topology | None = None) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -p2p r` (or w): {(a, b): "OK" | "CNS" | "GNS" | "TNS" | "NS" | "U"}."""
    header, rows = _rows(text)
    out: dict[tuple[int, int], str] = {}
    if header:
        gpu_cols = [(int(n[3:]), i) for i, n in enumerate(header) if re.fullmatch(r"GPU\d+", n)]
        for cells in rows:
            a = int(cells[0][3:])
            for b, i in gpu_cols:
                if a != b and i < len(cells) and cells[i]:
                    out[(a, b)] = cells[i]
    if topo is not None:
        topo.p2p = out
    return out


def classify(topo: Topology) -> tuple[str, str]:
    """(class, one line saying why) for a parsed topology."""
    if not topo.gpus:
        return "unknown", CLASS_TEXT["unknown"]
    if len(topo.gpus) == 1:
        return "single-gpu", CLASS_TEXT["single-gpu"]
    pairs = topo.pairs()
    kinds = [topo.links.get(p, "?") for p in pairs]
    n = len(pairs)
    count = {k: kinds.count(k) for k in sorted(set(kinds))}
    summary = ", ".join(f"{v} {k}" for k, v in count.items())
    if any(k.startswith("NV") for k in kinds):
        return "nvlink", f"{CLASS_TEXT['nvlink']} ({summary} of {n} pairs)"
    cross = [k for k in kinds if k in ("SYS", "SOC")]
    same = [k for k in kinds if k not in ("SYS", "SOC")]
    numa = sorted({v for v in topo.numa.values() if v is not None})
    where = ""
    if numa:
        where = "; " + ", ".join(
            f"NUMA {node}: GPU {','.join(str(g) for g in topo.gpus if topo.numa.get(g) == node)}" for node in numa)
    if not cross:
        klass = "switches" if all(k in SWITCH_LINKS for k in kinds) else "one-socket"
    elif same and all(k in SWITCH_LINKS for k in same):
        klass = "two-sockets-switches"
    else:
        klass = "two-sockets-no-switch"
    return klass, f"{CLASS_TEXT[klass]} ({summary} of {n} pairs{where})"


def _run(cmd: list[str], timeout: float) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def read(nvidia_smi: str = "nvidia-smi", timeout: float = 20.0) -> tuple[Topology, dict]:
    """Run nvidia-smi (`topo -m`, `topo -p2p r`); return the parsed topology and the raw
    texts ({"matrix": str | None, "p2p": str | None}) for the report."""
    raw = {"matrix": _run([nvidia_smi, "topo", "-m"], timeout),
           "p2p": _run([nvidia_smi, "topo", "-p2p", "r"], timeout)}
    topo = parse_matrix(raw["matrix"] or "")
    if raw["p2p"]:
        parse_p2p(raw["p2p"], topo)
    return topo, raw


def report(topo: Topology, raw: dict | None = None) -> dict:
    """The topology block of a report: class, why, NUMA per GPU, pairs, P2P, raw texts."""
    klass, why = classify(topo)
    out = {"class": klass, "class_line": why, **topo.to_json()}
    no_p2p = sorted(f"{a}->{b}" for (a, b), s in topo.p2p.items() if s != "OK")
    out["p2p_missing"] = no_p2p
    if raw:
        out["raw"] = raw
    return out
