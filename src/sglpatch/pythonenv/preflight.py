"""Preflight for a new venv (``apply --venv``): can the release's pinned set run here?

Each condition reads the real environment (``nvidia-smi`` and ``nvcc`` as found on PATH /
CUDA_HOME, the filesystem under the venv directory) and the resolved install plan; each gives
one line. A failed condition is one line starting ``FAIL``; apply refuses when any fails.

Driver floors per CUDA major are NVIDIA's minor-version-compatibility table (CUDA
Compatibility guide, "CUDA Toolkit 11.x, 12.x, and 13.x Driver Version Ranges"; 12.0 GA
shipped with 525.60.13 on Linux): CUDA 12.x needs >= 525.60.13, CUDA 13.x needs >= 580.
Below 580 the driver line offers the CUDA 12 builds (``--cuda 12.N``, N the newest CUDA 12 the
driver ships with: the CUDA Toolkit release notes' "Toolkit Driver Version" table); with them,
one line per CUDA-specific requirement without a CUDA 12 build (sglang.cudavariant) and one for
GPUs the chosen torch build has no kernels for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DRIVER_FLOOR = {12: (525, 60, 13), 13: (580,)}
# the CUDA 12 release each driver branch shipped with (CUDA Toolkit release notes, GA drivers)
DRIVER_CUDA12 = [((575, 51, 3), 9), ((570, 26), 8), ((560, 28, 3), 6), ((555, 42, 2), 5), ((550, 54, 14), 4),
                 ((545, 23, 6), 3), ((535, 54, 3), 2), ((530, 30, 2), 1), ((525, 60, 13), 0)]
NVCC_FOR_JIT = (12, 8)  # flashinfer 0.7.x's PCIe-IPC JIT (P5) keeps an nvcc 12.8 path (compilation_context.py)
NVCC_FOR_P1 = (12, 9)  # flashinfer's SM12x fusion JIT (P1 on SM120) needs nvcc >= 12.9 at run time
DISK_FACTOR = 3  # wheels unpacked (~2x) plus the installer's cached copy
DISK_FLOOR_GIB = 25  # when the resolver gives no sizes (pip's report has none)
BINARY = re.compile(r"^(torch|torchaudio|torchvision|triton|sgl-kernel|sglang-kernel|flashinfer-.*|nvidia-.*|cuda-.*|xgrammar)$")


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not checked / not needed here
    text: str
    cannot_run: bool = False  # failed because this box cannot run it (no driver): exit 125, as the doctor

    def line(self) -> str:
        state = "ok" if self.ok else ("FAIL" if self.ok is False else "skip")
        return f"preflight: {state} {self.name}: {self.text}"


def _vtuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def _vstr(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def gpus(exe: str | None = None) -> tuple[list[tuple[str, str]], str]:
    """[(driver_version, compute_cap)] from nvidia-smi (``exe``, else the one on PATH), and how
    it was found ('' = no nvidia-smi)."""
    exe = exe or shutil.which("nvidia-smi")
    if not exe:
        return [], ""
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=driver_version,compute_cap", "--format=csv,noheader"], capture_output=True, text=True, errors="replace", timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"{exe} failed: {e}"
    rows = []
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and re.match(r"^\d+(\.\d+)*$", parts[0]):
            rows.append((parts[0], parts[1]))
    if proc.returncode != 0 or not rows:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        return [], f"{exe} answered no GPU ({last[-1] if last else 'exit ' + str(proc.returncode)})"
    return rows, exe


def cuda_major(plan) -> tuple[int | None, str]:
    """The CUDA major the plan's torch is built for, and the evidence."""
    for p in plan.packages:
        if p.name == "torch" and "+cu" in p.version:
            tag = p.version.split("+cu", 1)[1]
            return int(tag[:-1]), f"torch {p.version}"
    for p in plan.packages:
        m = re.match(r"^nvidia-cuda-runtime(-cu(\d+))?$", p.name)
        if m:
            return int(m.group(2) or _vtuple(p.version)[0]), f"{p.name} {p.version}"
    return None, ""


def cuda12_for(driver: str) -> str | None:
    """The --cuda value to offer for driver ('12.8' for 570.x), None below CUDA 12's floor."""
    return next((f"12.{minor}" for floor, minor in DRIVER_CUDA12 if _vtuple(driver) >= floor), None)


NO_DRIVER_OK = "SGLPATCH_PREFLIGHT_NO_DRIVER"  # =1: build a CUDA venv on a box without a driver (for another box)


def check_driver(plan, selection=None) -> Check:
    major, why = cuda_major(plan)
    rows, exe = gpus()
    if major is not None and not rows and os.environ.get(NO_DRIVER_OK) != "1":  # the doctor's skip is not a pass here
        return Check("driver", False, f"no NVIDIA driver answers here ({exe or 'nvidia-smi not found'}): the venv's CUDA {major} "
                     f"(from {why}) cannot run on this box; build it where it serves, or set {NO_DRIVER_OK}=1 to build it for another box",
                     cannot_run=True)
    return driver_verdict(major, why, rows, exe, offer_cuda12=selection is None)


def driver_verdict(major: int | None, why: str, rows: list[tuple[str, str]], exe: str, offer_cuda12: bool = False) -> Check:
    """The driver rule: the oldest driver of ``rows`` (gpus()) against the floor of CUDA ``major``;
    offer_cuda12: name the `--cuda 12.N` builds as the other way out (apply --venv without --cuda)."""
    if major is None:
        return Check("driver", None, "the plan has no CUDA runtime (CPU-only torch?); nothing to check")
    floor = DRIVER_FLOOR.get(major)
    if not rows:
        return Check("driver", None, f"{exe or 'nvidia-smi not found'}; not checked here (the plan needs CUDA {major}, from {why})")
    driver = min((r[0] for r in rows), key=_vtuple)
    if floor is None:
        return Check("driver", False, f"CUDA {major} (from {why}) has no known driver floor; driver {driver}")
    if _vtuple(driver) < floor:
        offer = cuda12_for(driver) if major >= 13 and offer_cuda12 else None
        return Check(
            "driver",
            False,
            f"NVIDIA driver {driver} is too old for CUDA {major} (from {why}); it needs >= {_vstr(floor)}: upgrade the driver on the host"
            + (f", or try the CUDA 12 builds: --cuda {offer}" if offer else ""),
        )
    return Check("driver", True, f"driver {driver} >= {_vstr(floor)} for CUDA {major} (from {why})")


def check_python(plan, resolve_error: str | None) -> Check:
    py = f"Python {plan.python_version}"
    if resolve_error:
        return Check("python", False, f"{py}: the release's pins cannot be installed: {resolve_error}")
    source_only = [f"{p.name}=={p.version}" for p in plan.packages if not p.wheel and (p.pinned or BINARY.match(p.name))]
    if source_only:
        return Check("python", False, f"{py}: no wheel of {', '.join(source_only)} (only sources; would be compiled here); use another Python")
    return Check("python", True, f"{py}: every pinned and binary package has a wheel ({len(plan.packages)} packages)")


def size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk(plan, venv_dir: Path) -> Check:
    where = _existing(venv_dir)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if plan.download_bytes:
        need = DISK_FACTOR * plan.download_bytes
        how = f"{DISK_FACTOR} x {size(plan.download_bytes)} of wheels"
    else:
        need = DISK_FLOOR_GIB * 2**30
        how = "the stated floor; the resolver gave no sizes"
    text = f"{size(free)} free at {where}, need ~{size(need)} ({how})"
    if free < need:
        return Check("disk", False, text + "; free space or pick another --venv directory")
    return Check("disk", True, text)


def find_nvcc(env: dict | None = None) -> tuple[str | None, str]:
    """nvcc on CUDA_HOME, else on PATH, of ``env`` (default: this process's environment)."""
    env = os.environ if env is None else env
    home = env.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc"), "CUDA_HOME"
    found = shutil.which("nvcc", path=env.get("PATH"))
    return (found, "PATH") if found else (None, "")


def check_nvcc(p1: bool) -> Check:
    if not p1:
        return Check("nvcc", None, "not needed (no --with-flashinfer: flashinfer's JIT for P1 / P5 not asked for)")
    return nvcc_verdict(*gpus())


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) from `nvcc --version` ("release 12.10" is (12, 10), above (12, 8))."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, errors="replace", timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        out = str(e)
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def nvcc_verdict(rows: list[tuple[str, str]], exe: str, env: dict | None = None) -> Check:
    """The nvcc rule for flashinfer's JIT: >= 12.8 for P5's PCIe-IPC module on any GPU, >= 12.9 for
    P1's fusion on the SM12x GPUs of ``rows`` (gpus()); nvcc as found in ``env``."""
    sm12 = [cap for _, cap in rows if _vtuple(cap)[:1] == (12,)]
    nvcc, where = find_nvcc(env)
    fix = f"set CUDA_HOME to a CUDA >= {_vstr(NVCC_FOR_JIT)} toolkit"
    if not nvcc:
        return Check("nvcc", False, f"flashinfer's JIT (P5's PCIe-IPC allreduce, P1's fusion) needs nvcc >= {_vstr(NVCC_FOR_JIT)}; "
                     f"none on CUDA_HOME or PATH: {fix}")
    have = nvcc_version(nvcc)
    if have is None or have < NVCC_FOR_JIT:
        found = _vstr(have) if have else "an unreadable version"
        return Check("nvcc", False, f"flashinfer's JIT (P5's PCIe-IPC allreduce, P1's fusion) needs nvcc >= {_vstr(NVCC_FOR_JIT)}; "
                     f"{nvcc} ({where}) is {found}: {fix}")
    text = f"{nvcc} ({where}) is {_vstr(have)} >= {_vstr(NVCC_FOR_JIT)} for flashinfer's JIT (P5)"
    if sm12 and have < NVCC_FOR_P1:
        return Check("nvcc", True, text + f"; P1's fusion on SM{sm12[0].replace('.', '')} needs >= {_vstr(NVCC_FOR_P1)}: "
                     "leave --enable-flashinfer-allreduce-fusion off")
    return Check("nvcc", True, text + (f" and P1 on SM{sm12[0].replace('.', '')}" if sm12 else ""))


def check_cuda12(selection) -> list[Check]:
    """--cuda: one line per CUDA-specific requirement that has no CUDA 12 build."""
    if not selection.missing:
        taken = ", ".join(f"{n} {how}" for n, how in selection.chosen.items()) or "nothing to change"
        return [Check("cuda12", True, f"every CUDA-specific requirement has a CUDA {selection.label} build: {taken}")]
    return [Check("cuda12", False, m.line()) for m in selection.missing]


def check_arch(plan, selection) -> Check:
    """--cuda: the GPUs against the newest architecture the plan's torch build has kernels for."""
    from sglpatch.pythonenv.cuda_builds import WAY_OUT

    for p in plan.packages:
        entry = selection.table.local.get(p.name)
        tag = p.version.split("+", 1)[1] if "+" in p.version else ""
        if entry and tag in entry.max_sm:
            rows, exe = gpus()
            if not rows:
                return Check("gpu-arch", None, f"{exe or 'nvidia-smi not found'}; not checked ({p.name} {p.version} has kernels up to SM{_vstr(entry.max_sm[tag])})")
            newer = sorted({cap for _, cap in rows if _vtuple(cap) > entry.max_sm[tag]}, key=_vtuple)
            if newer:
                sm = ", ".join("SM" + c.replace(".", "") for c in newer)
                return Check("gpu-arch", False, f"{p.name} {p.version} has no kernels for {sm} (its {tag} builds stop at SM{_vstr(entry.max_sm[tag]).replace('.', '')}): "
                             f"{WAY_OUT}" + (f", or {entry.alternative}" if entry.alternative else ""))
            return Check("gpu-arch", True, f"{p.name} {p.version} has kernels for every GPU here (up to SM{_vstr(entry.max_sm[tag]).replace('.', '')})")
    return Check("gpu-arch", None, "the plan's torch build is not in the CUDA 12 table; not checked")


def run(plan, venv_dir: Path, p1: bool, resolve_error: str | None = None, selection=None) -> list[Check]:
    driver = Check("driver", None, "not checked (no plan to read the CUDA major from)") if resolve_error else check_driver(plan, selection)
    checks = [check_python(plan, resolve_error), driver, check_disk(plan, venv_dir), check_nvcc(p1)]
    if selection is not None:
        checks += check_cuda12(selection) + ([] if resolve_error else [check_arch(plan, selection)])
    return checks
