"""`apply --venv DIR --dry-run --cuda 12.8`: the CUDA 12 builds from their own indexes, through
the real console script and the real resolver (uv pip compile).

What cannot be reached here is a local one: the PyTorch and SGLang wheel indexes are PEP 503
pages served by an http.server on 127.0.0.1 (the project's deps/cuda12.toml pointed at it, as
the table's loopback rule allows), holding small wheels named like the real builds
(torch-2.14.1+cu126-cp3XX-cp3XX-manylinux_2_28_x86_64.whl); the registry is a local find-links
folder with the release's default (CUDA 13) builds, as in tests/test_venv_preflight.py. The
fake nvidia-smi says which driver and GPUs the host has.
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from test_venv_preflight import env, fails, release, tmp_path, tool  # noqa: F401  (env, tmp_path: the fixtures)

from conftest import ROOT

UV = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
CONSOLE = Path(sys.executable).parent / "sglpatch"
PY = f"cp{sys.version_info[0]}{sys.version_info[1]}"
PLAT = f"{PY}-{PY}-manylinux_2_28_x86_64"
pytestmark = pytest.mark.skipif(not Path(UV).exists() or not CONSOLE.exists() or os.uname().machine != "x86_64",
                                reason="needs uv, the installed console script and an x86_64 host")
REAL_PINS = ["torch==2.14.1", "torchvision", "sglang-kernel==0.4.10", "flashinfer_python[cu13]==0.7.2", "nvshmem4py-cu13",
             "cuda-python>=13.0"]


def wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", requires=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    extras = sorted({r.split('extra == "', 1)[1].rstrip('"') for r in requires if 'extra == "' in r})
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Provides-Extra: {x}\n" for x in extras)
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def pep503(root: Path) -> None:
    """index.html pages for every project folder under each index folder of root."""
    for index in [p for p in root.glob("*/*") if p.is_dir()]:
        projects = sorted(p.name for p in index.iterdir() if p.is_dir())
        (index / "index.html").write_text("".join(f'<a href="{n}/">{n}</a>\n' for n in projects))
        for n in projects:
            files = sorted(f.name for f in (index / n).glob("*.whl"))
            (index / n / "index.html").write_text("".join(f'<a href="{f.replace("+", "%2B")}">{f}</a>\n' for f in files))


@pytest.fixture
def cuda_env(env, project_copy):  # noqa: F811
    """The registry (find-links) with the release's CUDA 13 builds; PyTorch's and SGLang's
    per-CUDA indexes on a local HTTP server; the project's table pointed at it."""
    reg = env["index"]
    wheel(reg, "torch", "2.14.1", PLAT, ["nvidia-cuda-runtime==13.0.96"])
    wheel(reg, "nvidia-cuda-runtime", "13.0.96")
    wheel(reg, "nvidia-cuda-runtime-cu12", "12.6.77")
    wheel(reg, "torchvision", "0.29.1", PLAT, ["torch==2.14.1"])
    wheel(reg, "sglang-kernel", "0.4.10", "cp310-abi3-manylinux2014_x86_64", ["torch==2.14.1"])
    # its real METADATA: extras cu12 / cu13 pick the CUTLASS DSL libraries of that CUDA major
    wheel(reg, "flashinfer-python", "0.7.2", requires=['nvidia-cutlass-dsl-libs-cu12; extra == "cu12"',
                                                        'nvidia-cutlass-dsl-libs-cu13; extra == "cu13"'])
    wheel(reg, "nvidia-cutlass-dsl-libs-cu12", "4.8.0")
    wheel(reg, "nvidia-cutlass-dsl-libs-cu13", "4.8.0")
    wheel(reg, "nvshmem4py-cu13", "0.4.1")
    wheel(reg, "nvshmem4py-cu12", "0.4.1")
    wheel(reg, "cuda-python", "13.2.0")
    wheel(reg, "cuda-python", "12.9.4")
    web = env["tmp"] / "web"
    # PyTorch 2.14 ships no cu128 (dropped in 2.12): cu128 has 2.11.0 only, cu126 has 2.14.1
    wheel(web / "pytorch" / "cu128" / "torch", "torch", "2.11.0+cu128", PLAT)
    # 2.13.0 (sglang 0.5.18-0.5.21's pin): cu129 and cu126, no cu128; 2.14.1 has no cu129 (pytorch#187834)
    wheel(web / "pytorch" / "cu129" / "torch", "torch", "2.13.0+cu129", PLAT)
    wheel(web / "pytorch" / "cu126" / "torch", "torch", "2.13.0+cu126", PLAT)
    wheel(web / "pytorch" / "cu126" / "torch", "torch", "2.14.1+cu126", PLAT, ["nvidia-cuda-runtime-cu12==12.6.77"])
    wheel(web / "pytorch" / "cu126" / "torchvision", "torchvision", "0.29.1+cu126", PLAT, ["torch==2.14.1"])
    (web / "sglang" / "cu128" / "sgl-kernel").mkdir(parents=True)
    wheel(web / "sglang" / "cu126" / "sglang-kernel", "sglang-kernel", "0.4.6.post1+cu126", "cp310-abi3-manylinux2014_x86_64")
    pep503(web)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(web), **k)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    table = (ROOT / "deps" / "cuda12.toml").read_text()
    table = table.replace("https://download.pytorch.org/whl/{tag}", f"{url}/pytorch/{{tag}}")
    table = table.replace("https://docs.sglang.io/whl/{tag}", f"{url}/sglang/{{tag}}")
    (project_copy / "deps").mkdir()
    (project_copy / "deps" / "cuda12.toml").write_text(table)
    yield dict(env, project=project_copy, url=url, web=web)
    srv.shutdown()


def apply_dry_run(ctx, requires, *extra):
    art = release(ctx["tmp"], requires, version="0.5.9")
    args = ["apply", "--project", str(ctx["project"]), "--workdir", str(ctx["tmp"] / "fork"), "--venv", str(ctx["tmp"] / "new-venv"),
            "--dry-run", "--release-artifact", str(art), "--python", sys.executable, "--installer", "uv", *extra]
    e = dict(os.environ, **ctx["env"])
    e.pop("CUDA_HOME", None)
    return subprocess.run([str(CONSOLE), *args], capture_output=True, text=True, env=e, timeout=300, cwd=ctx["tmp"])


def test_driver_below_580_offers_the_cuda12_builds(cuda_env):
    tool(cuda_env["fake"], "nvidia-smi", "570.133.20, 12.0")
    proc = apply_dry_run(cuda_env, ["torch==2.14.1"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert fails(proc) == [
        "preflight: FAIL driver: NVIDIA driver 570.133.20 is too old for CUDA 13 (from nvidia-cuda-runtime 13.0.96); it needs >= 580: "
        "upgrade the driver on the host, or try the CUDA 12 builds: --cuda 12.8"
    ]


def test_cuda12_plan_shows_each_build_and_index_and_passes_where_all_exist(cuda_env):
    """An SM90 host (the cu126 build has its kernels) and only requirements with CUDA 12 builds."""
    tool(cuda_env["fake"], "nvidia-smi", "570.133.20, 9.0")
    proc = apply_dry_run(cuda_env, ["torch==2.14.1", "torchvision", "flashinfer_python[cu13]==0.7.2", "nvshmem4py-cu13"], "--cuda", "12.8")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    torch_index = f"{cuda_env['url']}/pytorch/cu126"
    assert f"--extra-index-url {torch_index}" in out  # the resolver's own command, as run
    assert (f"plan: CUDA 12.8 builds (--cuda): torch +cu126 from {torch_index}; flashinfer-python [cu12] extra; "
            f"nvshmem4py-cu13 nvshmem4py-cu12 (the CUDA 12 package); torchvision +cu126 from {torch_index} (its +cu126 build sorts above the registry's)\n") in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    assert lines["torch==2.14.1+cu126"].endswith(f"wheel       cu126 from {torch_index}")
    assert lines["torchvision==0.29.1+cu126"].endswith(f"cu126 from {torch_index}")
    assert lines["nvidia-cuda-runtime-cu12==12.6.77"].endswith("cu12") and "nvshmem4py-cu12==0.4.1" in lines
    assert "nvidia-cutlass-dsl-libs-cu12==4.8.0" in lines  # what flashinfer-python[cu12] pulls in
    assert "nvidia-cuda-runtime==" not in out and "-cu13==" not in out  # nothing of the CUDA 13 builds is left
    assert "preflight: ok driver: driver 570.133.20 >= 525.60.13 for CUDA 12 (from torch 2.14.1+cu126)" in out
    assert "preflight: ok gpu-arch: torch 2.14.1+cu126 has kernels for every GPU here (up to SM90)" in out
    assert out.rstrip().endswith("preflight: verdict: pass") and not fails(proc)


def test_a_cu129_build_above_cuda_12_8_is_taken_over_cu126(cuda_env):
    """torch 2.13.0 (0.5.18-0.5.21's pin) has cu129 and cu126 builds, no cu128: on a 570 driver
    (--cuda 12.8) the cu129 one runs by CUDA 12 minor-version compatibility and has SM120 kernels;
    a rule of "highest tag <= --cuda" took cu126 and refused the SM120 box."""
    tool(cuda_env["fake"], "nvidia-smi", "570.133.20, 12.0")
    proc = apply_dry_run(cuda_env, ["torch==2.13.0"], "--cuda", "12.8")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    index = f"{cuda_env['url']}/pytorch/cu129"
    assert (f"plan: CUDA 12.8 builds (--cuda): torch +cu129 from {index} (above --cuda 12.8: CUDA 12 minor-version "
            "compatibility)\n") in out
    assert "  torch==2.13.0+cu129 " in out and "2.13.0+cu126" not in out
    assert "preflight: ok gpu-arch: torch 2.13.0+cu129 has kernels for every GPU here (up to SM120)" in out
    assert "preflight: ok driver: driver 570.133.20 >= 525.60.13 for CUDA 12 (from torch 2.13.0+cu129)" in out


def test_cuda12_refusal_names_both_ways_out_for_the_real_pins(cuda_env):
    """0.5.23's CUDA-specific pins on the user's box (SM120, driver 570): torch's only CUDA 12 build
    is cu126 (no SM120 kernels), sglang-kernel 0.4.10 has none, cuda-python>=13.0 has none."""
    tool(cuda_env["fake"], "nvidia-smi", "570.133.20, 12.0\n570.133.20, 12.0")
    proc = apply_dry_run(cuda_env, REAL_PINS, "--cuda", "12.8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    u = cuda_env["url"]
    way = "a driver >= 580 runs the release as pinned (drop --cuda)"
    assert fails(proc) == [
        f"preflight: FAIL cuda12: sglang-kernel 0.4.10 has no CUDA 12 build (none on {u}/sglang/cu129, {u}/sglang/cu128, {u}/sglang/cu126; "
        f"the default index's is the release's CUDA 13 one): {way}, or sglang 0.5.19 is the last release with a CUDA 12 lane "
        "(sgl-project/sglang#38404)",
        "preflight: FAIL cuda12: cuda-python>=13.0 has no CUDA 12 build (cuda-python 12.x are the CUDA 12 bindings; 13.x need a driver "
        f">= 580.65 (cuda-python install docs)): {way}",
        f"preflight: FAIL gpu-arch: torch 2.14.1+cu126 has no kernels for SM120 (its cu126 builds stop at SM90): {way}, or torch 2.13.0 "
        "is the last with a CUDA 12 SM120 build (cu129): sglang 0.5.18-0.5.21 pin it (0.5.11-0.5.17: 2.11.0, cu128)",
    ]
    assert "plan: CUDA 12.8 builds (--cuda): torch +cu126" in proc.stdout and "sglang-kernel: none; cuda-python: none" in proc.stdout
    kernel = next(ln for ln in proc.stdout.splitlines() if ln.startswith("  sglang-kernel==0.4.10 "))
    assert kernel.endswith("wheel       no CUDA 12 build (the default index's)")
    assert "preflight refused: 3 condition(s) failed" in proc.stderr and not (cuda_env["tmp"] / "new-venv").exists()


def test_cuda_values_and_table_urls_are_validated(cuda_env):
    tool(cuda_env["fake"], "nvidia-smi", "570.133.20, 9.0")
    for bad in ("13.0", "12", "--python"):
        proc = apply_dry_run(cuda_env, ["torch==2.14.1"], f"--cuda={bad}")
        assert proc.returncode == 1 and f"sglpatch: error: --cuda '{bad}': give the CUDA 12 release" in proc.stderr, proc.stderr
    table = cuda_env["project"] / "deps" / "cuda12.toml"
    for index in ("http://192.0.2.1/whl/{tag}", "--index-url=https://x/{tag}", "file:///etc/{tag}", "https://download.pytorch.org/whl/cu126"):
        table.write_text(f'[local.torch]\nindex = "{index}"\ntags = ["cu126"]\n')
        proc = apply_dry_run(cuda_env, ["torch==2.14.1"], "--cuda", "12.8")
        assert proc.returncode == 1 and "deps/cuda12.toml: local.torch.index" in proc.stderr and "plan:" not in proc.stdout, proc.stderr



def test_the_users_no_index_wins_over_the_cuda12_indexes_a_find_links_build_is_taken(cuda_env):
    """Issue 52, what wins: pip's no-index (PIP_NO_INDEX) turns every index off, the tool's CUDA 12 ones
    included, as pip's --no-index ignores the --extra-index-url on its own command line; uv is told so
    (--no-index, no index handed) and the plan says it. The user's extra index is searched with the
    tool's (they stand side by side); with no-index the CUDA 12 build must lie in a find-links folder."""
    tool(cuda_env["fake"], "nvidia-smi", "570.133.20, 9.0")
    torch_index = f"{cuda_env['url']}/pytorch/cu126"
    extra = f"file://{cuda_env['tmp'] / 'emptyindex'}"
    cuda_env["env"]["PIP_EXTRA_INDEX_URL"] = extra
    proc = apply_dry_run(cuda_env, ["torch==2.14.1"], "--cuda", "12.8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"--extra-index-url {torch_index} --extra-index-url {extra} " in proc.stdout  # the tool's first, the user's kept
    assert f"; the tool's extra-index-url {torch_index} (your pip configuration, handed to uv" in proc.stdout
    cuda_env["env"]["PIP_NO_INDEX"] = "1"
    proc = apply_dry_run(cuda_env, ["torch==2.14.1"], "--cuda", "12.8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (resolved,) = [ln for ln in proc.stdout.splitlines() if "resolved by: " in ln]
    assert "--no-index" in resolved and "index-url" not in resolved and "--default-index" not in resolved, resolved
    assert f"no-index (no index searched, not the tool's {torch_index} either)" in proc.stdout
    (line,) = fails(proc)
    assert line.startswith("preflight: FAIL python: ") and "torch==2.14.1+cu126" in line, line
    shutil.copy(next((cuda_env["web"] / "pytorch" / "cu126" / "torch").glob("torch-2.14.1+cu126-*.whl")), cuda_env["index"])
    proc = apply_dry_run(cuda_env, ["torch==2.14.1"], "--cuda", "12.8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "  torch==2.14.1+cu126 " in proc.stdout
