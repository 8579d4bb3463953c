"""The JIT build check on the box (sglpatch.pythonenv.jit_kernels): `sglpatch apply --with-flashinfer`, `sglpatch
doctor` and `python -m sglpatch.pythonenv.jit_kernels` build, in the serving Python, the JIT kernels of its sglang
that include flashinfer's headers, with real processes, real nvcc and real flashinfer headers.

The serving Pythons are scratch venvs: each sees the 0.5.23 test venv's packages (torch,
apache-tvm-ffi, flashinfer-python 0.7.2, --no-deps) and imports sglang from its workdir (a .pth,
as an editable install), plus installed stand-ins for what the set checks: nvidia-cutlass-dsl
4.6.2 and quack-kernels 0.2.4 (metadata only, from a local index, so `--with-flashinfer` removes
quack and records the way back without the network). Stand-in: pynvml (NVML needs a GPU), empty.
Two workdirs: the series (P6 in: builds) and the series without P6 (nvcc fails in flashinfer's
fastdiv.cuh). CUDA_HOME is the toolkit's folder, as on the user's box.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from conftest import ROOT, SERIES, copy_project, cuda_home, git, sglpatch, venv_0523
from sglpatch.pythonenv import flashinfer_set, jit_kernels
from test_flashinfer_set import wheel

pytestmark = pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc not found on PATH: the JIT kernels cannot be compiled here")
P6 = "0006-jit_kernel-flashinfer-bundled-CCCL-for-rope.patch"
ROPE = "rope (sglang.jit_kernel.rope._jit_apply_rope_pos_ids_cos_sin_cache_module)"
FASTDIV = "fastdiv.cuh(39): error: qualified name is not allowed"
# the sglpatch under test (a mutated copy under tests/mutants.py), for every tool process: the test
# venv's editable install may point elsewhere; the serving Pythons never see it
TOOL = {"PYTHONPATH": str(Path(jit_kernels.__file__).resolve().parents[2])}


def nvcc_release() -> str:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    return out.split("release ", 1)[1].split(",", 1)[0]


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """A local index with the stand-ins, the environment the CLI runs with, the stub folder."""
    top = tmp_path_factory.mktemp("jit")
    index, empty, stub = top / "index", top / "empty", top / "stub"
    for d in (index, empty, stub):
        d.mkdir()
    wheel(index, "nvidia-cutlass-dsl", "4.6.2")
    wheel(index, "quack-kernels", "0.2.4")
    (stub / "pynvml.py").write_text("# stand-in: NVML needs a GPU; nothing here calls it\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(UV_DEFAULT_INDEX=f"file://{empty}", UV_FIND_LINKS=str(index), UV_CACHE_DIR=str(top / "uv-cache"),
               PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index), CUDA_HOME=cuda_home(),
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    env.pop("PIP_CONSTRAINT", None)
    assert venv_0523().exists(), "scripts/test.sh builds the 0.5.23 test venv (SGLPATCH_TEST_VENV_0523)"
    return {"top": top, "env": env, "stub": stub}


def serving(box: dict, name: str, workdir: Path) -> str:
    """A scratch venv serving sglang from workdir/python, holding the stand-ins."""
    d = box["top"] / name
    venv.EnvBuilder(with_pip=False).create(d)
    py = str(d / "bin" / "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    site0523 = subprocess.run([str(venv_0523()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    assert sysconfig.get_python_version() in site0523
    (Path(purelib) / "_serving.pth").write_text(f"{workdir / 'python'}\n{box['stub']}\n"
                                                f"import site; site.addsitedir({site0523!r})\n")
    uv = flashinfer_set.find_uv()
    subprocess.run([uv, "pip", "install", "-q", "--python", py, "nvidia-cutlass-dsl==4.6.2", "quack-kernels==0.2.4"],
                   check=True, capture_output=True, env=box["env"])
    return py


@pytest.fixture(scope="module")
def applied(box):
    """`sglpatch apply --with-flashinfer` into two scratch venvs: the series, and the series without P6."""
    out = {}
    for name in ("series", "minus-p6"):
        project = copy_project(box["top"] / f"project-{name}")
        shutil.copytree(ROOT / "deps", project / "deps")
        if name == "minus-p6":
            series = project / "series"
            series.write_text("".join(ln for ln in series.read_text().splitlines(True) if ln.strip() != P6))
            (project / "patches" / P6).unlink()
        wd = box["top"] / f"fork-{name}"
        py = serving(box, f"serving-{name}", wd)
        res = sglpatch("apply", "--project", str(project), "--workdir", str(wd), "--source", "sdist", "--python", py,
                       "--with-flashinfer", env=dict(box["env"], **TOOL), timeout=900)
        out[name] = {"py": py, "wd": wd, "project": project, "res": res,
                     "back": f"{flashinfer_set.find_uv()} pip install --python {py} quack-kernels==0.2.4"}
    return out


def test_apply_with_flashinfer_builds_the_jit_kernels_of_the_series(applied):
    a = applied["series"]
    res = a["res"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout.splitlines()
    assert out[-1] == (f"jit-kernels: {ROPE} built for sm_120 with flashinfer-python 0.7.2 and nvcc {nvcc_release()} "
                       "(compile only, no GPU)"), res.stdout
    assert f"carries {len(SERIES)} patches:" in res.stdout and f"  {P6}: jit_kernel: flashinfer bundled CCCL for rope" in out
    assert f"removed quack-kernels; the way back: {a['back']}" in res.stdout
    assert "sglpatch: jit-kernels: building the JIT kernels that include flashinfer headers in " in res.stderr
    # the way back is kept in the workdir for the doctor
    assert git(a["wd"], "config", "--local", "sglpatch.flashinfer-way-back") == a["back"]


def test_apply_with_flashinfer_fails_in_one_line_without_p6_naming_kernel_cause_and_way_back(applied, box):
    a = applied["minus-p6"]
    res = a["res"]
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"carries {len(SERIES) - 1} patches:" in res.stdout  # the tree and the set are in; the check is the verdict
    err = res.stderr.strip().splitlines()
    assert err[-1] == (f"sglpatch: error: jit-kernels: {ROPE} does not build for sm_120 with flashinfer-python 0.7.2 and "
                       f"nvcc {nvcc_release()}: {FASTDIV}; the way back: {a['back']}")
    # the way back it names puts the old set back
    subprocess.run(a["back"].split(), check=True, capture_output=True, env=box["env"])
    assert flashinfer_set.installed(a["py"]).get("quack-kernels") == "0.2.4"


def jitcheck_cli(box: dict, py: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(box["env"], **TOOL)
    return subprocess.run([sys.executable, "-m", "sglpatch.pythonenv.jit_kernels", "--python", py, *args], capture_output=True, text=True,
                          env=env, timeout=900, cwd=box["top"])


def test_the_module_alone_pass_and_fail(applied, box, monkeypatch, capsys):
    """`python -m sglpatch.pythonenv.jit_kernels`: exit 0 and the built line; exit 1 and the line naming the
    kernel, nvcc's first error and the way back given; 125 without nvcc. The passing build is apply's
    above (the same child, tree and arch: 25 CPU-s again); here main() hands --python and --arch on and
    maps its verdict to exit 0, in this process."""
    ok = jit_kernels.Verdict("ok", f"{ROPE} built for sm_100 with flashinfer-python 0.7.2 (compile only, no GPU)")
    asked = []
    monkeypatch.setattr(jit_kernels, "run", lambda py, arch: asked.append((py, arch)) or ok)
    assert jit_kernels.main(["--python", applied["series"]["py"], "--arch", "10.0", "--way-back", "x"]) == 0
    assert asked == [(applied["series"]["py"], "10.0")] and capsys.readouterr().out == f"jit-kernels: {ok.text}\n"
    monkeypatch.undo()
    bad = jitcheck_cli(box, applied["minus-p6"]["py"], "--way-back", "uv pip install flashinfer-python==0.6.3")
    assert bad.returncode == 1 and bad.stdout.splitlines() == [
        f"jit-kernels: {ROPE} does not build for sm_120 with flashinfer-python 0.7.2 and nvcc {nvcc_release()}: {FASTDIV}; "
        "the way back: uv pip install flashinfer-python==0.6.3"], bad.stdout + bad.stderr
    env = dict(box["env"], **TOOL, PATH="/usr/bin:/bin")
    env.pop("CUDA_HOME")
    none = subprocess.run([sys.executable, "-m", "sglpatch.pythonenv.jit_kernels", "--python", applied["series"]["py"]], capture_output=True,
                          text=True, env=env, timeout=300)
    assert none.returncode == 125 and none.stdout.startswith("jit-kernels: not checked: no nvcc"), none.stdout + none.stderr


def test_doctor_shows_the_check_with_the_profiles_arch_and_the_recorded_way_back(applied, box):
    a = applied["minus-p6"]
    env = dict(box["env"], **TOOL)
    r = subprocess.run([sys.executable, "-m", "sglpatch.gpu.doctor", "--project", str(ROOT), "--python", a["py"],
                        "--profile", "h200x2", "--nvidia-smi", str(box["top"] / "no-smi"), "--no-p2p"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 125, r.stdout + r.stderr  # no GPU here: the GPU checks could not run
    jit = [ln for ln in r.stdout.splitlines() if " jit-kernels: " in ln]
    assert jit == [f"fail jit-kernels: {ROPE} does not build for sm_90 with flashinfer-python 0.7.2 and nvcc "
                   f"{nvcc_release()}: {FASTDIV}; fix: the way back: {a['back']}"], r.stdout
    names = [ln.split(":")[0].split()[-1] for ln in r.stdout.splitlines() if not ln.startswith("doctor:")]
    assert names[names.index("nvcc") + 1] == "jit-kernels"
    r = subprocess.run([sys.executable, "-m", "sglpatch.gpu.doctor", "--project", str(ROOT), "--python", a["py"],
                        "--nvidia-smi", str(box["top"] / "no-smi"), "--no-p2p", "--no-jit"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert "skip jit-kernels: not run (--no-jit)" in r.stdout.splitlines(), r.stdout


@pytest.mark.parametrize("new_venv", [True, False])
def test_the_failure_line_names_the_way_back_of_what_apply_touched(monkeypatch, tmp_path, new_venv):
    """apply --venv NEWDIR --with-flashinfer runs the check in the new venv: its failure names that venv
    (nothing of the serving Python was replaced); into --python it names the recorded way back."""
    from sglpatch.pythonenv import flashinfer_set, jit_kernels
    from sglpatch.commands import apply as apply_cmd
    from sglpatch.errors import SglpatchError

    monkeypatch.setattr(jit_kernels, "run", lambda py: jit_kernels.Verdict("fail", "rope does not build"))
    monkeypatch.setattr(flashinfer_set, "recorded_way_back", lambda wd: "uv pip install flashinfer-python==0.6.3")
    with pytest.raises(SglpatchError) as e:
        apply_cmd._jit_check("/v/bin/python", tmp_path, new_venv=new_venv)
    back = "none needed, the new venv /v/bin/python is all it touched (delete it)" if new_venv else \
        "uv pip install flashinfer-python==0.6.3"
    assert str(e.value) == f"jit-kernels: rope does not build; the way back: {back}"
