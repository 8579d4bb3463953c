"""sglpatch doctor on CPU, every external fact faked and nothing else: a fake `nvidia-smi` (topology
fixtures of the three classes, driver / memory / compute-apps answers), the serving interpreter
(this venv's python, its start-up changed by a sitecustomize.py on PYTHONPATH, a fake nvcc on its
CUDA_HOME), a tmpfs for /dev/shm (root) and a fake /proc/meminfo. Each check's ok / warn / fail
line is asserted; the end-to-end runs go through `python -m sglpatch.gpu.doctor` and
`sglpatch regress --tier server` (the doctor refuses the load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import SERIES
from sglpatch.pythonenv import interpreter
from sglpatch.gpu.doctor import checks as dc
from sglpatch.gpu.doctor import gpu as dg
from sglpatch.gpu.shared import profile as profiles
from sglpatch.gpu.shared import topology
from sglpatch.gpu.shared import served as served_mod
from sglpatch.gpu.shared.served import imported_sglang

ROOT = Path(__file__).resolve().parents[1]
TOPO = ROOT / "tests" / "fixtures" / "topo"
GIB = 1024  # MiB
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def fake_smi(d: Path, topo="two-sockets-no-switch", p2p="", driver="580.65.06", cap="12.0", free=None,
             total=97887, apps="") -> str:
    """An nvidia-smi answering the doctor's queries from a scenario file (its own format, as a driver prints)."""
    text = (TOPO / f"{topo}.txt").read_text() if topo else ""
    n = len(topology.parse_matrix(text).gpus) or 1
    free = free or [95 * GIB] * n
    d.mkdir(parents=True, exist_ok=True)
    scen = {"topo": text, "p2p": (TOPO / f"{p2p}.txt").read_text() if p2p else "",
            "gpus": "\n".join(f"{driver}, {cap}" for _ in range(n)),
            "mem": "\n".join(f"{i}, {RTX}, {total}, {total - f}, {f}" for i, f in enumerate(free)), "apps": apps}
    (d / "scenario.json").write_text(json.dumps(scen))
    smi = d / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, sys
        s = json.load(open({str(d / 'scenario.json')!r}))
        a = sys.argv[1:]
        key = {{"-m": "topo", "-p2p": "p2p"}}.get(a[1]) if a[:1] == ["topo"] else (
            "gpus" if a[0].startswith("--query-gpu=driver_version") else "mem" if a[0].startswith("--query-gpu=index")
            else "apps" if a[0].startswith("--query-compute-apps") else None)
        if key is None or (key == "p2p" and not s[key]):
            sys.exit(2)
        print(s[key])
    """))
    smi.chmod(0o755)
    return str(smi)


def site(d: Path, startup: str = "", sglang: str | None = "0.5.9", dists: dict | None = None) -> Path:
    """A PYTHONPATH folder: sitecustomize.py running `startup`, a stand-in sglang package outside any
    sglpatch workdir (imported_sglang: patches unknown), installed-package metadata for `dists`."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text("import os\n" + textwrap.dedent(startup))
    if sglang:
        (d / "sglang").mkdir(exist_ok=True)
        (d / "sglang" / "__init__.py").write_text(f"__version__ = {sglang!r}\n")
    for name, version in (dists or {}).items():
        info = d / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return d


def nvcc(home: Path, release: str) -> Path:
    (home / "bin").mkdir(parents=True, exist_ok=True)
    (home / "bin" / "nvcc").write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.41'\n")
    (home / "bin" / "nvcc").chmod(0o755)
    return home


def base_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "SGLANG_", "CUDA_", "MAX_JOBS", "PYTHONPATH"))}
    env.update(extra or {})
    return env


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """What this venv's python sees with a sitecustomize.py that changes NCCL and CUDA settings."""
    t = tmp_path_factory.mktemp("seen")
    home = nvcc(t / "cuda-12.8", "12.8")
    d = site(t / "site", f"""
        os.environ["NCCL_ALGO"] = "Tree"
        os.environ["NCCL_MIN_NCHANNELS"] = "4"
        os.environ["CUDA_HOME"] = {str(home)!r}
    """, dists={"flashinfer-python": "0.6.17", "sgl-kernel": "0.3.21"})
    env = base_env({"PYTHONPATH": str(d), "NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"})
    return {"info": dc.probe_python(sys.executable, env), "env": env, "site": d, "tmp": t}


# ------------------------------------------------------------------ 2. the Python that serves


def test_env_as_the_interpreter_sees_it_names_the_sitecustomize(seen):
    info, site_py = seen["info"], str(seen["site"] / "sitecustomize.py")
    assert info["startup_files"] == {"sitecustomize": site_py}
    c = dc.check_env(info, seen["env"], {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL", "NCCL_BUFFSIZE": "16777216"})
    assert c.line() == (
        f"warn env: NCCL_ALGO=Tree set at start-up by {site_py} (the profile says Ring); NCCL_BUFFSIZE unset (the "
        f"profile says 16777216); NCCL_MIN_NCHANNELS set at start-up by {site_py}, not in the profile's [env]; fix: "
        "make the profile's [env] and the interpreter agree (the profile is what reports record)")
    assert f"NCCL_ALGO=Tree  (set at start-up by {site_py})" in c.details and "NCCL_PROTO=LL" in c.details
    ok = dc.check_env({"env": {"NCCL_ALGO": "Ring"}}, {"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Ring"})
    assert ok.line() == "ok   env: 1 NCCL_*/SGLANG_* variables; 1 [env] values as the profile says"


def test_known_traps(seen):
    env = seen["info"]["env"]
    c = dc.check_traps(env, ["--trust-remote-code"], "two-sockets-no-switch")
    assert c.line() == ("fail env-traps: NCCL_ALGO=Tree with CUDA graphs: capture fails on the PCIe target ('NCCL "
                        "error: invalid usage'); fix: NCCL_ALGO=Ring")
    assert dc.check_traps(env, ["--disable-cuda-graph"], "two-sockets-no-switch").state == "ok"
    assert dc.check_traps(env, [], "nvlink").state == "warn"
    c = dc.check_traps({"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "1", "NCCL_ALGO": "^Tree"}, [], "switches")
    assert c.state == "warn" and "NCCL_P2P_DISABLE=1: NCCL goes through host memory" in c.text
    assert "NVLS / multicast on" in c.text and c.fix.endswith("NCCL_NVLS_ENABLE=0, drop --enable-nccl-nvls")
    assert dc.check_traps({}, ["--enable-symm-mem"], "two-sockets-no-switch").text.startswith("--enable-symm-mem on PCIe")
    assert dc.check_traps({"NCCL_ALGO": "Ring"}, [], "switches").line() == (
        "ok   env-traps: none of the known traps (NCCL_ALGO=Ring, CUDA graphs on)")


def test_torch_and_kernel_packages(seen, tmp_path):
    info = seen["info"]
    c = dc.check_torch(info, True)
    assert c.state == "ok" and c.text.startswith(f"torch {info['torch']['version']} (CUDA {info['torch']['cuda']}")
    fi, sk = dc.check_kernels(info)
    assert fi.line().startswith("ok   flashinfer: flashinfer-python 0.6.17") and sk.line().startswith(
        "ok   sgl-kernel: sgl-kernel 0.3.21")
    bare = tmp_path / "python3"  # an interpreter without site-packages: no torch, no kernels
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    none = dc.probe_python(str(bare), base_env())
    assert dc.check_torch(none, True).line().startswith("fail torch: torch does not import: ModuleNotFoundError")
    assert [c.state for c in dc.check_kernels(none)] == ["warn", "warn"]
    assert dc.check_torch({"torch": {"version": "2.9.1+cpu", "cuda": None, "file": "t"}}, True).line() == (
        "fail torch: torch 2.9.1+cpu (CUDA none, NCCL none) from t: a CPU-only build; fix: install a CUDA build of "
        "torch (e.g. +cu128)")
    assert dc.probe_python(str(tmp_path / "missing"), {})["error"].startswith("cannot run")


@pytest.mark.parametrize("version,has,adapter,expect", [
    ("0.7.2", True, "P5", "ok   flashinfer: flashinfer-python 0.7.2 ({o}); has PcieIpcAllReduceWorkspace: usable by P5 "
                          "(0.5.9 + the series) with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1"),
    ("0.7.2", True, "upstream", "ok   flashinfer: flashinfer-python 0.7.2 ({o}); has PcieIpcAllReduceWorkspace: usable by "
                                "sglang's own pcie_ipc_ar.py with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1"),
    ("0.6.18", False, "upstream", "warn flashinfer: flashinfer-python 0.6.18 ({o}); no PcieIpcAllReduceWorkspace: sglang's own "
                                  "pcie_ipc_ar.py cannot turn PCIe-IPC on (it warns and stays on NCCL); fix: scripts/apply.sh "
                                  "--with-flashinfer (flashinfer-python >= 0.7.0)"),
    ("0.6.3", False, "P5", "warn flashinfer: flashinfer-python 0.6.3 ({o}); no PcieIpcAllReduceWorkspace: P5 (0.5.9 + the series) "
                           "cannot turn PCIe-IPC on (it warns and stays on NCCL); fix: scripts/apply.sh --with-flashinfer "
                           "(flashinfer-python >= 0.7.0)"),
    ("0.6.3", False, None, "ok   flashinfer: flashinfer-python 0.6.3 ({o}); no PcieIpcAllReduceWorkspace (P5 needs flashinfer "
                           ">= 0.7.0: scripts/apply.sh --with-flashinfer)"),
], ids=["0.7.2-P5", "0.7.2-0.5.23", "0.6.18-0.5.21", "0.6.3-P5", "0.6.3-plain"])
def test_flashinfer_line_says_whether_pcie_ipc_is_usable(tmp_path, version, has, adapter, expect):
    """The serving Python's flashinfer version, and whether its comm.pcie_ipc_ar defines the workspace
    (read from the file, nothing imported), against the adapter the served sglang carries."""
    d = site(tmp_path / "site", dists={"flashinfer-python": version})
    (d / "flashinfer" / "comm").mkdir(parents=True)
    (d / "flashinfer" / "__init__.py").write_text("raise ImportError('never imported by the probe')\n")
    if has:
        (d / "flashinfer" / "comm" / "pcie_ipc_ar.py").write_text("class PcieIpcAllReduceWorkspace:\n    pass\n")
    info = dc.probe_python(sys.executable, base_env({"PYTHONPATH": str(d)}))
    assert info["flashinfer_pcie_ipc"] is has
    pkg = tmp_path / "sglang"
    module = {"P5": served_mod.P5_MODULE, "upstream": served_mod.UPSTREAM_MODULE}.get(adapter)
    if module:
        (pkg / module).parent.mkdir(parents=True)
        (pkg / module).write_text("")
    fi, _ = dc.check_kernels(info, {"sglang_file": str(pkg / "__init__.py")})
    assert fi.line() == expect.format(o=d / "flashinfer" / "__init__.py")


def test_sglang_line_outside_a_workdir_and_when_it_does_not_import(seen, tmp_path):
    served = imported_sglang(sys.executable, seen["env"], ROOT)
    c = dc.check_sglang(served)
    assert c.state == "warn" and c.text.startswith(f"sglang 0.5.9 from {seen['site'] / 'sglang' / '__init__.py'}")
    assert "is not in an sglpatch workdir" in c.text
    gone = dc.check_sglang(imported_sglang(sys.executable, base_env(), ROOT))
    assert gone.line().startswith(f"fail sglang: {sys.executable}: sglang does not import: ModuleNotFoundError")


def test_installed_tree_without_its_dependencies_gets_the_install_deps_command(tmp_path):
    """Issue 38: the tree installed editable, its dependencies not: the cpu tier's missing-dependency
    command, not "install the patched tree", and the flashinfer line reads the tree's P5 adapter
    (it said "the served sglang has no PCIe-IPC adapter")."""
    tree = tmp_path / "fork" / "python"
    (tree / "sglang").mkdir(parents=True)
    (tree / "sglang" / "__init__.py").write_text("import sglpatch_test_dep_not_there\n__version__ = '0.5.9'\n")
    (tree / "sglang" / served_mod.P5_MODULE).parent.mkdir(parents=True)
    (tree / "sglang" / served_mod.P5_MODULE).write_text("")
    d = site(tmp_path / "site", sglang=None, dists={"flashinfer-python": "0.7.2"})
    info_dir = d / "sglang-0.5.9.dist-info"
    info_dir.mkdir()
    (info_dir / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.9\nRequires-Dist: sglpatch-test-dep-not-there\n")
    (info_dir / "direct_url.json").write_text(json.dumps({"url": f"file://{tree}", "dir_info": {"editable": True}}))
    (d / "flashinfer" / "comm").mkdir(parents=True)
    (d / "flashinfer" / "__init__.py").write_text("")
    (d / "flashinfer" / "comm" / "pcie_ipc_ar.py").write_text("class PcieIpcAllReduceWorkspace:\n    pass\n")
    env = base_env({"PYTHONPATH": f"{d}:{tree}"})
    served = imported_sglang(sys.executable, env, ROOT)
    c = dc.check_sglang(served)
    assert c.state == "fail" and "apply.sh --python" not in c.line(), c.line()
    assert c.text == (f"sglang 0.5.9 is installed (editable from {tree}) but does not import with {sys.executable}: "
                      "ModuleNotFoundError: No module named 'sglpatch_test_dep_not_there'; none of its 1 declared dependencies is "
                      "installed (sglpatch-test-dep-not-there missing)")
    then = f" && sglpatch apply --with-flashinfer --python {sys.executable} --workdir {tree.parent}"  # the tree carries P5's adapter
    assert c.fix == (f"install them: {sys.executable} -m pip install -e {tree}" if not interpreter.find_uv() else
                     f"install them: {interpreter.find_uv()} pip install --python {sys.executable} -e {tree}") + then + \
        "; or build a complete new venv: scripts/apply.sh --venv NEWDIR"
    fi, _ = dc.check_kernels(dc.probe_python(sys.executable, env), served)
    assert "usable by P5 (0.5.9 + the series)" in fi.text and "no PCIe-IPC adapter" not in fi.text, fi.line()


def test_sglang_line_of_the_patched_workdir(patched_python, patched_tree, project_root):
    served = imported_sglang(str(patched_python), base_env(), project_root)
    c = dc.check_sglang(served)
    assert c.state == "ok", c.line()
    assert f"(workdir {patched_tree}, {len(SERIES)} patches: 0001-" in c.text and "; in sync with the series" in c.text
    assert "state:    in sync with the series" in c.details and "dirty:    0 uncommitted file(s)" in c.details
    # the same workdir as `sglpatch status` would show it after a commit there, or with an edit
    unexported = [ln if not ln.startswith("state:") else "state:    patched has unexported commits: run "
                  "`sglpatch export`" for ln in served["status"]]
    c = dc.check_sglang(dict(served, status=unexported))
    assert c.state == "warn" and "; patched has unexported commits: run `sglpatch export`)" in c.text
    assert c.fix.startswith("run `sglpatch status` there")
    dirty = [ln if not ln.startswith("dirty:") else "dirty:    1 uncommitted file(s): python/sglang/x.py"
             for ln in served["status"]]
    c = dc.check_sglang(dict(served, status=dirty))
    assert c.state == "warn" and c.text.endswith("; in sync with the series; 1 uncommitted file(s): python/sglang/x.py)")


# ------------------------------------------------------------------ 3. driver and toolkits


def test_driver_against_the_cuda_of_that_torch(seen, tmp_path):
    from sglpatch.pythonenv import preflight

    major = int(seen["info"]["torch"]["cuda"].split(".")[0])
    old = {12: "520.61.05", 13: "575.57.08"}[major]
    rows, exe = preflight.gpus(fake_smi(tmp_path / "old", driver=old))
    c = dc.check_driver(seen["info"], rows, exe)
    assert c.state == "fail" and c.text.startswith(f"NVIDIA driver {old} is too old for CUDA {major} (from torch ")
    assert c.fix == "upgrade the driver on the host"
    rows, exe = preflight.gpus(fake_smi(tmp_path / "new", driver="590.48.01"))
    assert dc.check_driver(seen["info"], rows, exe).line().startswith("ok   driver: driver 590.48.01 >= ")
    assert dc.check_driver(seen["info"], [], "").state == "skip"


def test_nvcc_on_the_cuda_home_the_interpreter_sees(seen, tmp_path):
    """flashinfer's JIT: nvcc >= 12.8 for P5 on any GPU, >= 12.9 for P1 on SM12x; 12.10 is above 12.8."""
    from sglpatch.pythonenv import preflight

    rows, exe = preflight.gpus(fake_smi(tmp_path / "sm120", cap="12.0"))
    seen_nvcc = seen["tmp"] / "cuda-12.8" / "bin" / "nvcc"
    tail = " (CUDA_HOME / PATH as the serving interpreter sees them)"
    assert dc.check_nvcc(seen["info"], rows, exe).line() == (
        f"ok   nvcc: {seen_nvcc} (CUDA_HOME) is 12.8 >= 12.8 for flashinfer's JIT (P5); P1's fusion on SM120 needs >= 12.9: "
        "leave --enable-flashinfer-allreduce-fusion off" + tail)

    def with_home(home):
        return dict(seen["info"], env={**seen["info"]["env"], "CUDA_HOME": str(home), "PATH": str(tmp_path / "nopath")})

    old = with_home(nvcc(tmp_path / "cuda-12.7", "12.7"))
    assert dc.check_nvcc(old, rows, exe).line() == (
        f"warn nvcc: flashinfer's JIT (P5's PCIe-IPC allreduce, P1's fusion) needs nvcc >= 12.8; {tmp_path}/cuda-12.7/bin/nvcc "
        "(CUDA_HOME) is 12.7; fix: set CUDA_HOME to a CUDA >= 12.8 toolkit")
    ten = with_home(nvcc(tmp_path / "cuda-12.10", "12.10"))
    assert dc.check_nvcc(ten, rows, exe).line() == (
        f"ok   nvcc: {tmp_path}/cuda-12.10/bin/nvcc (CUDA_HOME) is 12.10 >= 12.8 for flashinfer's JIT (P5) and P1 on SM120" + tail)
    (tmp_path / "empty").mkdir()
    assert dc.check_nvcc(with_home(tmp_path / "empty"), rows, exe).line() == (
        "warn nvcc: flashinfer's JIT (P5's PCIe-IPC allreduce, P1's fusion) needs nvcc >= 12.8; none on CUDA_HOME or PATH; "
        "fix: set CUDA_HOME to a CUDA >= 12.8 toolkit")
    rows, exe = preflight.gpus(fake_smi(tmp_path / "h200", cap="9.0"))  # no SM12x: P5's rule only
    assert dc.check_nvcc(seen["info"], rows, exe).line() == f"ok   nvcc: {seen_nvcc} (CUDA_HOME) is 12.8 >= 12.8 for flashinfer's JIT (P5)" + tail


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(size: str) -> Path:
        d = tmp_path / f"shm-{size}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True)
        if r.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (not root)")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], check=False)


def test_shm_on_tmpfs(tmpfs, tmp_path):
    small = tmpfs("64m")
    c = dc.check_shm(small)
    assert c.line() == (f"fail shm: {small}: 64.0 MiB, 64.0 MiB free: NCCL's shared-memory transport crashes in "
                        "ncclShmOpen on a small /dev/shm (Docker's 64 MiB default); fix: give it >= 1 GiB (docker "
                        "--shm-size / --ipc=host, LXC: mount a larger tmpfs)")
    big = tmpfs("1100m")
    assert dc.check_shm(big).line() == f"ok   shm: {big}: 1.1 GiB, 1.1 GiB free"
    with open(big / "nccl-stale-segment", "wb") as f:  # a crashed run's leftovers
        f.write(b"\0" * (600 << 20))
    c = dc.check_shm(big)
    assert c.state == "warn" and c.text.endswith("1.1 GiB, 500.0 MiB free: more than half used") and f"`ls -la {big}`" in c.fix
    (big / "nccl-stale-segment").unlink()
    assert dc.check_shm(tmp_path / "absent").state == "fail"


def test_memlock_as_the_interpreter_gets_it(tmp_path):
    low = tmp_path / "python3"
    low.write_text(f"#!/bin/sh\nulimit -S -l 64\nexec {sys.executable} \"$@\"\n")
    low.chmod(0o755)
    c = dc.check_memlock(dc.probe_python(str(low), base_env()))
    assert c.state == "warn" and c.text.startswith("locked-memory limit 0.1 MiB (hard ")
    assert c.fix.startswith("`ulimit -l unlimited` (LXC: lxc.prlimit.memlock = unlimited")
    assert dc.check_memlock({"memlock": [None, None]}).line() == "ok   memlock: locked-memory limit unlimited"


def test_build_jobs_without_swap(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       1056335872 kB\nMemAvailable:   1000000000 kB\n"
                                      "SwapTotal:             0 kB\n")
    mem = dc.meminfo(tmp_path)
    c = dc.check_build_jobs({"cpus_affinity": 128, "env": {}}, mem)
    assert c.line() == ("warn build-jobs: 128 cores, no swap, RAM 1007.4 GiB; MAX_JOBS unset as the interpreter sees "
                        "it: a build would run 128 jobs; without swap a build that runs out of RAM takes the box down; "
                        "fix: export MAX_JOBS=20 (and build with -j20) before a JIT or extension build")
    assert dc.check_build_jobs({"cpus_affinity": 128, "env": {"MAX_JOBS": "16"}}, mem).state == "ok"
    assert dc.check_build_jobs({"cpus_affinity": 128, "env": {"MAX_JOBS": "64"}}, mem).state == "warn"
    assert dc.check_build_jobs({"cpus_affinity": 128, "env": {}}, dict(mem, SwapTotal=64 << 30)).state == "ok"


# ------------------------------------------------------------------ 4. topology, 5. memory


@pytest.mark.parametrize("name, klass", [("two-sockets-no-switch", "two-sockets-no-switch"), ("switches", "switches"),
                                         ("one-socket", "one-socket"), ("nvlink-h200x2", "nvlink")])
def test_topology_line_per_class(tmp_path, name, klass):
    topo, raw = topology.read(fake_smi(tmp_path, topo=name))
    [c] = dg.check_topology(topo, raw)
    assert c.line().startswith(f"ok   topology: {klass}: ") and c.data["class"] == klass
    assert c.details[0].startswith("GPU 0: NUMA ")


def test_p2p_matrix_names_the_pair_without_p2p(tmp_path):
    topo, raw = topology.read(fake_smi(tmp_path, p2p="p2p-two-sockets-cns"))
    t, m = dg.check_topology(topo, raw)
    assert t.line() == ("ok   topology: two-sockets-no-switch: two sockets without PCIe switches (12 NODE, 16 SYS of "
                        "28 pairs; NUMA 0: GPU 0,1,2,3, NUMA 1: GPU 4,5,6,7)")
    assert t.details[5] == "GPU 5: NUMA 1, CPUs 32-63,96-127"
    assert m.line() == ("warn p2p-matrix: nvidia-smi reports no P2P read for 2->5, 5->2 (CNS); fix: those pairs go "
                        "through host memory; custom allreduce kernels need P2P on every pair")
    assert dg.check_topology(topology.Topology(), {})[0].state == "skip"


def test_the_backend_the_topology_suggests_cites_the_evidence(tmp_path):
    c = dg.check_backend("two-sockets-no-switch", (0, 5, 9), None)
    assert c.text.startswith("two-sockets-no-switch suggests upstream PCIe-IPC allreduce "
                             "(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1): 5.3 vs 205.1 us (NCCL) at 12 KiB")
    assert "(sglang 0.5.23 pcie_ipc_ar.py header)" in c.text and "it needs sglang >= 0.5.21, this interpreter " \
        "serves 0.5.9" in c.text and c.fix.startswith("the 0.5.23 line (resolutions/0.5.23)")
    assert c.text.endswith("; measure here: scripts/regress.sh --tier kernel")
    assert dg.check_backend("two-sockets-no-switch", (0, 5, 23), None).fix == ""
    sw = dg.check_backend("switches", (0, 5, 9), None)
    assert "one-shot custom allreduce (P2: SGLANG_ENABLE_PCIE_CUSTOM_AR=1): 9.2 / 16.5 vs 24.2 / 24.5 us" in sw.text
    assert dg.check_backend("unknown", (), None).state == "skip"
    rep = tmp_path / "kernel-run"
    rep.mkdir()
    rows = [{"backend": b, "mode": m, "rows": r, "hidden": 7168, "median_us": us, "status": "ok"}
            for b, m, r, us in (("nccl", "graph", 3, 41.5), ("custom_ar", "graph", 3, 12.25), ("nccl", "graph", 8, 44.0),
                                ("symm_mem", "eager", 3, 30.0))]
    (rep / "report.json").write_text(json.dumps({"tiers": {"kernel": {"results": rows}}}))
    c = dg.check_backend("two-sockets-no-switch", (0, 5, 9), rep)
    assert c.text.endswith(f"; measured in {rep} at [3, 7168] graph: custom_ar 12.2 us, nccl 41.5 us")
    (rep / "report.json").write_text(json.dumps({"tiers": {"kernel": {"decision": [
        {"backend": "pcie_ipc", "projected_tok_s": 101.2, "switch": "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1"}]}}}))
    assert dg.check_backend("switches", (0, 5, 23), rep).text.endswith(
        f"; decision table of {rep}: first pcie_ipc (projected_tok_s 101.2, switch SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1)")


def target() -> dict:
    return profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")


def test_free_memory_against_the_model(tmp_path):
    prof = target()
    assert prof["model"] == {"weights_gib": 547, "margin_gib": 6.0} and prof["server"]["tp"] == 8
    ok = dg.check_memory(dg.query_memory(fake_smi(tmp_path / "a")), prof)
    assert ok.line() == "ok   gpu-memory: every TP GPU has >= 95.0 GiB free; needs 547 GiB / tp 8 + 6 GiB margin = 74.4 GiB per GPU"
    assert ok.details[0] == f"GPU 0 {RTX}: 95.0 of 95.6 GiB free"
    short = dg.check_memory(dg.query_memory(fake_smi(tmp_path / "b", free=[95 * GIB] * 3 + [20 * GIB] + [95 * GIB] * 4)), prof)
    assert short.line() == ("fail gpu-memory: GPU 3 short of memory (20.0 GiB free; needs 547 GiB / tp 8 + 6 GiB margin = "
                            "74.4 GiB per GPU); fix: stop what holds it (see gpu-procs; stale workers: sglpatch doctor "
                            "--kill-stale)")
    uneven = dg.check_memory(dg.query_memory(fake_smi(tmp_path / "c", free=[95 * GIB] * 7 + [80 * GIB])), prof)
    assert uneven.state == "fail" and "unbalanced across the TP GPUs (80.0 vs 95.0 GiB)" in uneven.text
    rows = dg.query_memory(fake_smi(tmp_path / "c2", free=[95 * GIB] * 7 + [80 * GIB]))
    assert dg.check_memory(rows, prof, {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0"}).state == "warn"
    two = dg.check_memory(dg.query_memory(fake_smi(tmp_path / "d", topo="nvlink-h200x2")), prof)
    assert two.line().startswith("fail gpu-memory: the profile serves with tp 8, 2 GPU(s) visible")
    nomodel = dg.check_memory(dg.query_memory(fake_smi(tmp_path / "e")), profiles.load_profile(None))
    assert nomodel.state == "skip" and "no [model] weights_gib" in nomodel.text
    assert dg.check_memory([], prof).state == "skip"


# ------------------------------------------------------------------ end to end


FAKE_P2P = ROOT / "tests" / "test_doctor_p2p.py"


def doctor_cli(tmp_path, smi, *args, env_extra=None, proc="") -> subprocess.CompletedProcess:
    proc_root = tmp_path / "proc"
    proc_root.mkdir(exist_ok=True)
    (proc_root / "meminfo").write_text(proc or "MemTotal: 1056335872 kB\nSwapTotal: 8388608 kB\n")
    (proc_root / "cmdline").write_text("BOOT_IMAGE=/vmlinuz ro iommu=pt\n")
    probe = tmp_path / "probe.py"
    if not probe.exists():
        from test_doctor_p2p import FAKE

        probe.write_text(FAKE)
    env = base_env({"FAKE_PIDS": str(tmp_path / "pids"), "FAKE_GPUS": "8", **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "sglpatch.gpu.doctor", "--project", str(ROOT), "--python",
                           sys.executable, "--nvidia-smi", smi, "--proc-root", str(proc_root), "--p2p-probe", str(probe),
                           "--p2p-timeout", "2", "--dev-glob", str(tmp_path / "no-dev" / "nvidia*"), *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_doctor_end_to_end_ok_then_a_failing_check(tmp_path):
    good = site(tmp_path / "site", 'os.environ.update(NCCL_PROTO="LL", NCCL_ALGO="Ring", NCCL_P2P_LEVEL="SYS", '
                'NCCL_MAX_NCHANNELS="16", NCCL_BUFFSIZE="16777216", NCCL_NTHREADS="512", MAX_JOBS="16")\n',
                dists={"flashinfer-python": "0.6.17", "sgl-kernel": "0.3.21"})
    smi = fake_smi(tmp_path / "smi", driver="590.48.01")
    r = doctor_cli(tmp_path, smi, "--profile", "rtx6000x8-kimi-k25", "--json", str(tmp_path / "d.json"),
                   env_extra={"PYTHONPATH": str(good)})
    lines = r.stdout.splitlines()
    names = [ln.split(":")[0].split()[-1] for ln in lines if not ln.startswith("doctor:")]
    assert names == ["gpu-procs", "sglang", "torch", "flashinfer", "sgl-kernel", "env", "env-traps", "driver", "nvcc",
                     "jit-kernels", "shm", "memlock", "build-jobs", "topology", "p2p-copy", "allreduce", "gpu-memory"], r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   env: 6 NCCL_*/SGLANG_* variables; 6 [env] values as the profile says" in lines
    assert "ok   p2p-copy: 28 pairs copied both ways, values exact; slowest 21.0 GB/s (0<->1)" in lines
    assert lines[-1].startswith("doctor: ok (exit 0): ")
    assert "doctor: P2P copy test on 28 GPU pair(s), 2 s each at most" in r.stderr
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["status"] == "ok" and doc["topology"]["class"] == "two-sockets-no-switch" and len(doc["checks"]) == 17
    # a pair that hangs and a GPU held by something else: exit 1, each named on its line
    smi = fake_smi(tmp_path / "smi2", driver="590.48.01", free=[95 * GIB] * 7 + [3 * GIB])
    r = doctor_cli(tmp_path, smi, "--profile", "rtx6000x8-kimi-k25", env_extra={"PYTHONPATH": str(good),
                                                                                 "FAKE_HANG": "3-4"})
    assert r.returncode == 1, r.stdout
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("fail")]
    assert [f.split(":")[0] for f in fails] == ["fail p2p-copy", "fail gpu-memory"]
    assert fails[0].startswith("fail p2p-copy: pair(s) 3<->4 hung past 2 s: P2P between them is broken")
    assert "this kernel has: iommu=pt" in fails[0]
    # CUDA_VISIBLE_DEVICES leaves 3 GPUs: the pairs are the probe's, not nvidia-smi's 28
    r = doctor_cli(tmp_path, smi, "--profile", "rtx6000x8-kimi-k25", env_extra={
        "PYTHONPATH": str(good), "CUDA_VISIBLE_DEVICES": "0,1,2", "FAKE_GPUS": "3"})
    assert "ok   p2p-copy: 3 pairs copied both ways" in r.stdout, r.stdout
    assert "doctor: P2P copy test on every GPU pair torch sees, 2 s each at most" in r.stderr


def test_no_gpu_visible_is_125_and_a_missing_kernel_report_is_a_usage_error(tmp_path):
    r = doctor_cli(tmp_path, str(tmp_path / "no-nvidia-smi"), env_extra={"PYTHONPATH": str(site(tmp_path / "s"))})
    assert r.returncode == 125, r.stdout + r.stderr
    assert "skip p2p-copy: no GPU visible (nvidia-smi not found)" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("doctor: cannot_run (exit 125): ")
    r = doctor_cli(tmp_path, str(tmp_path / "no-nvidia-smi"), "--kernel-report", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == f"sglpatch: error: --kernel-report {tmp_path}: no report.json there"


def server_project(tmp_path: Path, model: str = "") -> tuple[Path, Path]:
    """(a project whose profile t's server tier would launch a load that only touches a file, that file)."""
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests").mkdir()
    launched = tmp_path / "launched"
    (proj / "targets" / "t.toml").write_text(textwrap.dedent(model) + textwrap.dedent(f"""
        [server]
        python = "{sys.executable}"
        tp = 8
        command = ["sh", "-c", "touch {launched}; exit 3"]
        health_timeout_s = 5
    """))
    return proj, launched


def test_regress_server_tier_runs_the_doctor_first_and_refuses_the_load(tmp_path):
    good = site(tmp_path / "site")
    smi_dir = tmp_path / "bin"
    fake_smi(smi_dir, free=[95 * GIB] * 7 + [3 * GIB])
    proj, launched = server_project(tmp_path, "[model]\nweights_gib = 547\n")
    env = base_env({"PYTHONPATH": str(good), "PATH": f"{smi_dir}:{os.environ['PATH']}"})
    cmd = [sys.executable, "-m", "sglpatch.gpu.regress", "--tier", "server", "--profile", "t", "--project", str(proj)]
    r = subprocess.run([*cmd, "--report-dir", str(tmp_path / "r1")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 125, r.stdout + r.stderr
    assert "tier server: cannot_run: the doctor refused the load: gpu-memory failed (doctor.json); fix them, or pass " \
           "--no-doctor" in r.stdout
    assert "  - doctor: fail gpu-memory: GPU 7 short of memory (3.0 GiB free; needs " in r.stdout
    assert "sglpatch: warn sglang: " in r.stderr and "sglpatch: fail gpu-memory" in r.stderr
    assert not launched.exists() and json.loads((tmp_path / "r1" / "doctor.json").read_text())["status"] == "fail"
    r = subprocess.run([*cmd, "--report-dir", str(tmp_path / "r2"), "--no-doctor"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert launched.exists() and not (tmp_path / "r2" / "doctor.json").exists(), r.stdout + r.stderr


def test_the_server_tier_with_no_gpu_cannot_start_and_launches_nothing(tmp_path):
    """Issue 50 (found by the runbook's author): with no GPU visible the doctor says 125, but the gate
    refused only failed checks, so the loads started, died with "No accelerator" and the tier said
    fail (exit 1): a bisect would have marked patches bad. Now 125, nothing launched."""
    proj, launched = server_project(tmp_path)
    env = base_env({"PYTHONPATH": str(site(tmp_path / "site")), "PATH": f"{tmp_path / 'nobin'}:/usr/bin:/bin"})
    r = subprocess.run([sys.executable, "-m", "sglpatch.gpu.regress", "--tier", "server", "--profile", "t", "--project", str(proj),
                        "--report-dir", str(tmp_path / "r")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 125, r.stdout + r.stderr
    assert r.stdout.startswith("tier server: cannot_run: the doctor finds no GPU here: the server tier cannot start"), r.stdout
    assert not launched.exists()
    assert json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["server"]["outcome"] == "cannot_start"


def test_sglpatch_doctor_is_registered_with_its_options(tmp_path):
    import shutil

    exe = shutil.which("sglpatch")
    assert exe, "the sglpatch console script is not on PATH (scripts/test.sh puts the venv's bin there)"
    text = " ".join(subprocess.run([exe, "doctor", "--help"], capture_output=True, text=True).stdout.split())
    for opt in ("--python", "--profile", "--json FILE", "--kill-stale", "--yes", "--kernel-report DIR", "--no-p2p"):
        assert opt in text
    assert "--p2p-timeout SEC deadline per GPU pair, in seconds (default: 20.0)" in text and "--dev-glob" not in text
    top = subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    assert "doctor" in top and "run it first on a new box" in " ".join(top.split())
    r = subprocess.run([exe, "doctor", "--profile", "nope", "--project", str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("sglpatch: error: profile 'nope' not found")
