"""What another Python interpreter is and has: a --python checked before any work, whether it
may be installed into (PEP 668), the sglang it imports, which of that sglang's own declared
dependencies it lacks, and the command that installs them.

Standard library only (packaging when present), so that the GPU suite can use it on a box
without the series side's dependencies. The interpreter is asked in a subprocess; nothing is
imported from it into this process.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch import exitcodes
from sglpatch.errors import SglpatchError

TOOL_VENV_STAMP = ".sglpatch-tool"  # scripts/lib.sh writes it last into the tool's own venv

_FACTS = r"""
import json, os, sys, sysconfig
stdlib = sysconfig.get_paths().get("stdlib") or ""
print(json.dumps({"version": "%d.%d.%d" % sys.version_info[:3], "venv": sys.prefix != sys.base_prefix,
                  "managed": os.path.isfile(os.path.join(stdlib, "EXTERNALLY-MANAGED"))}))
"""

# what `import MODULE` does in that interpreter, and what its distribution declares it needs
_MODULE = r"""
import importlib, importlib.util, json, os, platform, sys
name = sys.argv[1]
try:
    found = importlib.util.find_spec(name) is not None
except Exception:
    found = True  # there, in some form: the import below says what is wrong
out = {"ok": False, "found": found}
try:
    mod = importlib.import_module(name)
    out.update(ok=True, file=getattr(mod, "__file__", "") or "", version=str(getattr(mod, "__version__", "")))
except BaseException as e:  # a patch can break the import in any way; say which
    out.update(error="%s: %s" % (type(e).__name__, e), missing=getattr(e, "name", None) if isinstance(e, ImportError) else None)
try:
    import importlib.metadata as md
    d = md.distribution(name)
    url = json.loads(d.read_text("direct_url.json") or "{}").get("url")
    out.update(dist_version=d.version, requires=d.requires or [], url=url,
               installed={(x.metadata["Name"] or ""): x.version for x in md.distributions()})
except Exception:
    out.update(requires=None)
iv = sys.implementation.version
iver = "%d.%d.%d" % (iv.major, iv.minor, iv.micro) + ("" if iv.releaselevel == "final" else iv.releaselevel[0] + str(iv.serial))
out["env"] = {"implementation_name": sys.implementation.name, "implementation_version": iver, "os_name": os.name,
              "platform_machine": platform.machine(), "platform_release": platform.release(),
              "platform_system": platform.system(), "platform_version": platform.version(),
              "python_full_version": platform.python_version(), "platform_python_implementation": platform.python_implementation(),
              "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}
sys.stdout.write("\n" + json.dumps(out) + "\n")
"""


def _ask(python: str, code: str, timeout: float, args: tuple[str, ...] = (), env: dict | None = None) -> dict | None:
    try:
        proc = subprocess.run([python, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              timeout=timeout, cwd="/", env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except json.JSONDecodeError:
        return None


def check_python(path: str, flag: str = "--python") -> dict:
    """The facts of the interpreter at path ({version, venv, managed}); a usage error (exit 2),
    one line, when it is not a runnable Python."""
    exe = os.path.expanduser(path)
    found = shutil.which(exe) if os.sep not in exe else (exe if os.path.exists(exe) else None)
    if not found:
        raise SglpatchError(f"{flag} {path}: no such file", exitcodes.USAGE)
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        raise SglpatchError(f"{flag} {path}: not an executable file", exitcodes.USAGE)
    facts = _ask(found, _FACTS, timeout=60)
    if facts is None:
        raise SglpatchError(f"{flag} {path}: does not run as a Python interpreter", exitcodes.USAGE)
    return facts


def refuse_system_python(python: str, facts: dict) -> None:
    """Installing into a distribution's own Python fails with PEP 668's externally-managed-environment:
    say so first, with the ways that work."""
    if facts.get("managed") and not facts.get("venv"):
        raise SglpatchError(
            f"{python} is the system's Python (externally managed, PEP 668): nothing is installed into it; "
            "pass a venv's python (--python VENV/bin/python), build a new one with --venv NEWDIR, or use --no-install",
            exitcodes.USAGE,
        )


@dataclass
class ModuleState:
    """What `import MODULE` (sglang) gives in an interpreter."""

    module: str
    ok: bool
    file: str = ""
    version: str = ""
    error: str = ""
    missing_module: str | None = None  # the module an ImportError names
    found: bool = True  # the module is there to import (it may still fail)
    dist_version: str | None = None  # the installed sglang distribution (also when the import fails)
    tree: str | None = None  # where an editable install points (direct_url.json)
    missing: list[str] = field(default_factory=list)  # its declared dependencies not installed there
    declared: int = 0

    @property
    def not_installed(self) -> bool:
        return not self.ok and not self.found

    @property
    def lacks_dependencies(self) -> bool:
        """The import fails and the environment lacks what the module declares: not the module's own code's fault
        (unless the import fails inside the module itself, e.g. a patch that imports a name that is gone)."""
        top = (self.missing_module or "").split(".")[0]
        return not self.ok and bool(self.missing) and top != self.module


def module_state(python: str, module: str = "sglang", timeout: float = 300, env: dict | None = None) -> ModuleState | None:
    """None when python does not run at all."""
    out = _ask(python, _MODULE, timeout, (module,), env)
    if out is None:
        return None
    st = ModuleState(module, bool(out.get("ok")), out.get("file", ""), out.get("version", ""), out.get("error", ""),
                     out.get("missing"), bool(out.get("found", True)), out.get("dist_version"))
    url = out.get("url") or ""
    if url.startswith("file://"):
        st.tree = url[len("file://"):]
    if out.get("requires") is not None:
        st.declared, st.missing = missing_requirements(out["requires"], out.get("installed", {}), out.get("env", {}))
    return st


def norm_name(name: str) -> str:
    """A distribution name as PEP 503 compares it: "Flashinfer_Python" -> "flashinfer-python"."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


_DISTRIBUTIONS = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"


def installed_distributions(python: str, timeout: float = 120) -> dict[str, str] | None:
    """{normalized name: version} of what python has installed (read only, nothing of it imported
    here), or None when python cannot say."""
    out = _ask(python, _DISTRIBUTIONS, timeout)
    return None if out is None else {norm_name(k): v for k, v in out.items() if k}


def missing_requirements(requires: list[str], installed: dict[str, str], env: dict) -> tuple[int, list[str]]:
    """(how many requirements apply to that interpreter, the names of those not satisfied)."""
    have = {norm_name(k): v for k, v in installed.items()}
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # names only, markers with extras skipped
        names = [r.split(";")[0].strip() for r in requires if "extra" not in r.partition(";")[2]]
        import re

        names = [re.split(r"[\s\[<>=!~(]", n, maxsplit=1)[0] for n in names if n]
        return len(names), [n for n in names if norm_name(n) not in have]
    count, missing = 0, []
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker and not req.marker.evaluate(dict(env, extra="")):
            continue
        count += 1
        got = have.get(norm_name(req.name))
        if got is None or (req.specifier and not req.specifier.contains(got, prereleases=True)):
            missing.append(req.name)
    return count, missing


P5_ADAPTER = "srt/distributed/device_communicators/pcie_ipc_allreduce.py"  # P5's module, under the tree's sglang/


def deps_command(python: str, tree: str, version: str | None, uv: str | None) -> str:
    """The command that installs the sglang tree's own declared dependencies into python: the same
    editable install apply made, without --no-deps (the tree's pyproject.toml pins the release's).

    A tree that carries P5 pins the series' flashinfer-python (0.7.2, deps/flashinfer.toml) instead
    of the release's: that install brings it in, but removes nothing of the release's flashinfer set
    (flashinfer-cubin, flashinfer-jit-cache, quack-kernels), runs neither pip check nor the JIT check
    and records no way back. The command then goes on with the `apply --with-flashinfer` that does
    (after the install: --with-flashinfer refuses a venv without torch)."""
    env = f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG={version} " if version else ""
    if uv:
        cmd = f"{env}{shlex.quote(uv)} pip install --python {shlex.quote(python)} -e {shlex.quote(tree)}"
    else:
        cmd = f"{env}{shlex.quote(python)} -m pip install -e {shlex.quote(tree)}"
    if (Path(tree) / "sglang" / P5_ADAPTER).is_file():
        cmd += f" && sglpatch apply --with-flashinfer --python {shlex.quote(python)} --workdir {shlex.quote(str(Path(tree).parent))}"
    return cmd


def find_uv() -> str | None:
    found = shutil.which("uv")
    if found:
        return found
    local = Path.home() / ".local" / "bin" / "uv"
    return str(local) if local.is_file() and os.access(local, os.X_OK) else None


def missing_summary(st: ModuleState, shown: int = 6) -> str:
    first = (st.missing_module or "").split(".")[0]
    ordered = sorted(st.missing, key=lambda n: norm_name(n) != norm_name(first))  # the one the import failed on first
    names = ordered[:shown]
    more = f" and {len(st.missing) - shown} more" if len(st.missing) > shown else ""
    how_many = "none of its" if len(st.missing) == st.declared else f"{len(st.missing)} of its"
    verb = "is" if how_many == "none of its" else "are not"
    failed = f"{st.error}; " if st.error else ""
    return f"{failed}{how_many} {st.declared} declared dependencies {verb} installed ({', '.join(names)}{more} missing)"


_PROBE = ("import importlib.metadata as m, importlib.util as u, sys\n"
          "try:\n    v = m.version('sglang')\nexcept Exception:\n    v = ''\n"
          "s = u.find_spec('sglang')\n"
          "print(v); print(s.origin if s and s.origin else ''); print(f'cp{sys.version_info[0]}{sys.version_info[1]}')\n")


def probe(python: str) -> tuple[str, str, str] | None:
    """(sglang version installed, where it imports from, cpXY) of python, read without importing
    sglang; None when it does not run."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, cwd="/").stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out[0], out[1], out[2]) if len(out) == 3 else None


def _norm(v: str) -> str:
    try:
        from packaging.version import Version

        return str(Version(v))
    except Exception:
        return v


def same_version(a: str, b: str) -> bool:
    """Two version strings name the same release (PEP 440: 0.5.10.post1 == 0.5.10post1)."""
    return _norm(a) == _norm(b)
