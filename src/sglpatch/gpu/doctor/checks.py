"""`sglpatch doctor`, checks 2 and 3: the Python that serves, and the driver and toolkits (the JIT
kernels that include flashinfer's headers built for the target: sglpatch.pythonenv.jit_kernels).

Each function turns facts into one `Check`; the facts come from a child run of the serving
interpreter (`probe.py`, so its start-up files count), from `served.imported_sglang`
(which sglang, which patches its workdir carries: the series side's status), and from the box
(nvidia-smi through `sglpatch.pythonenv.preflight`'s rules, /dev/shm, /proc/meminfo).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch.pythonenv import jit_kernels, preflight
from sglpatch.gpu.shared.served import pcie_ipc_server

PROBE = Path(__file__).with_name("probe.py")
STATES = ("ok", "warn", "fail", "skip")
SHM_FLOOR = 1 << 30  # Docker's 64 MiB default makes NCCL crash in ncclShmOpen (pytorch/tutorials#2475 uses 2 GiB)
JOBS_NO_SWAP = 20  # the user's box (no swap) stays up with -j20 or less
PROFILE_PREFIXES = ("NCCL_", "SGLANG_", "SGL_")


@dataclass
class Check:
    name: str
    state: str  # ok | warn | fail | skip (skip: cannot be checked here)
    text: str
    fix: str = ""
    details: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.state:<4} {self.name}: {self.text}" + (f"; fix: {self.fix}" if self.fix else "")

    def to_json(self) -> dict:
        return {"name": self.name, "state": self.state, "text": self.text, "fix": self.fix,
                "details": self.details, **({"data": self.data} if self.data else {})}


def from_preflight(c: preflight.Check, fail_state: str = "fail") -> Check:
    """preflight's verdict (True / False / None) as a doctor line; its text carries the fix."""
    state = "ok" if c.ok else (fail_state if c.ok is False else "skip")
    text, _, fix = c.text.rpartition(": ") if c.ok is False and ": " in c.text else (c.text, "", "")
    return Check(c.name, state, text, fix)


def probe_python(python: str, env: dict, timeout: float = 300.0) -> dict:
    """What the serving interpreter sees (probe.py's JSON), or {"error": ...}."""
    try:
        p = subprocess.run([python, str(PROBE)], env=env, capture_output=True, text=True, errors="replace", timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"cannot run {python}: {e}"}
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        return json.loads(last)
    except ValueError:
        tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return {"error": f"{python} could not run the probe: {tail}"}


# ------------------------------------------------------------------ 2. the Python that serves


def check_sglang(served: dict) -> Check:
    """From served.imported_sglang: the file, version and the workdir's patches."""
    if served.get("missing"):  # installed, its dependencies not: the command that installs them
        return Check("sglang", "fail", served["missing"],
                     f"install them: {served['deps_command']}; or build a complete new venv: scripts/apply.sh --venv NEWDIR")
    if served.get("error"):
        return Check("sglang", "fail", f"{served.get('python')}: {served['error']}",
                     "install the patched tree into that Python (`scripts/apply.sh --python PY`) or pass --python")
    head = f"sglang {served.get('sglang_version')} from {served.get('sglang_file')}"
    if "carried" not in served:
        return Check("sglang", "warn", f"{head}; {served.get('patches_note', 'patches unknown')}",
                     "serve from an sglpatch workdir (`scripts/apply.sh`) so that what runs is the series")
    carried, status = served["carried"], served.get("status") or []
    state_line = next((ln.split(":", 1)[1].strip() for ln in status if ln.startswith("state:")), "?")
    dirty = next((ln.split(":", 1)[1].strip() for ln in status if ln.startswith("dirty:")), "")
    dirty = "" if dirty.startswith("0 ") else dirty
    names = ", ".join(c.split(":", 1)[0] for c in carried) or "none"
    text = f"{head} (workdir {served.get('workdir')}, {len(carried)} patches: {names}; {state_line}"
    text += f"; {dirty})" if dirty else ")"
    fine = state_line == "in sync with the series" and not dirty
    fix = "" if fine else "run `sglpatch status` there; `sglpatch export` keeps commits, `sglpatch apply` rebuilds"
    return Check("sglang", "ok" if fine else "warn", text, fix, details=list(status))


def check_torch(info: dict, gpus_visible: bool) -> Check:
    t = info.get("torch") or {}
    if info.get("error"):
        return Check("torch", "fail", info["error"], "pass --python with an interpreter that runs")
    if t.get("error"):
        return Check("torch", "fail", f"torch does not import: {t['error']}", "install the torch SGLang pins")
    text = f"torch {t['version']} (CUDA {t.get('cuda') or 'none'}, NCCL {t.get('nccl') or 'none'}) from {t['file']}"
    if not t.get("cuda"):
        return Check("torch", "fail" if gpus_visible else "skip", text + ": a CPU-only build",
                     "install a CUDA build of torch (e.g. +cu128)" if gpus_visible else "")
    return Check("torch", "ok", text)


def check_kernels(info: dict, served: dict | None = None) -> list[Check]:
    """flashinfer and sgl-kernel / sglang-kernel: installed versions and where they import from;
    whether flashinfer has the PCIe-IPC allreduce that P5 / sglang >= 0.5.22 serve through."""
    d, o = info.get("dists") or {}, info.get("origins") or {}
    fi = {k: d.get(k) for k in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache") if d.get(k)}
    fi_text = ", ".join(f"{k} {v}" for k, v in fi.items())
    out = [_flashinfer(f"{fi_text} ({o.get('flashinfer')})", info.get("flashinfer_pcie_ipc"), pcie_ipc_server(served or {}))
           if fi else Check("flashinfer", "warn", "flashinfer is not installed", "install the flashinfer-python SGLang pins "
                            "(`scripts/apply.sh --with-flashinfer`: the set for P1 and P5)")]
    sk = {k: d.get(k) for k in ("sgl-kernel", "sglang-kernel") if d.get(k)}
    if sk:
        out.append(Check("sgl-kernel", "ok", ", ".join(f"{k} {v}" for k, v in sk.items()) + f" ({o.get('sgl_kernel')})"))
    else:
        out.append(Check("sgl-kernel", "warn", "neither sgl-kernel nor sglang-kernel is installed",
                         "install the sgl-kernel that sglang pins (its CUDA kernels and P2's custom allreduce)"))
    return out


def _flashinfer(text: str, has_ipc: bool | None, server: str | None) -> Check:
    """The flashinfer line: its PCIe-IPC workspace against what the served sglang would run it with."""
    by = {"P5": "P5 (0.5.9 + the series)", "upstream": "sglang's own pcie_ipc_ar.py"}.get(server or "", "")
    if has_ipc:
        use = (f"usable by {by} with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" if by else
               "the served sglang has no PCIe-IPC adapter (P5 or sglang >= 0.5.22)")
        return Check("flashinfer", "ok", f"{text}; has PcieIpcAllReduceWorkspace: {use}")
    if server:
        return Check("flashinfer", "warn", f"{text}; no PcieIpcAllReduceWorkspace: {by} cannot turn PCIe-IPC on "
                     "(it warns and stays on NCCL)", "scripts/apply.sh --with-flashinfer (flashinfer-python >= 0.7.0)")
    return Check("flashinfer", "ok", f"{text}; no PcieIpcAllReduceWorkspace (P5 needs flashinfer >= 0.7.0: "
                 "scripts/apply.sh --with-flashinfer)")


def check_env(info: dict, passed: dict, profile_env: dict) -> Check:
    """The interpreter's NCCL_* / SGLANG_* / CUDA_* as it sees them, against the profile's [env]."""
    if info.get("error"):
        return Check("env", "skip", "the interpreter did not run")
    seen = info.get("env") or {}
    startup = {k: v for k, v in seen.items() if passed.get(k) != v}
    files = ", ".join(f for f in (info.get("startup_files") or {}).values() if f) or "a .pth file"
    details = [f"{k}={v}" + (f"  (set at start-up by {files})" if k in startup else "")
               for k, v in sorted(seen.items()) if k.startswith(("NCCL_", "SGLANG_", "SGL_", "CUDA_", "TORCH_NCCL"))]
    problems = []
    for k, want in sorted(profile_env.items()):
        have = seen.get(k)
        if have == str(want):
            continue
        if have is None:
            problems.append(f"{k} unset (the profile says {want})")
        elif k in startup:
            problems.append(f"{k}={have} set at start-up by {files} (the profile says {want})")
        else:
            problems.append(f"{k}={have} (the profile says {want})")
    extra = sorted(k for k in startup if k.startswith(PROFILE_PREFIXES) and k not in profile_env)
    if extra:
        problems.append(f"{', '.join(extra)} set at start-up by {files}, not in the profile's [env]")
    n = sum(1 for k in seen if k.startswith(PROFILE_PREFIXES))
    if not problems:
        what = f"{len(profile_env)} [env] values as the profile says" if profile_env else "no profile [env] to compare"
        return Check("env", "ok", f"{n} NCCL_*/SGLANG_* variables; {what}", details=details)
    return Check("env", "warn", "; ".join(problems),
                 "make the profile's [env] and the interpreter agree (the profile is what reports record)",
                 details=details)


def check_traps(env: dict, launch_args: list[str], klass: str) -> Check:
    """Known bad settings: NCCL_ALGO=Tree with CUDA graphs, NCCL_P2P_DISABLE=1, multicast / NVLS."""
    graphs = "--disable-cuda-graph" not in launch_args
    pcie = klass != "nvlink"
    found: list[tuple[str, str, str]] = []  # (state, what, fix)
    algo = env.get("NCCL_ALGO", "")
    if re.search(r"(?i)\btree\b", algo) and not algo.startswith("^") and graphs:
        found.append(("fail" if pcie else "warn",
                      f"NCCL_ALGO={algo} with CUDA graphs: capture fails on the PCIe target ('NCCL error: invalid usage')",
                      "NCCL_ALGO=Ring"))
    if env.get("NCCL_P2P_DISABLE") == "1":
        found.append(("warn", "NCCL_P2P_DISABLE=1: NCCL goes through host memory and the custom allreduce kernels "
                      "cannot use P2P", "unset it unless p2p-copy names a pair that hangs"))
    nvls = env.get("NCCL_NVLS_ENABLE") == "1" or "--enable-nccl-nvls" in launch_args
    if nvls and pcie:
        found.append(("warn", "NVLS / multicast on (NCCL_NVLS_ENABLE=1 or --enable-nccl-nvls) without NVSwitch",
                      "NCCL_NVLS_ENABLE=0, drop --enable-nccl-nvls"))
    if "--enable-symm-mem" in launch_args and pcie:
        found.append(("warn", "--enable-symm-mem on PCIe: torch symmetric memory wedges without native P2P atomics "
                      "(vLLM #47979)", "drop --enable-symm-mem"))
    if not found:
        return Check("env-traps", "ok", f"none of the known traps (NCCL_ALGO={algo or 'default'}, "
                     f"CUDA graphs {'on' if graphs else 'off'})")
    state = "fail" if any(s == "fail" for s, _, _ in found) else "warn"
    return Check("env-traps", state, "; ".join(w for _, w, _ in found), "; ".join(f for _, _, f in found))


# ------------------------------------------------------------------ 3. driver and toolkits


def cuda_major(info: dict) -> tuple[int | None, str]:
    t = info.get("torch") or {}
    if not t.get("cuda"):
        return None, ""
    return int(str(t["cuda"]).split(".")[0]), f"torch {t['version']} of {info.get('executable')}"


def check_driver(info: dict, rows: list, exe: str) -> Check:
    major, why = cuda_major(info)
    return from_preflight(preflight.driver_verdict(major, why, rows, exe))


def check_nvcc(info: dict, rows: list, exe: str) -> Check:
    """flashinfer's JIT needs nvcc >= 12.8 (P5's PCIe-IPC module), >= 12.9 for P1 on SM12x: CUDA_HOME /
    PATH as the serving interpreter sees them. A warning, not a failure: only the P1 / P5 modes need it."""
    env = {k: v for k, v in (info.get("env") or {}).items() if k in ("CUDA_HOME", "PATH")}
    c = from_preflight(preflight.nvcc_verdict(rows, exe, env if env else None), fail_state="warn")
    if c.state == "ok":
        c.text += " (CUDA_HOME / PATH as the serving interpreter sees them)"
    return c


def check_jit(python: str, env: dict, arch: str, workdir: str | None, run: bool = True, recheck: bool = False,
              gpus: bool = True) -> Check:
    """The JIT kernels of the served sglang that include flashinfer's headers, built for the target's
    arch in the serving interpreter (sglpatch.pythonenv.jit_kernels, compile and link only; the verdict kept for
    the same tree, flashinfer, nvcc and arch unless recheck); a failure's fix is the command that
    restores the flashinfer set `--with-flashinfer` replaced (recorded in the workdir). Not run where
    the doctor exits 125 anyway (gpus False: no GPU visible, none held)."""
    if not run:
        return Check("jit-kernels", "skip", "not run (--no-jit)")
    if not gpus:
        return Check("jit-kernels", "skip", "not run: no GPU visible here, the doctor exits 125 anyway; "
                     "`python -m sglpatch.pythonenv.jit_kernels` checks the build alone")
    v = jit_kernels.run(python, arch, env, recheck=recheck)
    if v.state != "fail":
        return Check("jit-kernels", v.state, v.text, v.fix)
    from sglpatch.gpu.shared.series_side import flashinfer_way_back

    back = flashinfer_way_back(Path(workdir)) if workdir else None
    return Check("jit-kernels", "fail", v.text, f"the way back: {back}" if back else
                 "the flashinfer set it replaced is not recorded: rebuild the tree with the series (scripts/apply.sh "
                 "--with-flashinfer), or install the flashinfer-python the release pins",
                 data={k: v.data[k] for k in ("arch", "nvcc", "flashinfer") if k in v.data})


def check_shm(path: Path) -> Check:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("shm", "fail", f"{path}: {e.strerror}", "mount a tmpfs there (LXC: a /dev/shm mount entry)")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    text = f"{path}: {preflight.size(size)}, {preflight.size(free)} free"
    if size < SHM_FLOOR:
        return Check("shm", "fail", text + ": NCCL's shared-memory transport crashes in ncclShmOpen on a small "
                     "/dev/shm (Docker's 64 MiB default)", "give it >= 1 GiB (docker --shm-size / --ipc=host, "
                     "LXC: mount a larger tmpfs)")
    if free < size / 2:
        return Check("shm", "warn", text + ": more than half used", f"stale segments of crashed runs? `ls -la {path}`; "
                     "remove those no running process holds")
    return Check("shm", "ok", text)


def check_memlock(info: dict) -> Check:
    if info.get("error") or not info.get("memlock"):
        return Check("memlock", "skip", "the interpreter did not run")
    soft, hard = info["memlock"]
    if soft is None:
        return Check("memlock", "ok", "locked-memory limit unlimited")
    return Check("memlock", "warn", f"locked-memory limit {preflight.size(soft)} (hard "
                 f"{'unlimited' if hard is None else preflight.size(hard)}); SGLang's containers run unlimited, "
                 "NCCL's RDMA / IPC paths register locked memory",
                 "`ulimit -l unlimited` (LXC: lxc.prlimit.memlock = unlimited; docker: --ulimit memlock=-1, "
                 "as SGLang's docker guide)")


def meminfo(proc_root: Path) -> dict[str, int]:
    out = {}
    try:
        for line in (Path(proc_root) / "meminfo").read_text().splitlines():
            m = re.match(r"(\w+):\s+(\d+) kB", line)
            if m:
                out[m.group(1)] = int(m.group(2)) * 1024
    except OSError:
        pass
    return out


def check_build_jobs(info: dict, mem: dict[str, int]) -> Check:
    """Swap and cores: the MAX_JOBS a JIT / CUDA-extension build should run with."""
    cores = info.get("cpus_affinity") or info.get("cpu_count") or os.cpu_count() or 1
    swap = mem.get("SwapTotal")
    have = (info.get("env") or {}).get("MAX_JOBS")
    limit = cores if swap else min(cores, JOBS_NO_SWAP)
    swap_text = "no swap" if not swap else f"swap {preflight.size(swap)}"
    text = (f"{cores} cores, {swap_text}, RAM {preflight.size(mem.get('MemTotal', 0))}; "
            f"MAX_JOBS {have or 'unset'} as the interpreter sees it")
    jobs = int(have) if have and have.isdigit() else None
    if (jobs or cores) <= limit:
        return Check("build-jobs", "ok", text)
    reason = "without swap a build that runs out of RAM takes the box down" if not swap else "more jobs than cores"
    return Check("build-jobs", "warn", f"{text}: a build would run {jobs or cores} jobs; {reason}",
                 f"export MAX_JOBS={limit} (and build with -j{limit}) before a JIT or extension build")
