"""Run by `sglpatch doctor` with the interpreter that serves (a script: that interpreter may not
have sglpatch): what it sees once started, printed as one JSON object.

Standard library, plus `import torch` (no CUDA call: importing torch does not initialise CUDA).
The environment is read after the interpreter's start-up, so what a sitecustomize.py /
usercustomize.py / .pth file set shows, and their paths are given.
"""

import importlib.metadata
import importlib.util
import json
import os
import resource
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]  # no sibling shadows a module

PREFIXES = ("NCCL_", "SGLANG_", "SGL_", "CUDA_", "TORCH_", "PYTORCH_", "FLASHINFER_", "NVIDIA_", "MAX_JOBS",
            "CUDA_HOME", "PATH", "LD_LIBRARY_PATH")
DISTS = ("sglang", "torch", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "sgl-kernel",
         "sglang-kernel", "triton", "nvidia-nccl-cu12", "nvidia-nccl-cu13")


def dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def origin(module):
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec else None


def has_class(module_file, name):
    """Whether a module's source defines class name (read, not imported), None without the file."""
    try:
        with open(module_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return f"class {name}(" in text or f"class {name}:" in text


def limit(which):
    soft, hard = resource.getrlimit(which)
    return [None if v == resource.RLIM_INFINITY else v for v in (soft, hard)]


out = {
    "executable": sys.executable,
    "python_version": sys.version.split()[0],
    "prefix": sys.prefix,
    "startup_files": {m: getattr(sys.modules.get(m), "__file__", None) for m in ("sitecustomize", "usercustomize")
                      if sys.modules.get(m) is not None},
    "env": {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)},
    "dists": {d: dist_version(d) for d in DISTS},
    "origins": {m: origin(m) for m in ("flashinfer", "sgl_kernel")},
    # flashinfer >= 0.7.0's PCIe-IPC allreduce, which P5 (0.5.9) and sglang >= 0.5.22 serve through
    "flashinfer_pcie_ipc": (has_class(os.path.join(os.path.dirname(origin("flashinfer")), "comm", "pcie_ipc_ar.py"),
                                      "PcieIpcAllReduceWorkspace") or False) if origin("flashinfer") else None,
    "memlock": limit(resource.RLIMIT_MEMLOCK),
    "cpus_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    "cpu_count": os.cpu_count(),
}
try:
    import torch

    out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda, "file": torch.__file__}
    try:
        out["torch"]["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        out["torch"]["nccl"] = None
except Exception as e:  # noqa: BLE001 - reported, not raised
    out["torch"] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
