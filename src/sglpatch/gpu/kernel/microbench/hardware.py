"""What a worker run measured on: the GPUs, NCCL and CUDA, the NCCL env it ran under, and the
versions of the interpreter's libraries (read from their installed metadata, nothing imported)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

# distribution names whose versions label a run (sgl_kernel comes as sgl-kernel, later sglang-kernel)
VERSION_DISTS = ("torch", "flashinfer-python", "sglang", "sgl-kernel", "sglang-kernel", "mscclpp",
                 "nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-cutlass-dsl")
ENV_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "SGLANG_", "CUDA_VISIBLE", "FLASHINFER_", "B12X_")


def _run_quiet(cmd: list[str], timeout: float = 20.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def nvlink_from_topo(topo: str | None) -> bool | None:
    """True when `nvidia-smi topo -m` shows an NV# link between two GPUs, False when it shows
    GPUs but none, None when unknown."""
    if not topo:
        return None
    gpu_rows = [ln for ln in topo.splitlines() if re.match(r"^\s*GPU\d+\s", ln)]
    if not gpu_rows:
        return None
    return any(re.search(r"\bNV\d+\b", ln) for ln in gpu_rows)


def versions() -> dict:
    """{distribution: version} of the libraries present in this interpreter, plus python."""
    import importlib.metadata as md

    out = {"python": platform.python_version(), "executable": sys.executable}
    for d in VERSION_DISTS:
        try:
            out[d] = md.version(d)
        except Exception:  # noqa: BLE001 — not installed
            continue
    ipc = sglang_pcie_ipc()
    if ipc:
        out["sglang_pcie_ipc"] = ipc
    if sglang_b12x():
        out["sglang_b12x"] = "P7"
    return out


def _sglang_folder() -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def sglang_b12x() -> bool:
    """Whether this interpreter's sglang serves SGLANG_ENABLE_B12X_ALLREDUCE=1 (P7: its sources read
    the switch); read from the files, nothing imported."""
    from sglpatch.gpu.shared.served import B12X_SWITCH, reads_switch

    pkg = _sglang_folder()
    return bool(pkg) and reads_switch(pkg, B12X_SWITCH)


def sglang_pcie_ipc() -> str | None:
    """What in this interpreter's sglang serves SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1: "P5" (the
    series' backport, device_communicators/pcie_ipc_allreduce.py), "upstream" (pcie_ipc_ar.py,
    sglang >= 0.5.21), None; read from the files, nothing imported."""
    pkg = _sglang_folder()
    if not pkg:
        return None
    comm = os.path.join(pkg, "srt", "distributed", "device_communicators")
    if os.path.isfile(os.path.join(comm, "pcie_ipc_allreduce.py")):
        return "P5"
    return "upstream" if os.path.isfile(os.path.join(comm, "pcie_ipc_ar.py")) else None


def run_env() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def cpu_info(torch, world_size: int) -> dict:
    return {"hostname": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "world_size": world_size, "gpu_name": "cpu (gloo test mode)", "nvlink": None,
            "versions": versions(), "env": run_env()}


def hardware_info(torch, world_size: int) -> dict:
    info: dict = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "world_size": world_size,
        "visible_gpus": torch.cuda.device_count(),
        "versions": versions(),
    }
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unknown ({e})"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["gpu_names"] = names
    info["gpu_name"] = names[0] if names and len(set(names)) == 1 else names
    cap = torch.cuda.get_device_capability(0)
    info["compute_capability"] = f"{cap[0]}.{cap[1]}"
    n = min(world_size, torch.cuda.device_count())
    info["p2p_access"] = {f"{a}->{b}": bool(torch.cuda.can_device_access_peer(a, b))
                          for a in range(n) for b in range(n) if a != b}
    topo = _run_quiet(["nvidia-smi", "topo", "-m"])
    info["nvidia_smi_topo"] = topo
    info["nvlink"] = nvlink_from_topo(topo)
    drv = _run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["driver"] = drv.strip().splitlines()[0] if drv else None
    info["env"] = run_env()
    return info
