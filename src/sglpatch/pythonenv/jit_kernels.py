"""Build, in the serving Python, every JIT kernel of the installed SGLang that includes flashinfer's
headers, the way SGLang builds it at its first CUDA forward: compiled and linked, never run, so no GPU needed.

0.5.9 builds such a kernel (jit_kernel/rope.py, elementwise/rope.cuh includes flashinfer/pos_enc.cuh)
against the installed flashinfer's headers; flashinfer 0.7.2's need a newer CCCL than CUDA 12.8's
(P6 puts flashinfer's bundled one first). A header that does not compile kills the server at its
first forward, long after the load. `sglpatch apply --with-flashinfer` runs this after installing
the set, `sglpatch doctor` as its `jit-kernels` check; `python -m sglpatch.pythonenv.jit_kernels --python PY`
runs it alone (exit 0 built, 1 a kernel does not build, 125 cannot check here).

How: this file, run by PY (`PY -c CHILD`: runpy, its folder kept off sys.path; standard library
only: PY may lack sglpatch), imports PY's sglang, finds the kernels (`discover`: csrc/include headers that include
<flashinfer/...>, directly or through another header, and the jit_kernel functions whose load_jit
call names one) and calls each one's own build function, with TVM_FFI_CUDA_ARCH_LIST set to the
target's architecture and TVM_FFI_CACHE_DIR to a temporary folder (removed after). A kernel passes
when every object file of its build.ninja was built and the module linked; a failed load (no
driver) does not fail it. A build that fails is named with its first nvcc `error:` line. A kernel's
module that does not import, or objects that all compiled but did not link, are "not checked" (exit
125) with the fix that fits: no verdict on the build. Without CUDA_HOME the build gets the toolkit of
the nvcc on PATH (`toolkit_root`: where a wrapper script such as /usr/local/bin/nvcc leads; tvm_ffi
would take the folder above the script and not find libcudart). A pass or a "does not build" is kept
(sglpatch.pythonenv.jit_cache) for the tree, flashinfer, nvcc and arch; --recheck-jit builds again.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ARCH = "12.0"  # the target box's SM120 (8x RTX PRO 6000); a profile's [target] cuda_arch replaces it
INCLUDES_FLASHINFER = re.compile(r'^\s*#\s*include\s*[<"]flashinfer/', re.M)
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
SOURCES = (".cuh", ".cu", ".h", ".hpp", ".cpp")
TIMEOUT = 1200.0  # seconds for the whole child: one nvcc run per kernel, ~20 s each on a free core


def discover(sglang_dir: Path) -> list[dict]:
    """The kernels of sglang_dir/jit_kernel that include flashinfer headers: one dict per build
    function (module, function, file: the csrc file it compiles, args: the arguments it needs)."""
    jk = Path(sglang_dir) / "jit_kernel"
    if not (jk / "csrc").is_dir():
        return []
    texts = {}
    for sub in ("csrc", "include"):
        for p in sorted((jk / sub).rglob("*")):
            if p.suffix in SOURCES and p.is_file():
                texts[p] = p.read_text(errors="replace")

    def rel(p: Path) -> str:
        return str(p.relative_to(jk / ("csrc" if p.is_relative_to(jk / "csrc") else "include")))

    tainted = {p for p, t in texts.items() if INCLUDES_FLASHINFER.search(t)}
    while True:  # and every header that includes one of them (by its path under csrc/ or include/)
        names = {rel(p) for p in tainted}
        more = {p for p, t in texts.items() if p not in tainted
                and any(n in names or any(n.endswith("/" + m) for m in names) for n in INCLUDE.findall(t))}
        if not more:
            break
        tainted |= more
    wanted = {str(p.relative_to(jk / "csrc")) for p in tainted if p.is_relative_to(jk / "csrc")}
    out = []
    for py in sorted(jk.glob("*.py")):
        try:
            tree = ast.parse(py.read_text(errors="replace"))
        except SyntaxError:
            continue
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "load_jit"):
                for kw in call.keywords:
                    if kw.arg in ("cuda_files", "cpp_files") and isinstance(kw.value, ast.List):
                        for f in (e.value for e in kw.value.elts if isinstance(e, ast.Constant)):
                            if f in wanted:
                                out.append({"module": f"sglang.jit_kernel.{py.stem}", "function": fn.name, "file": f,
                                            "args": len(fn.args.args) - len(fn.args.defaults)})
    return out


# ------------------------------------------------------------------ the child (run by the serving Python)


def _objects(build_dir: Path) -> tuple[list[str], list[str], bool]:
    """(object files build.ninja names, those built, whether the linked module is there)."""
    ninja = build_dir / "build.ninja"
    text = ninja.read_text() if ninja.is_file() else ""
    objs = re.findall(r"^build (\S+\.o):", text, re.M)
    so = re.findall(r"^build (\S+\.so):", text, re.M)
    return objs, [o for o in objs if (build_dir / o).is_file()], bool(so) and all((build_dir / s).is_file() for s in so)


def first_error(text: str) -> str:
    """nvcc's first `file(line): error: ...` (file without its folder), else the first line naming an
    error, else the last line."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    for pat in (r"\(\d+\): (?:catastrophic )?error", r"cannot find|undefined reference|No such file", r"\berror\b"):
        hit = next((ln for ln in lines if re.search(pat, ln)), None)
        if hit:
            return re.sub(r"^\S*/(?=[^/\s]+\(\d+\):)", "", hit)[:300]
    return (lines[-1] if lines else "no output")[:300]


# run as `PY -c CHILD`: this file's folder never goes on sys.path (sglpatch/bisect would shadow bisect)
CHILD = "import runpy, sys; sys.argv = ['jitcheck', '--child']; runpy.run_path({file!r}, run_name='__main__')"


def _child() -> int:
    import importlib

    out: dict = {"kernels": []}
    try:
        import sglang

        out["sglang"], out["version"] = sglang.__file__, getattr(sglang, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        out["error"] = f"sglang does not import: {type(e).__name__}: {e}"
        print("JITCHECK" + json.dumps(out))
        return 0
    try:
        import tvm_ffi  # noqa: F401
    except Exception as e:  # noqa: BLE001
        out["error"] = f"apache-tvm-ffi does not import ({type(e).__name__}: {e}); SGLang's JIT kernels need it"
    cache = Path(os.environ["TVM_FFI_CACHE_DIR"])
    out["layout"] = (Path(sglang.__file__).parent / "jit_kernel" / "csrc").is_dir()
    for k in ([] if "error" in out else discover(Path(sglang.__file__).parent)):
        rec = dict(k, state="failed", error="", objects=[], built=[], linked=False, loaded=False, includes=[])
        before = set(cache.iterdir()) if cache.is_dir() else set()
        if k["args"]:
            rec.update(state="unchecked", error=f"{k['function']} takes {k['args']} argument(s)")
        else:
            try:
                build = getattr(importlib.import_module(k["module"]), k["function"])
            except BaseException as e:  # noqa: BLE001 — nothing built: no verdict on the build
                build = None
                rec.update(state="unimportable", error=f"{type(e).__name__}: {e}")
            try:
                if build is not None:
                    build()
                    rec["loaded"] = True
            except BaseException as e:  # noqa: BLE001 — a failed build is a verdict, not a crash
                rec["error"] = f"{type(e).__name__}: {e}"
        for d in sorted(set(cache.iterdir()) - before if cache.is_dir() else []):
            objs, built, linked = _objects(d)
            rec["objects"] += objs
            rec["built"] += built
            rec["linked"] = linked
            ninja = (d / "build.ninja").read_text() if (d / "build.ninja").is_file() else ""
            rec["includes"] = sorted(set(re.findall(r"-I(\S*flashinfer\S*)", ninja)))
        if rec["state"] == "failed" and rec["objects"] and rec["built"] == rec["objects"] and rec["linked"]:
            rec["state"] = "built"
        fi = sys.modules.get("flashinfer")
        if fi is not None:
            out["flashinfer"] = getattr(fi, "__version__", None)
        out["kernels"].append(rec)
    print("JITCHECK" + json.dumps(out))
    return 0


# ------------------------------------------------------------------ the parent


@dataclass
class Verdict:
    state: str  # ok | fail | skip (skip: cannot be checked here)
    text: str
    data: dict = field(default_factory=dict)
    fix: str = ""  # for a skip: what makes the check possible

    def line(self, way_back: str | None = None) -> str:
        """The one line; for a failure given way_back, with the command that restores the previous
        flashinfer set ("": not recorded)."""
        back = f"; the way back: {way_back or WAY_BACK_UNKNOWN}" if self.state == "fail" and way_back is not None else ""
        return f"jit-kernels: {self.text}{back}" + (f"; fix: {self.fix}" if self.fix else "")


WAY_BACK_UNKNOWN = ("not recorded (`sglpatch apply --with-flashinfer` records the flashinfer set it replaces); "
                    "rebuild the tree with the series: scripts/apply.sh --with-flashinfer")


def sm(arch: str) -> str:
    return "sm_" + arch.replace(".", "")


def nvcc_of(env: dict) -> str | None:
    """The nvcc tvm_ffi would run: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        p = Path(home) / "bin" / "nvcc"
        return str(p) if p.is_file() else None
    return shutil.which("nvcc", path=env.get("PATH", os.defpath))


def toolkit_root(nvcc: str) -> str | None:
    """The CUDA toolkit nvcc runs from (nvcc's own _HERE_, where a wrapper script leads; else the folder
    above where nvcc really is), when its lib64 holds the runtime library; None otherwise."""
    try:
        p = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-E", os.devnull], capture_output=True, text=True, errors="replace", timeout=60)
        here = re.search(r"^#\$ _HERE_=(.+)$", p.stdout + p.stderr, re.M)
    except (OSError, subprocess.SubprocessError):
        here = None
    for cand in ([Path(here.group(1).strip()).parent] if here else []) + [Path(os.path.realpath(nvcc)).parents[1]]:
        if (cand / "bin" / "nvcc").is_file() and any((cand / "lib64").glob("libcudart.so*")):
            return str(cand.resolve())
    return None


KEPT = " (kept from {when}; --recheck-jit checks again)"


def run(python: str, arch: str = ARCH, env: dict | None = None, timeout: float = TIMEOUT, recheck: bool = False,
        on_build=None) -> Verdict:
    """Build the flashinfer-including JIT kernels of python's sglang for arch; never raises. Without
    CUDA_HOME the build gets the toolkit of the nvcc on PATH (tvm_ffi would take the folder above a
    wrapper script). A pass or a "does not build" is kept (sglpatch.pythonenv.jit_cache) and given
    again for the same key unless recheck (or SGLPATCH_RECHECK_JIT=1); on_build() runs before a build."""
    from sglpatch.pythonenv import jit_cache

    env = dict(os.environ if env is None else env)
    nvcc = nvcc_of(env)
    if not nvcc:
        return Verdict("skip", "not checked: no nvcc ($CUDA_HOME/bin or PATH); SGLang's JIT kernels need one "
                       "at the first forward")
    if not (env.get("CUDA_HOME") or env.get("CUDA_PATH")):
        root = toolkit_root(nvcc)
        if root:
            env["CUDA_HOME"], nvcc = root, str(Path(root) / "bin" / "nvcc")
    try:
        ver = re.search(r"release (\d+\.\d+)", subprocess.run([nvcc, "--version"], capture_output=True, text=True, errors="replace",
                                                              timeout=60).stdout)
    except (OSError, subprocess.SubprocessError):
        ver = None
    release = ver.group(1) if ver else "?"
    key = jit_cache.key(python, arch, nvcc, release, env)
    kept = jit_cache.get(key) if key and not (recheck or jit_cache.recheck_asked()) else None
    if kept:
        return Verdict(kept["state"], kept["text"] + KEPT.format(when=jit_cache.when(kept)), dict(kept.get("data") or {}, kept=True))
    if on_build:
        on_build()
    v = _build(python, arch, env, timeout, nvcc, release)
    if key and v.state in jit_cache.STATES:
        jit_cache.put(key, v.state, v.text, {k: v.data[k] for k in ("arch", "nvcc", "flashinfer") if k in v.data})
    return v


def _build(python: str, arch: str, env: dict, timeout: float, nvcc: str, release: str) -> Verdict:
    tool = f"nvcc {release}"
    with tempfile.TemporaryDirectory(prefix="sglpatch-jitcheck-") as tmp:
        env.update(TVM_FFI_CUDA_ARCH_LIST=arch, TVM_FFI_CACHE_DIR=tmp, CUDA_VISIBLE_DEVICES="")
        try:
            p = subprocess.run([python, "-c", CHILD.format(file=os.path.abspath(__file__))], env=env, capture_output=True,
                               text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL, cwd=tmp)
        except (OSError, subprocess.SubprocessError) as e:
            return Verdict("skip", f"not checked: cannot run {python}: {e}")
    got = next((ln[8:] for ln in reversed(p.stdout.splitlines()) if ln.startswith("JITCHECK")), None)
    if got is None:
        tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return Verdict("skip", f"not checked: {python} could not run the check: {tail[:300]}")
    data = dict(json.loads(got), python=python, arch=arch, nvcc=nvcc)
    if data.get("error"):
        return Verdict("skip", f"not checked in {python}: {data['error'][:300]}", data)
    ks = data["kernels"]
    fi = f"flashinfer-python {data.get('flashinfer') or '?'}"
    if not data.get("layout"):
        return Verdict("skip", f"not checked: sglang {data.get('version')} keeps its JIT kernels elsewhere (no "
                       "jit_kernel/csrc, 0.5.9's layout)", data)
    if not ks:
        return Verdict("skip", f"nothing to build: no jit_kernel header of sglang {data.get('version')} includes "
                       "flashinfer's", data)
    where = f"for {sm(arch)} with {fi} and {tool}"
    name = lambda k: f"{k['module'].rsplit('.', 1)[-1]} ({k['module']}.{k['function']})"  # noqa: E731
    failed = [k for k in ks if k["state"] == "failed"]
    unlinked = [k for k in failed if k["objects"] and k["built"] == k["objects"] and not k["linked"]]
    bad = [k for k in failed if k not in unlinked]
    if bad:
        k = bad[0]
        cause = first_error(k["error"]) if k["error"] else "no error, but not every object file was built"
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return Verdict("fail", f"{name(k)}{more} does not build {where}: {cause}", data)
    gone = [k for k in ks if k["state"] == "unimportable"]
    if gone:  # nothing built: no verdict on the build, and no flashinfer set to take back
        return Verdict("skip", f"not checked: {gone[0]['module']} does not import in {python}: {gone[0]['error'][:300]}", data,
                       _import_fix(python, data, gone[0]["error"]))
    if unlinked:  # every object compiled: the toolkit's link step failed, no verdict on the kernels
        home = env.get("CUDA_HOME") or env.get("CUDA_PATH") or str(Path(nvcc).parents[1])
        cause = first_error(unlinked[0]["error"]) if unlinked[0]["error"] else "the module was not linked"
        fix = (f"set CUDA_HOME to the CUDA toolkit of {nvcc} (the folder whose lib64 holds libcudart.so; {home} has none)"
               if "cudart" in cause and not any((Path(home) / "lib64").glob("libcudart.so*")) else
               f"check the toolkit's link step ({home}: CUDA_HOME, the host compiler)")
        return Verdict("skip", f"not checked: {name(unlinked[0])} compiled {where} but did not link: {cause}", data, fix)
    built = [k for k in ks if k["state"] == "built"]
    unchecked = [k for k in ks if k["state"] == "unchecked"]
    load = "" if all(k["loaded"] for k in built) else f"; not loaded here: {first_error(next(k['error'] for k in built if not k['loaded']))}"
    text = f"{', '.join(name(k) for k in built)} built {where} (compile and link only, no GPU){load}"
    if unchecked:
        text += f"; not built (its builder takes arguments): {', '.join(name(k) for k in unchecked)}"
    return Verdict("ok", text, data)


def _import_fix(python: str, data: dict, error: str) -> str:
    """What makes the kernel's module import: sglang's declared dependencies (from its tree, when it is
    one), else the package the import names."""
    from sglpatch.pythonenv.interpreter import deps_command, find_uv

    tree = Path(data["sglang"]).parents[1] if data.get("sglang") else None
    if tree and (tree / "pyproject.toml").is_file():
        return f"install sglang's own dependencies into {python}: {deps_command(python, str(tree), data.get('version'), find_uv())}"
    missing = re.search(r"No module named '([^']+)'", error)
    return f"install the package that provides {missing.group(1).split('.')[0]!r} into {python}" if missing else \
        f"install what the import lacks into {python}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from sglpatch import exitcodes

    p = argparse.ArgumentParser(prog="python -m sglpatch.pythonenv.jit_kernels", description=__doc__.split("\n\n")[0],
                                epilog=exitcodes.epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable, help="the serving interpreter (default: this one)")
    p.add_argument("--arch", default=ARCH, help=f"TVM_FFI_CUDA_ARCH_LIST, the target's architecture (default: {ARCH})")
    p.add_argument("--way-back", metavar="CMD", help="the command that restores the previous flashinfer set, named on a failure")
    p.add_argument("--recheck-jit", action="store_true", help="build again, not the verdict kept for this tree, flashinfer, nvcc "
                   "and arch (also SGLPATCH_RECHECK_JIT=1)")
    a = p.parse_args(argv)
    v = run(a.python, a.arch, recheck=a.recheck_jit)
    print(v.line(a.way_back))
    return {"ok": exitcodes.OK, "fail": exitcodes.ERROR}.get(v.state, exitcodes.CANNOT_RUN)


if __name__ == "__main__":
    sys.exit(_child() if sys.argv[1:] == ["--child"] else main())
