"""Every "Rerun" recipe of results/*/README.md works as written from a fresh clone (issue 51).

The recipe's local commands (`PYTHON=... bash results/.../prepare.sh`) run in a fresh clone of this
checkout (tests/userenv.py's `fresh_clone`, `.venv` the test venv, the tests' sglpatch cache), once
each, in the order the READMEs give them. Then: every script and path the commands name exists;
what they `carry=[...]` exists and fits a device call's 64 MiB; the kits hold exactly what
tests/gpu/p6_rope/run_rope.sh and tests/gpu/p5_edges/run_edges.sh read (their tarballs' members
listed); and the recipe's GPU commands run as written on stand-ins of python3 (no GPU, no nvcc, no
MPS): the kits unpack, the stand-in checks each folder the real program would read, and
run_edges.sh leaves no more files than the device brings back (a tar.gz and a summary).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ROOT
from userenv import fresh_clone

MIB = 1 << 20
CARRY_LIMIT = 64 * MIB  # the device tool: what a call carries, 64 MiB in all
FILES_BACK = 8  # the device tool brings back at most 8 files from $OUT

# what tests/gpu/p6_rope/run_rope.sh reads from build/p6rope.tar.xz (FI072, FI063 for rope_check.py)
P6ROPE_DIRS = (
    "p6rope/fi072/flashinfer/data/include",
    "p6rope/fi072/flashinfer/data/cccl/cub",
    "p6rope/fi072/flashinfer/data/cccl/libcudacxx/include",
    "p6rope/fi072/flashinfer/data/cccl/thrust",
    "p6rope/fi063/flashinfer/data/include",
)
TREE_FILES = (
    "python/sglang/jit_kernel/rope.py",
    "python/sglang/srt/distributed/parallel_state.py",
    "python/sglang/srt/distributed/device_communicators/pcie_ipc_allreduce.py",
    "python/sglang/srt/pcie_ipc_tune.py",
)


def rerun_sections() -> dict[str, str]:
    """README -> its Rerun recipe: from a '## Rerun' heading or a 'Rerun:' paragraph to the next heading."""
    out = {}
    for readme in sorted((ROOT / "results").glob("*/README.md")):
        text = readme.read_text()
        m = re.search(r"^(## Rerun\b|Rerun:)", text, re.M)
        if m:
            end = re.search(r"^## ", text[m.end():], re.M)
            out[str(readme.relative_to(ROOT))] = text[m.start(): m.end() + end.start() if end else len(text)]
    return out


def commands(section: str) -> tuple[list[str], list[str], list[str]]:
    """(local commands, GPU commands, carry paths) as the recipe writes them."""
    spans = re.findall(r"`([^`]+)`", section)
    spans += [ln.strip().split("  #")[0].strip() for ln in section.splitlines() if ln.startswith("    ")]
    local = [" ".join(s.split()) for s in spans if s.startswith("PYTHON=")]
    gpu = [" ".join(s.split()) for s in spans if s.startswith("bash tests/gpu/")]
    carry = [p for s in spans if s.startswith("carry=") for p in json.loads(s.removeprefix("carry="))]
    return local, gpu, carry


SECTIONS = rerun_sections()


def test_the_readmes_with_a_rerun_recipe_give_commands():
    assert {"results/p5-mps-h200/README.md", "results/p6-rope-h200/README.md"} <= set(SECTIONS)
    for readme, section in SECTIONS.items():
        local, gpu, carry = commands(section)
        assert local and gpu and carry, f"{readme}: the recipe gives no local command, GPU command or carry"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A fresh clone where every recipe's local commands ran once, in order: (clone, {cmd: proc})."""
    clone = fresh_clone(tmp_path_factory.mktemp("recipes") / "sglpatch")
    (clone / ".venv").symlink_to(Path(sys.prefix))  # the recipes' `.venv`: the test venv
    ran: dict[str, subprocess.CompletedProcess] = {}
    for section in SECTIONS.values():
        for cmd in commands(section)[0]:
            if cmd not in ran:
                ran[cmd] = subprocess.run(["bash", "-c", cmd], cwd=clone, stdin=subprocess.DEVNULL, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1500)
    return clone, ran


def test_the_local_commands_build_the_kits(built):
    clone, ran = built
    for cmd, proc in ran.items():
        assert proc.returncode == 0, f"$ {cmd}\n{proc.stdout[-4000:]}"


def test_every_path_and_script_a_command_names_exists(built):
    clone, _ = built
    for readme, section in SECTIONS.items():
        local, gpu, carry = commands(section)
        for cmd in local + gpu:
            for word in shlex.split(cmd):
                if re.match(r"(results|tests|scripts|build)/", word):
                    assert (clone / word).exists(), f"{readme}: `{cmd}` names {word}, which is not there"
        for path in carry:
            assert (clone / path).exists(), f"{readme}: carry names {path}, which the local commands did not build"


def size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def test_what_each_recipe_carries_fits_one_call(built):
    clone, _ = built
    for readme, section in SECTIONS.items():
        carry = commands(section)[2]
        total = sum(size(clone / p) for p in carry)
        assert total < CARRY_LIMIT, f"{readme}: carry {carry} is {total / MIB:.1f} MiB, over the device's 64 MiB"


def members(tarball: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(tarball) as tf:
        return tf.getmembers()


def test_the_p6rope_kit_is_exactly_what_run_rope_reads(built):
    clone, _ = built
    files = [m.name for m in members(clone / "build/p6rope.tar.xz") if m.isfile()]
    assert {n.split("/")[0] for n in files} == {"p6rope"}, "the tarball's top-level folder is not p6rope/"
    for d in P6ROPE_DIRS:
        assert any(n.startswith(d + "/") for n in files), f"p6rope.tar.xz has nothing under {d}/"
    stray = [n for n in files if not any(n.startswith(d + "/") for d in P6ROPE_DIRS)]
    assert not stray, f"p6rope.tar.xz holds what run_rope.sh never reads: {stray[:5]}"
    assert "p6rope/fi072/flashinfer/data/cccl/libcudacxx/include/cuda/std/version" in files
    assert not any("/cccl/" in n for n in files if n.startswith("p6rope/fi063/"))  # 0.6.3 ships no CCCL


def test_the_p5mps_kit_is_what_run_edges_and_run_rope_read(built):
    clone, _ = built
    kit = clone / "build/p5mps"
    top = sorted(p.name for p in kit.iterdir())
    assert top == ["flashinfer-0.7.2-kit.tar.xz", "sglang-059-patched.tar.xz", "whl"], top
    wheels = sorted(p.name for p in (kit / "whl").iterdir())
    assert len(wheels) == 19 and all(w.endswith(".whl") for w in wheels), wheels
    tree = {m.name for m in members(kit / "sglang-059-patched.tar.xz")}
    assert set(TREE_FILES) <= tree, set(TREE_FILES) - tree
    fikit = {m.name for m in members(kit / "flashinfer-0.7.2-kit.tar.xz")}
    for need in ("p5kit/site/flashinfer/comm", "p5kit/site/flashinfer/data/include",
                 "p5kit/site/flashinfer/data/csrc/pcie_ipc_all_reduce.cu", "p5kit/site/tvm_ffi"):
        assert need in fikit, f"flashinfer-0.7.2-kit.tar.xz lacks {need}"


# python3 on the GPU machine, stood in: checks what the real program would read, writes what it writes
STAND_IN = r'''#!{python}
import json, os, sys
from pathlib import Path
a = sys.argv[1:]
def need(*paths):
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        sys.exit("stand-in python3: missing " + " ".join(missing))
if a[:3] == ["-m", "pip", "install"]:
    whl = [x for x in a if x.endswith(".whl")]
    need(*whl) if whl else sys.exit("stand-in python3: pip install with no wheel")
    sys.exit(0)
if a[:1] == ["-c"]:
    os.execv(sys.executable, [sys.executable, *a])
tree = Path(os.environ.get("SGLANG_TREE", "/nonexistent"))
if a and a[0].endswith("rope_check.py"):
    fi072, fi063 = Path(os.environ["FI072"]), Path(os.environ["FI063"])
    c = fi072 / "flashinfer/data/cccl"
    need(tree / "python/sglang/jit_kernel/rope.py", fi072 / "flashinfer/data/include", c / "cub",
         c / "libcudacxx/include", c / "thrust", fi063 / "flashinfer/data/include",
         *[Path(p) / "tvm_ffi" for p in os.environ["PYTHONPATH"].split(":")[1:]])
    print(json.dumps({"ok": True, "stand_in": True}))
    sys.exit(0)
if a and a[0].endswith("p5_edges_mps.py"):
    need(tree / "python/sglang/srt/distributed/device_communicators/pcie_ipc_allreduce.py",
         Path(os.environ["FLASHINFER_KIT"]) / "site/flashinfer/comm")
    print(json.dumps({"ok": True, "ws": a[1], "stand_in": True}))
    print("stand-in probe log", file=sys.stderr)
    sys.exit(0)
if a[:2] == ["-m", "sglang.srt.pcie_ipc_tune"]:
    need(*[Path(p) / "sglang/srt/pcie_ipc_tune.py"
           for p in os.environ["PYTHONPATH"].split(":") if p.endswith("/python")])
    t, rep, tp = a[a.index("--timeout") + 1], a[a.index("--report") + 1], a[a.index("--tp") + 1]
    if t == "5":
        print("error: tuning did not finish within 5 s; nothing was written", file=sys.stderr)
        sys.exit(1)
    d = Path(os.environ["FLASHINFER_AUTOTUNE_DIR"]); d.mkdir(parents=True, exist_ok=True)
    (d / f"sglang_pcie_ipc_ws{tp}.json").write_text("{}")
    Path(rep).write_text(json.dumps({"stand_in": True}))
    print("tuned (stand-in)")
    sys.exit(0)
sys.exit("stand-in python3: unexpected " + " ".join(a))
'''


@pytest.fixture(scope="module")
def gpu_runs(built, tmp_path_factory):
    """Each recipe's GPU commands, as written, with $OUT a scratch folder and python3 the stand-in."""
    clone, _ = built
    base = tmp_path_factory.mktemp("gpu")
    bindir = base / "bin"
    bindir.mkdir()
    py3 = bindir / "python3"
    py3.write_text(STAND_IN.replace("{python}", sys.executable, 1))
    py3.chmod(py3.stat().st_mode | stat.S_IEXEC)
    runs = {}
    for readme, section in SECTIONS.items():
        for i, cmd in enumerate(commands(section)[1]):
            work = base / f"{Path(readme).parent.name}-{i}"
            out = work / "OUT"
            out.mkdir(parents=True)
            env = dict(os.environ, PATH=f"{bindir}:/usr/bin:/bin", OUT=str(out), P5_SITE=str(work / "site"),
                       P5_TREE=str(work / "tree"), P6_DIR=str(work / "p6r"), P5_TUNE_DIR=str(work / "tune"), P5_DEVICES="spread",
                       TMPDIR=str(work))
            proc = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, stdin=subprocess.DEVNULL, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
            runs[(readme, cmd)] = (proc, out)
    return runs


def test_the_gpu_commands_run_as_written_on_stand_ins(gpu_runs):
    assert gpu_runs
    for (readme, cmd), (proc, out) in gpu_runs.items():
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in out.rglob("*")
                         if p.is_file() and p.suffix in (".txt", ".err", ".log"))
        assert proc.returncode == 0, f"{readme}: $ {cmd} -> rc {proc.returncode}\n{proc.stdout[-3000:]}\n{logs}"
        back = [p for p in out.rglob("*") if p.is_file()]
        assert len(back) <= FILES_BACK, f"{readme}: $ {cmd} leaves {len(back)} files; the device brings back {FILES_BACK}"
        assert all(len(p.relative_to(out).parts) <= 3 for p in back), "deeper than the device brings back"


def test_run_edges_packs_everything_it_wrote(gpu_runs):
    edges = [(cmd, out) for (_, cmd), (_, out) in gpu_runs.items() if "run_edges.sh" in cmd]
    assert edges, "no recipe runs tests/gpu/p5_edges/run_edges.sh"
    for cmd, out in edges:
        (d,) = [p for p in out.iterdir()]  # $OUT/e
        assert sorted(p.name for p in d.iterdir()) == ["edges.tar.gz", "summary.txt"], cmd
        names = {m.name for m in members(d / "edges.tar.gz")}
        wss = [w for w in shlex.split(cmd)[4:]] or ["8", "2", "4", "6"]
        want = {"env.txt", "all.log", "tune8-short.out", "tune8-short.err", "tune8.out", "tune8.err",
                "tune8-report.json", "cache8.json"} | {f"ws{w}.json" for w in wss}
        assert want <= names, want - names
        assert len(names) > FILES_BACK  # what packing is for
        summary = (d / "summary.txt").read_text()
        assert summary.startswith("run_edges.sh rc 0"), summary
        assert "ws8 rc 0" in summary and "tune8 rc 0" in summary, summary
