"""`apply --venv DIR`: the preflight refuses each bad condition with one line, the plan comes
from the installer's own resolver, and a build makes a NEW venv without touching another.

The environment is faked, never the preflight: a fake `nvidia-smi` / `nvcc` first on PATH (or
CUDA_HOME), a small tmpfs for the disk, and a local wheel index (uv's or pip's own
find-links, with an empty default index) standing in for the registry, set as pip's configuration
(PIP_INDEX_URL, PIP_FIND_LINKS; the machine's pip.conf left out), which uv is handed; the release's pins come
from a fake sdist PKG-INFO passed as --release-artifact. One slow test resolves the real
pinned 0.5.9 set against the registry (dry run: nothing downloaded beyond metadata).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, make_venv, run_cli, sglpatch

UV = shutil.which("uv")


def wheel(index: Path, name: str, version: str, tag: str = "py3-none-any", payload: int = 0) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD; payload bytes of incompressible data)."""
    index.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = index / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n")
        if payload:
            zf.writestr(f"{name.replace('-', '_')}_blob.bin", os.urandom(payload), compress_type=zipfile.ZIP_STORED)
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def release(tmp: Path, requires: list[str], version: str = "0.5.9") -> Path:
    """A fake sglang sdist whose PKG-INFO carries requires (and an extra that must be ignored)."""
    info = f"Metadata-Version: 2.4\nName: sglang\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    info += 'Provides-Extra: test\nRequires-Dist: pytest; extra == "test"\n'
    path = tmp / f"sglang-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        data = info.encode()
        member = tarfile.TarInfo(f"sglang-{version}/PKG-INFO")
        member.size = len(data)
        tf.addfile(member, io.BytesIO(data))
    return path


def tool(bindir: Path, name: str, stdout: str) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    (bindir / name).write_text(f"#!/bin/sh\ncat <<'EOF'\n{stdout}\nEOF\n")
    (bindir / name).chmod(0o755)


@pytest.fixture
def tmp_path(disk_tmp_path):
    """The new venvs here meet apply's preflight disk check (~25 GiB free where a venv goes when the
    resolver gives no sizes): on a disk, not on the tmpfs scripts/test.sh may put tmp_path on."""
    return disk_tmp_path


@pytest.fixture
def env(tmp_path):
    """PATH with a fake-tools dir first; the registry replaced by a local find-links index. Offline by
    an empty local index, not PIP_NO_INDEX: no-index would also turn off the indexes the tool adds
    (--cuda's), as it does for pip (sglpatch.pythonenv.pip_config.uv_args). The machine's pip.conf
    (its indexes, find-links, constraints) is left out: uv is handed pip's configuration."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    empty = tmp_path / "emptyindex"
    empty.mkdir()
    index = tmp_path / "index"
    index.mkdir()
    e = {
        "PATH": f"{fake}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "UV_DEFAULT_INDEX": f"file://{empty}",  # for the uv calls that are not handed pip's configuration
        "UV_FIND_LINKS": str(index),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": f"file://{empty}",
        "PIP_FIND_LINKS": str(index),
        "PIP_CONSTRAINT": "",
    }
    e.pop("CUDA_HOME", None)
    return {"env": e, "fake": fake, "index": index, "tmp": tmp_path}


def dry_run(ctx, project, requires: list[str], *extra: str, venv: Path | None = None, installer: str = "uv"):
    art = release(ctx["tmp"], requires)
    venv = venv or ctx["tmp"] / "new-venv"
    args = ["apply", "--project", str(project), "--workdir", str(ctx["tmp"] / "fork"), "--venv", str(venv), "--dry-run"]
    args += ["--release-artifact", str(art), "--python", sys.executable, "--installer", installer, *extra]
    env = dict(os.environ, **ctx["env"])
    env.pop("CUDA_HOME", None)
    env.update({k: v for k, v in ctx.get("extra_env", {}).items()})
    return run_cli(list(args), env, ROOT, 300)


def fails(proc) -> list[str]:
    return [ln for ln in proc.stdout.splitlines() if ln.startswith("preflight: FAIL")]


needs_uv = pytest.mark.skipif(UV is None, reason="uv not installed (requirements-test.txt installs it)")


@needs_uv
def test_all_conditions_pass_and_the_plan_is_the_resolvers(env, project_copy):
    wheel(env["index"], "nvidia-cuda-runtime-cu12", "12.8.90")
    wheel(env["index"], "sglpatch-fake-dep", "1.0")
    tool(env["fake"], "nvidia-smi", "570.133.20, 12.0\n570.133.20, 12.0")
    proc = dry_run(env, project_copy, ["nvidia-cuda-runtime-cu12==12.8.90", "sglpatch-fake-dep"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resolved by: " in proc.stdout and "uv pip compile" in proc.stdout
    assert "the release's pins: nvidia-cuda-runtime-cu12==12.8.90\n" in proc.stdout  # pinned ones only; the extra is ignored
    assert "sglpatch-fake-dep==1.0" in proc.stdout and proc.stdout.startswith("plan: 2 packages for Python ")  # no extra
    assert f"plan: pins that differ from what {sys.executable} has (it stays as it is): nvidia-cuda-runtime-cu12 (none) -> 12.8.90\n" in proc.stdout
    assert "preflight: ok driver: driver 570.133.20 >= 525.60.13 for CUDA 12 (from nvidia-cuda-runtime-cu12 12.8.90)" in proc.stdout
    assert "preflight: ok python:" in proc.stdout and "preflight: ok disk:" in proc.stdout
    assert "preflight: skip nvcc: not needed" in proc.stdout and proc.stdout.rstrip().endswith("preflight: verdict: pass")
    assert not (env["tmp"] / "new-venv").exists() and not (env["tmp"] / "fork").exists()  # a dry run creates nothing


@needs_uv
@pytest.mark.parametrize(
    "pin,driver,floor",
    [("nvidia-cuda-runtime==13.0.96", "575.57.08", "580"), ("torch==2.9.1+cu128", "520.61.05", "525.60.13")],
    ids=["cuda13-from-runtime", "cuda12-from-torch-local-tag"],
)
def test_driver_too_old_for_the_torch_builds_cuda(env, project_copy, pin, driver, floor):
    name, version = pin.split("==")
    wheel(env["index"], name, version)
    tool(env["fake"], "nvidia-smi", f"{driver}, 12.0")
    proc = dry_run(env, project_copy, [pin])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    major = 13 if "13" in version.split(".")[0] else 12
    assert fails(proc) == [
        f"preflight: FAIL driver: NVIDIA driver {driver} is too old for CUDA {major} (from {name} {version}); "
        f"it needs >= {floor}: upgrade the driver on the host" + (", or try the CUDA 12 builds: --cuda 12.9" if major == 13 else "")
    ]  # 575.x shipped with CUDA 12.9: the CUDA 12 builds are offered (tests/test_venv_cuda12.py)
    assert "preflight refused: 1 condition(s) failed" in proc.stderr and "nothing was created" in proc.stderr


@needs_uv
def test_python_without_a_wheel(env, project_copy):
    wheel(env["index"], "sglpatch-fake-kernel", "1.0", tag="cp399-cp399-manylinux_2_17_x86_64")
    proc = dry_run(env, project_copy, ["sglpatch-fake-kernel==1.0"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = fails(proc)
    ver = ".".join(map(str, sys.version_info[:3]))
    assert line.startswith(f"preflight: FAIL python: Python {ver}: the release's pins cannot be installed: ")
    assert "sglpatch-fake-kernel" in line and "cp39" in line  # the resolver's own reason, on one line


def test_python_without_a_wheel_pip_resolver(env, project_copy):
    """pip's resolver picks an sdist when there is no wheel: the plan says so, the preflight refuses."""
    sdist_dir = env["index"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in {
            "sglpatch_fake_kernel-1.0/PKG-INFO": "Metadata-Version: 2.1\nName: sglpatch-fake-kernel\nVersion: 1.0\n",
            "sglpatch_fake_kernel-1.0/setup.py": "from setuptools import setup\nsetup(name='sglpatch-fake-kernel', version='1.0')\n",
        }.items():
            data = text.encode()
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tf.addfile(member, io.BytesIO(data))
    (sdist_dir / "sglpatch_fake_kernel-1.0.tar.gz").write_bytes(buf.getvalue())
    env["extra_env"] = {"PIP_NO_BUILD_ISOLATION": "1"}
    proc = dry_run(env, project_copy, ["sglpatch-fake-kernel==1.0"], installer="pip")
    assert "resolved by: " in proc.stdout and " -m pip install --dry-run" in proc.stdout, proc.stdout + proc.stderr
    assert "sglpatch-fake-kernel==1.0" in proc.stdout and "sdist only" in proc.stdout
    assert proc.returncode == 1
    assert any("FAIL python:" in ln and "no wheel of sglpatch-fake-kernel==1.0" in ln for ln in fails(proc)), proc.stdout
    assert any("ok disk:" in ln or "FAIL disk:" in ln for ln in proc.stdout.splitlines())
    assert " (3 x " in proc.stdout  # pip's report gives no sizes: the file's (the index's) size is read instead


@needs_uv
def test_free_disk_on_a_small_filesystem(env, project_copy):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user+mount namespaces here for a private tmpfs")
    wheel(env["index"], "sglpatch-fake-big", "1.0", payload=2 * 2**20)  # 3 x 2 MiB needed
    small = env["tmp"] / "small"
    small.mkdir()
    art = release(env["tmp"], ["sglpatch-fake-big==1.0"])
    cmd = [sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--workdir", str(env["tmp"] / "fork")]
    cmd += ["--venv", str(small / "new-venv"), "--dry-run", "--release-artifact", str(art), "--python", sys.executable]
    script = f"mount -t tmpfs -o size=4m none {small} && exec \"$@\""
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *cmd], capture_output=True, text=True, env=dict(os.environ, **env["env"]), timeout=300, cwd=ROOT
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = fails(proc)
    assert line.startswith(f"preflight: FAIL disk: 4.0 MiB free at {small}, need ~6.0 MiB (3 x 2.0 MiB of wheels)"), line
    assert line.endswith("; free space or pick another --venv directory")


def with_flashinfer_toml(project: Path) -> None:
    (project / "deps").mkdir(exist_ok=True)
    (project / "deps" / "flashinfer.toml").write_text((ROOT / "deps" / "flashinfer.toml").read_text())


@needs_uv
@pytest.mark.parametrize(
    "cap,nvcc,expect",
    [
        ("12.0", "12.7", "FAIL"),  # below P5's JIT floor
        ("12.0", "12.8", "ok-no-p1"),  # P5's JIT builds; P1's SM12x fusion needs 12.9
        ("12.0", "12.10", "ok"),  # 12.10 > 12.9 > 12.8 (not a string comparison)
        ("9.0", "12.8", "ok-h200"),  # not SM12x: P5's rule only
        ("9.0", None, "FAIL-none"),  # no nvcc anywhere: P5's JIT cannot build on any GPU
    ],
)
def test_nvcc_for_the_flashinfer_jit(env, project_copy, cap, nvcc, expect):
    with_flashinfer_toml(project_copy)
    wheel(env["index"], "sglpatch-fake-dep", "1.0")
    wheel(env["index"], "flashinfer-python", "0.7.2")
    wheel(env["index"], "nvidia-cutlass-dsl", "4.6.2")
    tool(env["fake"], "nvidia-smi", f"580.65.06, {cap}")
    cuda = env["tmp"] / f"cuda-{nvcc}"
    cuda.mkdir()
    if nvcc:
        tool(cuda / "bin", "nvcc", f"nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release {nvcc}, V{nvcc}.41\n")
    env["extra_env"] = {"CUDA_HOME": str(cuda)}
    if nvcc is None:  # this box's own nvcc (if any) off PATH too
        env["extra_env"]["PATH"] = f"{env['fake']}:{os.path.dirname(sys.executable)}:/usr/bin:/bin"
    proc = dry_run(env, project_copy, ["sglpatch-fake-dep", "flashinfer_python==0.6.3", "flashinfer_cubin==0.6.3"], "--with-flashinfer")
    assert "plan: override: flashinfer-python ==0.6.3 -> ==0.7.2 (deps/flashinfer.toml)" in proc.stdout, proc.stdout + proc.stderr
    assert "plan: override: flashinfer-cubin==0.6.3 dropped (its version must match" in proc.stdout
    assert "plan: override: nvidia-cutlass-dsl>=4.6.2 added (deps/flashinfer.toml)" in proc.stdout
    assert "  flashinfer-python==0.7.2 " in proc.stdout and "  nvidia-cutlass-dsl==4.6.2 " in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("preflight: ") and " nvcc: " in ln)
    jit = "flashinfer's JIT (P5's PCIe-IPC allreduce, P1's fusion) needs nvcc >= 12.8"
    want = {
        "FAIL": f"preflight: FAIL nvcc: {jit}; {cuda}/bin/nvcc (CUDA_HOME) is 12.7: set CUDA_HOME to a CUDA >= 12.8 toolkit",
        "ok-no-p1": f"preflight: ok nvcc: {cuda}/bin/nvcc (CUDA_HOME) is 12.8 >= 12.8 for flashinfer's JIT (P5); P1's fusion on "
                    "SM120 needs >= 12.9: leave --enable-flashinfer-allreduce-fusion off",
        "ok": f"preflight: ok nvcc: {cuda}/bin/nvcc (CUDA_HOME) is 12.10 >= 12.8 for flashinfer's JIT (P5) and P1 on SM120",
        "ok-h200": f"preflight: ok nvcc: {cuda}/bin/nvcc (CUDA_HOME) is 12.8 >= 12.8 for flashinfer's JIT (P5)",
        "FAIL-none": f"preflight: FAIL nvcc: {jit}; none on CUDA_HOME or PATH: set CUDA_HOME to a CUDA >= 12.8 toolkit",
    }[expect]
    assert line == want
    if expect.startswith("FAIL"):
        assert proc.returncode == 1 and fails(proc) == [line]
    else:
        assert proc.returncode == 0 and not fails(proc)


@needs_uv
def test_several_failures_one_line_each_and_an_existing_venv_is_refused(env, project_copy):
    wheel(env["index"], "nvidia-cuda-runtime", "13.0.96")
    tool(env["fake"], "nvidia-smi", "550.54.15, 12.0")
    cuda = env["tmp"] / "cuda"
    tool(cuda / "bin", "nvcc", "Cuda compilation tools, release 12.6, V12.6.85")
    env["extra_env"] = {"CUDA_HOME": str(cuda)}
    with_flashinfer_toml(project_copy)
    wheel(env["index"], "flashinfer-python", "0.7.2")
    wheel(env["index"], "nvidia-cutlass-dsl", "4.6.2")
    proc = dry_run(env, project_copy, ["nvidia-cuda-runtime==13.0.96"], "--with-flashinfer")
    assert [ln.split(":")[1] for ln in fails(proc)] == [" FAIL driver", " FAIL nvcc"], proc.stdout
    assert proc.returncode == 1
    serving = env["tmp"] / "serving"
    make_venv(serving)
    proc = dry_run(env, project_copy, ["nvidia-cuda-runtime==13.0.96"], venv=serving)
    assert proc.returncode == 1 and f"--venv {serving} exists and is not empty" in proc.stderr


def test_the_serving_venvs_own_tree_is_refused(env, project_copy, tmp_path):
    """An editable install points at the workdir: rebuilding that tree would change the serving venv."""
    serving_py = make_venv(tmp_path / "serving")
    tree = tmp_path / "sglang-fork"
    (tree / "python" / "sglang").mkdir(parents=True)
    (tree / "python" / "sglang" / "__init__.py").write_text("")
    site = subprocess.run([str(serving_py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True)
    (Path(site.stdout.strip()) / "__editable__.sglang.pth").write_text(f"{tree / 'python'}\n")
    art = release(tmp_path, [])
    args = ["apply", "--project", str(project_copy), "--workdir", str(tree), "--venv", str(tmp_path / "new"), "--dry-run"]
    proc = sglpatch(*args, "--release-artifact", str(art), "--python", str(serving_py), env=env["env"])
    assert proc.returncode == 1 and f"serves sglang from {tree} (editable): the new venv needs its own tree" in proc.stderr, proc.stderr
    assert "plan:" not in proc.stdout


@needs_uv
@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_build_makes_a_new_venv_and_leaves_the_serving_one_alone(env, project_copy, tmp_path, installer):
    """A real (small) build: the plan from the local index, then the patched tree editable."""
    serving = tmp_path / "serving"
    serving_py = make_venv(serving)
    before = sorted(p.name for p in serving.rglob("*"))
    wheel(env["index"], "sglpatch-fake-dep", "1.0")
    art = release(tmp_path, ["sglpatch-fake-dep==1.0"])
    new = tmp_path / "new"
    e = dict(os.environ, **env["env"])
    e.pop("UV_DEFAULT_INDEX")  # the editable build needs setuptools from the registry (uv's cache)
    e["PIP_INDEX_URL"] = os.environ["PIP_INDEX_URL"]  # the registry conftest found
    proc = sglpatch(
        "apply", "--project", str(project_copy), "--workdir", str(tmp_path / "fork"), "--source", "sdist", "--venv", str(new),
        "--release-artifact", str(art), "--python", str(serving_py), "--installer", installer, env=e,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "preflight: verdict: pass" in proc.stdout and "the release's pins: sglpatch-fake-dep==1.0" in proc.stdout
    assert f"installed sglang editable from {(tmp_path / 'fork').resolve()}/python into {new}/bin/python" in proc.stdout
    assert "the way back: your old interpreter" in proc.stdout
    assert (new / ("sglpatch-plan.toml" if installer == "uv" else "sglpatch-plan.txt")).is_file()
    listing = subprocess.run([UV, "pip", "list", "--python", str(new / "bin" / "python")], capture_output=True, text=True).stdout
    assert "sglpatch-fake-dep" in listing and "sglang" in listing
    assert sorted(p.name for p in serving.rglob("*")) == before  # the serving venv is untouched


@needs_uv
@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_dry_run_plan_shows_the_index_sizes_and_their_total_first(env, project_copy, installer):
    """Issue 50: from an index whose pages give no sizes (PEP 503 HTML, as pip's resolver's report never
    does) every size was `?` and the download had no total; each file's size now comes from the index
    (HEAD, as the flashinfer plan reads it), their total first. The index: an http.server on 127.0.0.1."""
    import http.server
    import threading

    web = env["tmp"] / "web"
    files = {name: wheel(web / "simple" / name, name, "1.0", payload=pay) for name, pay in
             (("sglpatch-fake-small", 2**20), ("sglpatch-fake-big", 3 * 2**20 + 2**19))}
    (web / "simple" / "index.html").write_text("".join(f'<a href="{n}/">{n}</a>\n' for n in files))
    for name, path in files.items():
        (web / "simple" / name / "index.html").write_text(f'<a href="{path.name}">{path.name}</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        sizes = True  # False: HEAD answers nothing (an index that does not say)

        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(web), **k)

        def do_HEAD(self):  # noqa: N802  (http.server's name)
            return super().do_HEAD() if Quiet.sizes else self.send_error(405)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    index = f"http://127.0.0.1:{srv.server_port}/simple"
    env["env"].pop("UV_FIND_LINKS")
    env["env"].update(UV_DEFAULT_INDEX=index, PIP_INDEX_URL=index, PIP_FIND_LINKS="", UV_CACHE_DIR=str(env["tmp"] / "uv-cache"))
    tool(env["fake"], "nvidia-smi", "570.133.20, 12.0")
    try:
        proc = dry_run(env, project_copy, [f"{n}==1.0" for n in files], installer=installer)
        Quiet.sizes = False
        silent = dry_run(env, project_copy, [f"{n}==1.0" for n in files], installer=installer)
    finally:
        srv.shutdown()
    assert "plan: 0.0 MiB to download (2 packages; size unknown for 2: the index did not say)\n" in silent.stdout, silent.stdout
    assert "the stated floor; the resolver gave no sizes" in silent.stdout  # the disk check's 25 GiB
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    sizes = {n: p.stat().st_size for n, p in files.items()}
    for name, n in sizes.items():
        (row,) = [ln for ln in out.splitlines() if ln.startswith(f"  {name}==1.0 ")]
        assert f" {n / 2**20:9.1f} MiB  wheel" in row, row
    total = f"plan: {sum(sizes.values()) / 2**20:.1f} MiB to download ({len(files)} packages)\n"
    assert total in out and out.index(total) < out.index("  sglpatch-fake-"), out
    assert f"need ~{3 * sum(sizes.values()) / 2**20:.1f} MiB (3 x " in out  # the disk check reads the same sizes


@pytest.mark.slow
@needs_uv
def test_dry_run_resolves_the_real_pinned_release(tmp_path):
    """scripts/apply.sh --venv --dry-run on this project: uv resolves sglang 0.5.9's own pins."""
    new = tmp_path / "new"
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    proc = subprocess.run(
        [str(ROOT / "scripts" / "apply.sh"), "--venv", str(new), "--dry-run", "--python", sys.executable, "--workdir", str(tmp_path / "fork")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    out = proc.stdout
    assert "sglang 0.5.9: " in proc.stderr and "requirements from sglang-0.5.9.tar.gz" in proc.stderr, proc.stderr
    assert "uv pip compile" in out and "--format pylock.toml" in out
    for pin in ("torch==2.9.1", "sgl-kernel==0.3.21", "flashinfer-python==0.6.3", "transformers==4.57.1"):
        assert f" {pin} " in out.split("the release's pins: ", 1)[1].split("\n", 1)[0] + " "
    assert "  nvidia-cuda-runtime-cu12==" in out and " GiB to download" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("preflight: verdict: ")
    no_driver = "FAIL driver: no NVIDIA driver answers here" in out  # a box without one: cannot run here (125)
    assert proc.returncode == (0 if verdict.endswith("pass") else 125 if no_driver else 1)
    assert not new.exists() and not (tmp_path / "fork").exists()
