"""What an interpreter serves: which sglang it imports (file, version) and, when that is an
sglpatch workdir (<workdir>/python/sglang), the patches it carries; and a version as a tuple.
The server tier, its A/B run, `server.modes` and `sglpatch doctor` ask here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def version_tuple(v: str | None) -> tuple[int, ...]:
    """"0.5.10.post1" -> (0, 5, 10); "" -> ()."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(v or ""))
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


P5_MODULE = "srt/distributed/device_communicators/pcie_ipc_allreduce.py"  # P5's adapter (0.5.9 + the series)
UPSTREAM_MODULE = "srt/distributed/device_communicators/pcie_ipc_ar.py"  # sglang >= 0.5.21's own


B12X_SWITCH = "SGLANG_ENABLE_B12X_ALLREDUCE"  # P7: flashinfer's b12x one-shot allreduce + fused add-RMSNorm


def reads_switch(pkg: str | Path, name: str) -> bool:
    """Whether an sglang package folder's own sources (srt/**.py) read the switch `name`: P7's
    SGLANG_ENABLE_B12X_ALLREDUCE is nowhere in an sglang without P7, which would ignore it and serve
    NCCL.  Read from the files, nothing imported; standard library (the worker runs it too)."""
    srt = Path(pkg) / "srt"
    needle = name.encode()
    for f in sorted(srt.rglob("*.py")) if srt.is_dir() else []:
        try:
            if needle in f.read_bytes():
                return True
        except OSError:
            continue
    return False


def pcie_ipc_server(served: dict) -> str | None:
    """What in the served sglang turns PCIe-IPC on with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1: "P5"
    (the series' backport), "upstream" (0.5.21+'s pcie_ipc_ar.py), or None (neither)."""
    f = served.get("sglang_file")
    if not f:
        return None
    pkg = Path(f).parent
    if (pkg / UPSTREAM_MODULE).is_file() or version_tuple(served.get("sglang_version")) >= (0, 5, 22):
        return "upstream"  # 0.5.22+ serve it natively; the rebase drops P5 there (superseded)
    return "P5" if (pkg / P5_MODULE).is_file() else None


def imported_sglang(python: str, env: dict, project: Path) -> dict:
    """Which sglang the server's interpreter imports and, when it is an sglpatch workdir
    (<workdir>/python/sglang), the patches it carries (stack.carried / stack.status)."""
    code = "import sglang, sys; print(sglang.__file__); print(getattr(sglang, '__version__', '?'))"
    try:
        p = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"python": python, "error": f"cannot run {python}: {e}"}
    if p.returncode != 0:
        return _not_importing(python, env, "sglang does not import: " + (p.stderr.strip().splitlines() or ["?"])[-1])
    lines = p.stdout.strip().splitlines()
    file, version = Path(lines[-2]).resolve(), lines[-1]
    out = {"python": python, "sglang_file": str(file), "sglang_version": version}
    workdir = file.parents[2] if len(file.parents) > 2 else file.parent
    if not (workdir / ".git").exists():
        out["patches_note"] = f"{file} is not in an sglpatch workdir (<workdir>/python/sglang): patches unknown"
        return out
    out["workdir"] = str(workdir)
    try:
        if not (project / "series").is_file():
            raise RuntimeError(f"no sglpatch series in {project} (pass --project)")
        from sglpatch.gpu.shared.series_side import patches_of

        out.update(patches_of(project, workdir))
    except Exception as e:  # noqa: BLE001 — a record, not a verdict (GitPython may be absent on the box)
        out["patches_note"] = f"cannot read the workdir's patches: {type(e).__name__}: {e}"
    return out


def _not_importing(python: str, env: dict, error: str) -> dict:
    """sglang does not import. When it is installed and its own dependencies are what is missing,
    say so with the command that installs them (the cpu tier's), and name the tree (so what it
    carries, P5's adapter, can still be read from its files)."""
    from sglpatch.pythonenv import interpreter

    out = {"python": python, "error": error}
    st = interpreter.module_state(python, env=env)
    if st is None or not st.lacks_dependencies:
        return out
    tree = st.tree or "<the tree sglang is installed from>"
    out.update(missing=f"sglang {st.dist_version} is installed" + (f" (editable from {st.tree})" if st.tree else "")
               + f" but does not import with {python}: {interpreter.missing_summary(st)}",
               deps_command=interpreter.deps_command(python, tree, None, interpreter.find_uv()), sglang_version=st.dist_version)
    if st.tree and (Path(st.tree) / "sglang" / "__init__.py").is_file():
        out["sglang_file"] = str(Path(st.tree) / "sglang" / "__init__.py")
    return out
