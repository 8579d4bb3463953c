"""The JIT build check on the box (sglpatch.pythonenv.jit_kernels): `sglpatch apply --with-flashinfer`, `sglpatch
doctor` and `python -m sglpatch.pythonenv.jit_kernels` build, in the serving Python, the JIT kernels of its sglang
that include flashinfer's headers, with real processes, real nvcc and real flashinfer headers.

The serving Pythons are scratch venvs: each sees the 0.5.23 test venv's packages (torch,
apache-tvm-ffi, flashinfer-python 0.7.2, --no-deps) and imports sglang from its workdir (a .pth,
as an editable install, with a stand-in install record), plus installed stand-ins for what the set checks: nvidia-cutlass-dsl
4.6.2 and quack-kernels 0.2.4 (metadata only, from a local index, so `--with-flashinfer` removes
quack and records the way back without the network). Stand-in: pynvml (NVML needs a GPU), empty.
Two workdirs: the series (P6 in: builds) and the series without P6 (nvcc fails in flashinfer's
fastdiv.cuh). CUDA_HOME is the toolkit's folder, as on the user's box.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from conftest import ROOT, SERIES, copy_project, cuda_home, git, sglpatch, venv_0523
from sglpatch.pythonenv import flashinfer_set, jit_kernels
from test_doctor import fake_smi
from test_flashinfer_set import wheel

pytestmark = pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc not found on PATH: the JIT kernels cannot be compiled here")
P6 = "0006-jit_kernel-flashinfer-bundled-CCCL-for-rope.patch"
ROPE = "rope (sglang.jit_kernel.rope._jit_apply_rope_pos_ids_cos_sin_cache_module)"
FASTDIV = "fastdiv.cuh(39): error: qualified name is not allowed"
# what a kept verdict's line ends with
KEPT = re.compile(r" \(kept from \d{4}-\d\d-\d\d \d\d:\d\d UTC; --recheck-jit checks again\)")
# the sglpatch under test (a mutated copy under tests/mutants.py), for every tool process: the test
# venv's editable install may point elsewhere; the serving Pythons never see it
TOOL = {"PYTHONPATH": str(Path(jit_kernels.__file__).resolve().parents[2])}


def nvcc_release() -> str:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    return out.split("release ", 1)[1].split(",", 1)[0]


@pytest.fixture(scope="module")
def box(tmp_path_factory, request):
    """A local index with the stand-ins, the environment the CLI runs with, the stub folder."""
    # the 0.5.9 sdist and its tree in the tests' cache first, under the cache's lock: this file starts
    # with a fresh clone's first workers, and the applies below would fill a cold cache beside theirs
    request.getfixturevalue("patched_tree")
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
    record = Path(purelib) / "sglang-0.5.9.dist-info"  # the install record an editable install leaves (apply reads it)
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.9\n")
    (record / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    (record / "RECORD").write_text("")
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
        assert res.returncode == 0 or name == "minus-p6", res.stdout[-2000:] + res.stderr[-3000:]
        back = git(wd, "config", "--local", "sglpatch.flashinfer-way-back", check=False) if (wd / ".git").is_dir() else ""
        out[name] = {"py": py, "wd": wd, "project": project, "res": res, "env": dict(box["env"], **TOOL), "back": back}
    return out


def test_the_recorded_way_back_is_exactly_the_old_versions_from_the_users_index(applied, box):
    """Issue 52: uv's way back had none of the pip configuration the install was given and no
    --no-deps; it is now the install's own command for the versions it replaced, quoted."""
    a = applied["series"]
    words = shlex.split(a["back"])
    assert words[:5] == [flashinfer_set.find_uv(), "pip", "install", "--python", a["py"]], words
    assert words[-2:] == ["--no-deps", "quack-kernels==0.2.4"] and "--find-links" in words, words


def test_apply_with_flashinfer_builds_the_jit_kernels_of_the_series(applied):
    a = applied["series"]
    res = a["res"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout.splitlines()
    assert out[-1] == (f"jit-kernels: {ROPE} built for sm_120 with flashinfer-python 0.7.2 and nvcc {nvcc_release()} "
                       "(compile and link only, no GPU)"), res.stdout
    assert f"carries {len(SERIES)} patches:" in res.stdout and f"  {P6}: jit_kernel: flashinfer bundled CCCL for rope" in out
    assert f"removed quack-kernels; the way back: {a['back']}" in res.stdout
    assert "sglpatch: jit-kernels: building the JIT kernels that include flashinfer headers in " in res.stderr
    # the way back is kept in the workdir for the doctor
    assert git(a["wd"], "config", "--local", "sglpatch.flashinfer-way-back") == a["back"]
    # a no-op apply again: the verdict is the one kept for this tree, flashinfer, nvcc and arch; nothing is built
    again = sglpatch("apply", "--project", str(a["project"]), "--workdir", str(a["wd"]), "--source", "sdist", "--python", a["py"],
                     "--with-flashinfer", env=dict(a["env"]), timeout=900)
    assert again.returncode == 0 and KEPT.fullmatch(again.stdout.splitlines()[-1].removeprefix(out[-1])), again.stdout
    assert "building the JIT kernels" not in again.stderr, again.stderr


def test_apply_with_flashinfer_fails_in_one_line_without_p6_naming_kernel_cause_and_way_back(applied, box):
    a = applied["minus-p6"]
    res = a["res"]
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"carries {len(SERIES) - 1} patches:" in res.stdout  # the tree and the set are in; the check is the verdict
    err = res.stderr.strip().splitlines()
    assert err[-1] == (f"sglpatch: error: jit-kernels: {ROPE} does not build for sm_120 with flashinfer-python 0.7.2 and "
                       f"nvcc {nvcc_release()}: {FASTDIV}; the way back: {a['back']}")
    # --recheck-jit: built again, not the verdict kept by the run above
    again = sglpatch("apply", "--project", str(a["project"]), "--workdir", str(a["wd"]), "--source", "sdist", "--python", a["py"],
                     "--with-flashinfer", "--recheck-jit", env=a["env"], timeout=900)
    assert again.returncode == 1 and again.stderr.strip().splitlines()[-1] == err[-1], again.stderr
    assert "sglpatch: jit-kernels: building the JIT kernels" in again.stderr
    alone = sglpatch("apply", "--project", str(a["project"]), "--workdir", str(a["wd"]), "--recheck-jit", env=a["env"])
    assert alone.returncode == 2 and alone.stderr.strip().splitlines() == [
        "sglpatch: error: --recheck-jit goes with --with-flashinfer (the JIT check runs after the set is installed)"], alone.stderr
    # the way back it names puts the old set back
    subprocess.run(shlex.split(a["back"]), check=True, capture_output=True, env=box["env"])
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
    ok = jit_kernels.Verdict("ok", f"{ROPE} built for sm_100 with flashinfer-python 0.7.2 (compile and link only, no GPU)")
    asked = []
    monkeypatch.setattr(jit_kernels, "run", lambda py, arch, recheck: asked.append((py, arch, recheck)) or ok)
    assert jit_kernels.main(["--python", applied["series"]["py"], "--arch", "10.0", "--way-back", "x", "--recheck-jit"]) == 0
    assert asked == [(applied["series"]["py"], "10.0", True)] and capsys.readouterr().out == f"jit-kernels: {ok.text}\n"
    monkeypatch.undo()
    # apply's verdict for this tree, flashinfer, nvcc and arch, kept
    bad = jitcheck_cli(box, applied["minus-p6"]["py"], "--way-back", "uv pip install flashinfer-python==0.6.3")
    text, _, back = bad.stdout.strip().partition("; the way back: ")
    fresh = f"jit-kernels: {ROPE} does not build for sm_120 with flashinfer-python 0.7.2 and nvcc {nvcc_release()}: {FASTDIV}"
    assert bad.returncode == 1 and KEPT.fullmatch(text.removeprefix(fresh)), bad.stdout + bad.stderr
    assert back == "uv pip install flashinfer-python==0.6.3" and len(bad.stdout.splitlines()) == 1
    env = dict(box["env"], **TOOL, PATH="/usr/bin:/bin")
    env.pop("CUDA_HOME")
    none = subprocess.run([sys.executable, "-m", "sglpatch.pythonenv.jit_kernels", "--python", applied["series"]["py"]], capture_output=True,
                          text=True, env=env, timeout=300)
    assert none.returncode == 125 and none.stdout.startswith("jit-kernels: not checked: no nvcc"), none.stdout + none.stderr


def test_doctor_shows_the_check_with_the_profiles_arch_and_the_recorded_way_back(applied, box, tmp_path):
    a = applied["minus-p6"]
    env = dict(box["env"], **TOOL)
    doctor = [sys.executable, "-m", "sglpatch.gpu.doctor", "--project", str(ROOT), "--python", a["py"], "--no-p2p"]
    smi = fake_smi(tmp_path / "smi", topo="nvlink-h200x2", cap="9.0", driver="590.48.01")  # GPUs, as nvidia-smi says
    r = subprocess.run([*doctor, "--profile", "h200x2", "--nvidia-smi", smi], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 1, r.stdout + r.stderr
    jit = [ln for ln in r.stdout.splitlines() if " jit-kernels: " in ln]
    assert jit == [f"fail jit-kernels: {ROPE} does not build for sm_90 with flashinfer-python 0.7.2 and nvcc "
                   f"{nvcc_release()}: {FASTDIV}; fix: the way back: {a['back']}"], r.stdout
    names = [ln.split(":")[0].split()[-1] for ln in r.stdout.splitlines() if not ln.startswith("doctor:")]
    assert names[names.index("nvcc") + 1] == "jit-kernels"
    r = subprocess.run([*doctor, "--nvidia-smi", smi, "--no-jit"], capture_output=True, text=True, env=env, timeout=900)
    assert "skip jit-kernels: not run (--no-jit)" in r.stdout.splitlines(), r.stdout
    # no GPU visible: the doctor exits 125 whatever the check says, so it builds nothing
    log = tmp_path / "nvcc.log"
    env["CUDA_HOME"] = str(fake_toolkit(tmp_path, log))
    r = subprocess.run([*doctor, "--nvidia-smi", str(box["top"] / "no-smi"), "--recheck-jit"], capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 125, r.stdout + r.stderr
    jit = [ln for ln in r.stdout.splitlines() if " jit-kernels: " in ln]
    assert jit == ["skip jit-kernels: not run: no GPU visible here, the doctor exits 125 anyway; `python -m "
                   "sglpatch.pythonenv.jit_kernels` checks the build alone"], r.stdout
    assert not log.exists()


def fake_toolkit(tmp: Path, log: Path) -> Path:
    """A CUDA_HOME whose nvcc writes each compile's arguments to log, then runs the real one; its
    libraries and headers are the real toolkit's. NVCC_SHOWN_RELEASE: the release --version names."""
    real = Path(cuda_home()).resolve()
    home = tmp / "cuda"
    (home / "bin").mkdir(parents=True)
    for sub in ("lib64", "include", "targets", "nvvm"):
        if (real / sub).exists():
            (home / sub).symlink_to(real / sub)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"""#!/bin/sh
if [ "$1" = --version ] && [ -n "$NVCC_SHOWN_RELEASE" ]; then
  "{real}/bin/nvcc" --version | sed "s/release [0-9.]*,/release $NVCC_SHOWN_RELEASE,/"; exit 0
fi
case " $* " in *" -c "*) echo "$*" >> "{log}";; esac
exec "{real}/bin/nvcc" "$@"
""")
    nvcc.chmod(0o755)
    return home


def check_in(env: dict, py: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglpatch.pythonenv.jit_kernels", "--python", py, *args], capture_output=True,
                          text=True, env=dict(env, **extra), timeout=900, cwd="/")


def test_a_wrapper_nvcc_without_cuda_home_builds_and_a_link_failure_is_not_checked(applied, box, tmp_path):
    """CUDA_HOME unset and the nvcc on PATH a script outside any CUDA tree (the box's /usr/local/bin/nvcc,
    `exec /usr/local/cuda-13.0/bin/nvcc "$@"`): tvm_ffi took the folder above the script for the toolkit
    and the link failed (cannot find -lcudart), named "does not build". The check hands the build the
    toolkit of the nvcc the wrapper runs. A link that fails all the same is "not checked", with its fix."""
    py = applied["series"]["py"]
    real = Path(cuda_home()).resolve() / "bin" / "nvcc"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    (tmp_path / "bin" / "nvcc").chmod(0o755)
    env = dict(box["env"], **TOOL, PATH=f"{tmp_path / 'bin'}:{box['env']['PATH']}", SGLPATCH_CACHE=str(tmp_path / "cache"))
    env.pop("CUDA_HOME")
    r = check_in(env, py)
    assert r.returncode == 0 and r.stdout == (f"jit-kernels: {ROPE} built for sm_120 with flashinfer-python 0.7.2 and nvcc "
                                              f"{nvcc_release()} (compile and link only, no GPU)\n"), r.stdout + r.stderr
    # a CUDA_HOME without the runtime library: compiled, not linked; no verdict on the kernel, none kept
    home = tmp_path / "bare-cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").symlink_to(tmp_path / "bin" / "nvcc")
    r = check_in(env, py, CUDA_HOME=str(home))
    line = r.stdout.strip()
    assert r.returncode == 125 and line.startswith(f"jit-kernels: not checked: {ROPE} compiled for sm_120 with flashinfer-python "
                                                   f"0.7.2 and nvcc {nvcc_release()} but did not link: "), r.stdout + r.stderr
    assert "cannot find -lcudart" in line and line.endswith(
        f"; fix: set CUDA_HOME to the CUDA toolkit of {home}/bin/nvcc (the folder whose lib64 holds libcudart.so; {home} has none)")


def test_an_import_that_fails_is_not_checked_and_names_its_fix(applied, box, tmp_path):
    """The serving Python lacks one of sglang's dependencies (orjson): the kernel's module does not
    import, nothing is built. Not a verdict on the build, so no `apply --with-flashinfer`."""
    (tmp_path / "lacks").mkdir()
    (tmp_path / "lacks" / "orjson.py").write_text('raise ModuleNotFoundError("No module named \'orjson\'", name="orjson")\n')
    py = applied["series"]["py"]
    env = dict(box["env"], PYTHONPATH=f"{TOOL['PYTHONPATH']}:{tmp_path / 'lacks'}", SGLPATCH_CACHE=str(tmp_path / "cache"))
    r = check_in(env, py)
    assert r.returncode == 125 and r.stdout.splitlines() == [
        f"jit-kernels: not checked: sglang.jit_kernel.rope does not import in {py}: ModuleNotFoundError: No module named "
        f"'orjson'; fix: install sglang's own dependencies into {py}: SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG=0.5.9 "
        f"{flashinfer_set.find_uv()} pip install --python {py} -e {applied['series']['wd'] / 'python'}"
        f" && sglpatch apply --with-flashinfer --python {py} --workdir {applied['series']['wd']}"], r.stdout + r.stderr


def test_the_verdict_is_kept_per_tree_flashinfer_nvcc_and_arch(applied, box, tmp_path):
    """minus-p6's "does not build" (nvcc stops in seconds) in a cache of its own: the second call
    builds nothing; a new commit of the tree, another flashinfer, another nvcc release, another arch,
    --recheck-jit and SGLPATCH_RECHECK_JIT=1 build again; a garbage, foreign or linked cache file is
    not read (and a link's target not written)."""
    a = applied["minus-p6"]
    log, cache = tmp_path / "nvcc.log", tmp_path / "cache"
    env = dict(box["env"], **TOOL, CUDA_HOME=str(fake_toolkit(tmp_path, log)), SGLPATCH_CACHE=str(cache))
    builds = lambda: len(log.read_text().splitlines()) if log.exists() else 0  # noqa: E731

    def check(*args: str, built: bool = True, **extra: str) -> str:
        n = builds()
        r = check_in(env, a["py"], *args, **extra)
        assert r.returncode == 1 and FASTDIV in r.stdout, r.stdout + r.stderr
        assert builds() == n + built, (args, extra, r.stdout)
        return r.stdout.strip()

    first = check()
    assert KEPT.fullmatch(check(built=False).removeprefix(first))
    assert [p.name for p in cache.iterdir()] == ["jit-kernels.json"]
    assert check("--recheck-jit") == first and check(SGLPATCH_RECHECK_JIT="1") == first
    assert "for sm_100 " in check("--arch", "10.0") and "nvcc 13.9:" in check(NVCC_SHOWN_RELEASE="13.9")
    kept = (cache / "jit-kernels.json").read_text()
    foreign = json.loads(kept)
    for entry in foreign.get("entries", {}).values():
        entry["text"] = ["not", "a", "line"]
    for planted in ("{not json", json.dumps({"schema": "other", "entries": {}}), json.dumps(foreign), None):
        if planted is None:  # a link to a file elsewhere: not read, and not written through
            (tmp_path / "elsewhere.json").write_text(kept)
            (cache / "jit-kernels.json").unlink()
            (cache / "jit-kernels.json").symlink_to(tmp_path / "elsewhere.json")
        else:
            (cache / "jit-kernels.json").write_text(planted)
        assert check() == first
    assert (tmp_path / "elsewhere.json").read_text() == kept and not (cache / "jit-kernels.json").is_symlink()
    # another flashinfer-python (its install record, ahead of the one the serving Python sees now)
    purelib = Path(a["py"]).parents[1] / "lib" / f"python{sysconfig.get_python_version()}" / "site-packages"
    other = purelib / "flashinfer_python-0.7.3.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.7.3\n")
    try:
        check()
    finally:
        shutil.rmtree(other)
    # a new commit of the tree
    git(a["wd"], "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "another tree")
    try:
        check()
    finally:
        git(a["wd"], "reset", "-q", "--hard", "HEAD~1")
    assert KEPT.fullmatch(check(built=False).removeprefix(first))


@pytest.mark.parametrize("new_venv", [True, False])
def test_the_failure_line_names_the_way_back_of_what_apply_touched(monkeypatch, tmp_path, new_venv):
    """apply --venv NEWDIR --with-flashinfer runs the check in the new venv: its failure names that venv
    (nothing of the serving Python was replaced); into --python it names the recorded way back."""
    from sglpatch.pythonenv import flashinfer_set, jit_kernels
    from sglpatch.commands import apply as apply_cmd
    from sglpatch.errors import SglpatchError

    monkeypatch.setattr(jit_kernels, "run", lambda py, **kw: jit_kernels.Verdict("fail", "rope does not build"))
    monkeypatch.setattr(flashinfer_set, "recorded_way_back", lambda wd: "uv pip install flashinfer-python==0.6.3")
    with pytest.raises(SglpatchError) as e:
        apply_cmd._jit_check("/v/bin/python", tmp_path, new_venv=new_venv)
    back = "none needed, the new venv /v/bin/python is all it touched (delete it)" if new_venv else \
        "uv pip install flashinfer-python==0.6.3"
    assert str(e.value) == f"jit-kernels: rope does not build; the way back: {back}"
