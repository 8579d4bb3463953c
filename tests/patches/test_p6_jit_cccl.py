"""P6 (0006): every 0.5.9 JIT kernel that includes flashinfer headers builds for sm_120 with the
flashinfer of deps/flashinfer.toml, through the patched tree's own build call. Compile only, no GPU.

* The kernels are found in the patched tree: the csrc/include headers with `#include <flashinfer/`
  (today elementwise/rope.cuh) and the jit_kernel function whose load_jit call compiles each (the
  same set sglpatch.pythonenv.jit_kernels builds on the box).
* Each is built by calling that real function (rope.py _jit_apply_rope_pos_ids_cos_sin_cache_module
  -> load_jit -> tvm_ffi.cpp.load_inline -> ninja -> nvcc), with TVM_FFI_CUDA_ARCH_LIST=12.0 and a
  TVM_FFI_CACHE_DIR of this run, in a Python with torch and apache-tvm-ffi (the 0.5.23 test venv,
  or SGLPATCH_PATCHED_PYTHON on the target). The verdict is the object files of its build.ninja:
  a failed load of the module (no driver) does not count.
* flashinfer 0.7.2 is the 0.5.23 venv's own install (--no-deps, as test_p5_flashinfer_set uses
  it), else its registry wheel unpacked; 0.6.3 (0.5.9's pin) is its registry wheel, index-verified
  and cached like the sdists, unpacked. Stand-in: pynvml (NVML needs a GPU), empty, only where the
  builder lacks it.
* Cases: the series (0.7.2: builds, the bundled CCCL first), the series without P6 (rope.py as
  upstream has it, which no other patch touches; 0.7.2: nvcc's fastdiv.cuh error, no object file),
  and 0.6.3's headers with P6 (builds; no CCCL folder added).
  Skipped only without nvcc; on a tree without such kernels (0.5.10+) there is nothing to build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, cuda_home, venv_0523
from sglpatch.gpu.cpu.pytest_record import CannotRunHere
from sglpatch.pythonenv import jit_kernels
from sglpatch.series import read_patch, read_series

PROJECT = Path(os.environ.get("SGLPATCH_PROJECT") or ROOT)
P6 = PROJECT / "patches" / "0006-jit_kernel-flashinfer-bundled-CCCL-for-rope.patch"
OLD = "0.6.3"  # the flashinfer-python 0.5.9 pins (its pyproject.toml before P5's pin change)
ARCH = "12.0"  # the target's SM120
CCCL = ["data/cccl/cub", "data/cccl/libcudacxx/include", "data/cccl/thrust"]
NVCC = shutil.which("nvcc")

CHILD = r"""
import importlib, json, os, pathlib, sys
cache = pathlib.Path(os.environ["TVM_FFI_CACHE_DIR"])
out = []
for mod, fn in json.loads(sys.argv[1]):
    before = set(cache.iterdir()) if cache.is_dir() else set()
    err = None
    try:
        getattr(importlib.import_module(mod), fn)()
    except BaseException as e:
        err = f"{type(e).__name__}: {e}"
    new = sorted(set(cache.iterdir()) - before) if cache.is_dir() else []
    import flashinfer, sglang
    out.append({"kernel": f"{mod}.{fn}", "error": err, "dirs": [str(d) for d in new], "flashinfer": flashinfer.__version__,
                "flashinfer_dir": os.path.dirname(flashinfer.__file__), "sglang": sglang.__file__})
print("RESULT" + json.dumps(out))
"""


def flashinfer_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "deps" / "flashinfer.toml").read_text())["flashinfer"]["version"]


def tree_version(tree: Path) -> str:
    text = (tree / "python" / "sglang" / "_version.py").read_text()
    return re.search(r"__version__ = version = '([^']+)'", text).group(1)


def flashinfer_include_lines(tree: Path) -> set[str]:
    """The csrc/include files of the tree's jit_kernel with an `#include <flashinfer/...>` (grep)."""
    jk = tree / "python" / "sglang" / "jit_kernel"
    out = set()
    for sub in ("csrc", "include"):
        for p in (jk / sub).rglob("*"):
            if p.is_file() and re.search(r"^\s*#\s*include\s*[<\"]flashinfer/", p.read_text(errors="replace"), re.M):
                out.add(str(p.relative_to(jk / "csrc")) if sub == "csrc" else f"include/{p.relative_to(jk / sub)}")
    return out


@pytest.fixture(scope="module")
def kernels(patched_tree):
    if not NVCC:
        pytest.skip("nvcc not found on PATH: the JIT kernels cannot be compiled here")
    found = jit_kernels.discover(patched_tree / "python" / "sglang")
    if not found and not flashinfer_include_lines(patched_tree):
        pytest.skip(f"no JIT kernel of sglang {tree_version(patched_tree)} includes flashinfer headers: nothing to build")
    return found


@pytest.fixture(scope="module")
def builder() -> Path:
    """The Python that builds: SGLPATCH_PATCHED_PYTHON (the target's serving Python), else the
    0.5.23 test venv (torch, apache-tvm-ffi, flashinfer 0.7.2 --no-deps)."""
    py = Path(os.environ.get("SGLPATCH_PATCHED_PYTHON") or venv_0523())
    assert py.exists(), f"{py} missing: scripts/test.sh builds the 0.5.23 test venv (SGLPATCH_TEST_VENV_0523)"
    proc = subprocess.run([str(py), "-c", "import torch, tvm_ffi"], capture_output=True, text=True)
    if proc.returncode:  # what the Python under test lacks, not the code under test: no verdict (the cpu tier's 125)
        raise CannotRunHere(f"{py} cannot import torch and apache-tvm-ffi, which the JIT build needs: "
                            f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return py


def unpacked_flashinfer(version: str, dest: Path) -> Path:
    """flashinfer-python VERSION's registry wheel (index-verified, cached), its flashinfer/ unpacked under dest."""
    from sglpatch.upstream import artifacts

    _, whl = artifacts.fetch("flashinfer-python", version, "wheel")
    with zipfile.ZipFile(whl) as zf:
        zf.extractall(dest, [n for n in zf.namelist() if n.startswith("flashinfer/")])
    return dest


ROPE = "python/sglang/jit_kernel/rope.py"


def upstream_rope(tree: Path) -> bytes:
    """rope.py as the series without P6 leaves it: upstream's (no other patch touches it), from the
    workdir's `upstream` branch, else (a mutant's copy is no git repo) from the pinned sdist."""
    others = [e for e in read_series(PROJECT).entries if e.name != P6.name]
    assert not [e.name for e in others if ROPE in read_patch(PROJECT, e).files]
    if (tree / ".git").exists():
        return subprocess.run(["git", "show", f"upstream:{ROPE}"], cwd=tree, capture_output=True, check=True).stdout
    import tarfile

    from sglpatch.upstream import artifacts
    from sglpatch.upstream.pin import read_lock

    lock = read_lock(PROJECT)
    with tarfile.open(artifacts.fetch_sdist(lock)) as tf:
        return tf.extractfile(f"sglang-{lock.version}/{ROPE.removeprefix('python/')}").read()


def without_p6(tree: Path, dest: Path) -> Path:
    """The patched tree without P6: python/ mirrored by symlinks, but jit_kernel/rope.py upstream's."""
    src = tree / "python"
    for part in ("", "sglang", "sglang/jit_kernel"):
        (dest / "python" / part).mkdir(parents=True, exist_ok=True)
        nxt = {"": "sglang", "sglang": "jit_kernel", "sglang/jit_kernel": "rope.py"}[part]
        for e in (src / part).iterdir():
            if e.name != nxt:
                (dest / "python" / part / e.name).symlink_to(e)
    (dest / ROPE).write_bytes(upstream_rope(tree))
    return dest


@pytest.fixture(scope="module")
def build(kernels, builder, patched_tree, tmp_path_factory):
    """build(variant, flashinfer version) -> one record per kernel, built once per run."""
    top = tmp_path_factory.mktemp("p6")
    stub = top / "stub"
    stub.mkdir()
    if subprocess.run([str(builder), "-c", "import pynvml"], capture_output=True).returncode != 0:
        (stub / "pynvml.py").write_text("# stand-in: NVML needs a GPU; nothing here calls it\n")
    have = subprocess.run([str(builder), "-c", "import importlib.metadata as m; print(m.version('flashinfer-python'))"],
                          capture_output=True, text=True).stdout.strip()
    done: dict = {}

    def run(variant: str, version: str) -> list[dict]:
        if (variant, version) in done:
            return done[variant, version]
        tree = patched_tree if variant == "series" else without_p6(patched_tree, top / f"tree-{variant}")
        paths = [str(stub)]
        if have != version:
            paths.append(str(unpacked_flashinfer(version, top / f"flashinfer-{version}")))
        cache = top / f"cache-{variant}-{version}"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=":".join([*paths, str(tree / "python")]), TVM_FFI_CUDA_ARCH_LIST=ARCH,
                   TVM_FFI_CACHE_DIR=str(cache), CUDA_HOME=cuda_home(), CUDA_VISIBLE_DEVICES="")
        which = json.dumps([[k["module"], k["function"]] for k in kernels])
        proc = subprocess.run([str(builder), "-c", CHILD, which], capture_output=True, text=True, env=env, timeout=900, cwd=top)
        assert proc.returncode == 0, proc.stderr[-3000:]
        recs = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[6:])
        for r in recs:
            ninja = "".join((Path(d) / "build.ninja").read_text() for d in r["dirs"] if (Path(d) / "build.ninja").is_file())
            r["objects"] = [(Path(d) / o) for d in r["dirs"] for o in re.findall(r"^build (\S+\.o):", ninja, re.M)]
            r["includes"] = re.findall(r"-I(\S+)", ninja.split("cuda_cflags = ", 1)[-1].splitlines()[0]) if ninja else []
            r["tree"] = str(tree)
        done[variant, version] = recs
        return recs

    return run


def built(rec: dict) -> bool:
    """Every object file build.ninja names was built (the verdict; a load without a driver may fail)."""
    return bool(rec["objects"]) and all(o.is_file() for o in rec["objects"])


def test_the_kernels_that_include_flashinfer_are_the_ones_jitcheck_builds(kernels, patched_tree):
    """The grep and sglpatch.pythonenv.jit_kernels.discover agree; each builder is called without arguments."""
    direct = flashinfer_include_lines(patched_tree)
    assert {d for d in direct if not d.startswith("include/")} <= {k["file"] for k in kernels}, (direct, kernels)
    assert all(k["args"] == 0 for k in kernels), kernels
    if tree_version(patched_tree) == "0.5.9":
        assert direct == {"elementwise/rope.cuh"}
        assert [(k["module"], k["function"]) for k in kernels] == [("sglang.jit_kernel.rope", "_jit_apply_rope_pos_ids_cos_sin_cache_module")]


@pytest.mark.slow  # a whole nvcc build of each kernel (20+ CPU-s): --quick leaves it out
def test_with_p6_each_kernel_builds_for_sm120_with_the_sets_flashinfer(build):
    version = flashinfer_version()
    for r in build("series", version):
        assert r["flashinfer"] == version and r["sglang"].startswith(r["tree"]), r
        assert built(r), f"{r['kernel']} did not build: {r['error']}"
        assert r["error"] is None or "ninja exited" not in r["error"], r["error"]  # only a load may fail
        fi = Path(r["flashinfer_dir"]).resolve()
        cccl = [str(fi / c) for c in CCCL]
        inc = [str(Path(i).resolve()) for i in r["includes"]]
        assert all(c in inc for c in cccl), inc  # the bundled CCCL, all three, ahead of data/include
        assert max(inc.index(c) for c in cccl) < inc.index(str(fi / "data" / "include")), inc
        assert any(o.name == "cuda_0.o" for o in r["objects"]) and "-gencode=arch=compute_120,code=sm_120" in \
            (Path(r["dirs"][0]) / "build.ninja").read_text()


def test_without_p6_the_sets_flashinfer_fails_on_fastdiv(build):
    """The series minus P6 (the fault this patch fixes): nvcc stops in flashinfer's fastdiv.cuh."""
    for r in build("minus-p6", flashinfer_version()):
        assert not built(r), r
        assert r["error"] and "fastdiv.cuh(39): error: qualified name is not allowed" in r["error"], r["error"]
        assert not any(i.endswith(tuple(CCCL)) for i in r["includes"]), r["includes"]


@pytest.mark.slow  # a whole nvcc build of each kernel (20+ CPU-s): --quick leaves it out
def test_with_p6_flashinfer_0_6_3_headers_build_as_before(build):
    """0.5.9's own flashinfer has no data/cccl: the include list is what it was, and it builds."""
    for r in build("series", OLD):
        assert r["flashinfer"] == OLD and not (Path(r["flashinfer_dir"]) / "data" / "cccl").exists()
        assert built(r), f"{r['kernel']} did not build with flashinfer {OLD}: {r['error']}"
        assert not any(i.endswith(tuple(CCCL)) for i in r["includes"]) and any(i.endswith("data/include") for i in r["includes"])
