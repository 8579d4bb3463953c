"""`--with-flashinfer`: deps/flashinfer.toml's set goes into the serving Python (or a new venv's
plan) as one consistent set, with the real installer (uv, else pip), its real resolver and a real
`pip check`, against a local wheel index standing in for the registry (uv's / pip's find-links
with an empty default index, as tests/test_venv_preflight.py). The wheels carry the real
packages' names and the requirements that clash: quack-kernels 0.2.4 wants nvidia-cutlass-dsl<4.4,
flashinfer-python 0.7.2 >=4.6.2a0, flashinfer-cubin 0.6.3 ==0.6.3 of flashinfer-python.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import venv
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT
from sglpatch.pythonenv import flashinfer_set
from sglpatch.errors import SglpatchError

OLD = ["flashinfer-python==0.6.3", "flashinfer-cubin==0.6.3", "quack-kernels==0.2.4", "nvidia-cutlass-dsl==4.3.4"]


def wheel(index: Path, name: str, version: str, requires: tuple[str, ...] = (), pad: int = 0) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(index / f"{dist}-py3-none-any.whl", "w") as zf:
        if pad:  # bytes that do not compress: a wheel of a size the plan can show
            zf.writestr(f"{dist}.data/data/pad.bin", os.urandom(pad))
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A local index with the clashing packages, and the installers pointed at it only."""
    index, empty = tmp_path / "index", tmp_path / "empty"
    index.mkdir()
    empty.mkdir()
    wheel(index, "flashinfer-python", "0.6.3")
    wheel(index, "flashinfer-python", "0.7.2", ("nvidia-cutlass-dsl>=4.6.2a0", "cuda-tile>=1.4.0"))
    wheel(index, "flashinfer-cubin", "0.6.3", ("flashinfer-python==0.6.3",))
    wheel(index, "quack-kernels", "0.2.4", ("nvidia-cutlass-dsl<4.4.0,>=4.3.4",))
    wheel(index, "cuda-tile", "1.4.0")
    for v in ("4.3.4", "4.6.2"):
        wheel(index, "nvidia-cutlass-dsl", v)
    env = {"UV_DEFAULT_INDEX": f"file://{empty}", "UV_FIND_LINKS": str(index), "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    # the serving Python must not see the tool's own source (a PYTHONPATH with sglpatch's egg-info
    # would show in its pip check); the CLI runs below get it back
    tool_path = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    monkeypatch.delenv("PYTHONPATH", raising=False)
    project = tmp_path / "project"
    (project / "deps").mkdir(parents=True)
    (project / "deps" / "flashinfer.toml").write_text((ROOT / "deps" / "flashinfer.toml").read_text())
    return {"tmp": tmp_path, "env": env, "project": project, "cli_env": dict(os.environ, **env, **tool_path)}


def serving(tmp: Path, installer: str) -> str:
    """A clean venv holding 0.5.9's flashinfer set (pip in it only for the pip installer)."""
    d = tmp / f"serving-{installer}"
    venv.EnvBuilder(with_pip=installer == "pip").create(d)
    py = str(d / "bin" / "python")
    cmd = ["uv", "pip", "install", "-q", "--python", py, *OLD] if installer == "uv" else [py, "-m", "pip", "install", "-q", *OLD]
    subprocess.run(cmd, check=True, capture_output=True)
    return py


def has(py: str) -> dict[str, str]:
    return {k: v for k, v in flashinfer_set.installed(py).items() if k in ("flashinfer-python", "flashinfer-cubin", "quack-kernels",
                                                                  "nvidia-cutlass-dsl", "cuda-tile")}


def test_the_projects_file_is_read_as_documented():
    fs = flashinfer_set.read(ROOT)
    assert fs.requirements == ["flashinfer-python==0.7.2", "nvidia-cutlass-dsl>=4.6.2"]
    assert list(fs.remove) == ["flashinfer-cubin", "flashinfer-jit-cache", "quack-kernels"] and fs.index == ""


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_into_the_serving_python_one_set_pip_check_clean_idempotent_and_the_way_back_works(box, installer, capsys):
    py = serving(box["tmp"], installer)
    fs = flashinfer_set.read(box["project"])
    inst = f"uv pip install --python {py}" if installer == "uv" else f"{py} -m pip install --disable-pip-version-check"
    inst = inst.replace("uv ", f"{flashinfer_set.find_uv()} ", 1)
    lines = flashinfer_set.install_into(py, fs, installer)
    back = lines[0].split("; the way back: ")[1]
    # the way back (issue 52): exactly the recorded versions, --no-deps, with the user's pip configuration, quoted
    words = shlex.split(back)
    assert words[:len(inst.split())] == inst.split() and words[-5:] == [
        "--no-deps", "flashinfer-python==0.6.3", "nvidia-cutlass-dsl==4.3.4", "flashinfer-cubin==0.6.3", "quack-kernels==0.2.4"]
    assert ("--find-links" in words and "--no-index" in words) == (installer == "uv")  # pip reads its own
    assert lines == [f"flashinfer: {py} now has flashinfer-python 0.7.2, nvidia-cutlass-dsl 4.6.2; removed flashinfer-cubin, "
                     f"quack-kernels; the way back: {back}", "pip check: no conflict with the flashinfer set (clean)"]
    assert has(py) == {"flashinfer-python": "0.7.2", "nvidia-cutlass-dsl": "4.6.2", "cuda-tile": "1.4.0"}
    err = capsys.readouterr().err
    assert (f"sglpatch: flashinfer: {py} has flashinfer-python 0.6.3, nvidia-cutlass-dsl 4.3.4, flashinfer-cubin 0.6.3, "
            "quack-kernels 0.2.4; deps/flashinfer.toml wants flashinfer-python==0.7.2 nvidia-cutlass-dsl>=4.6.2 without "
            "flashinfer-cubin, flashinfer-jit-cache, quack-kernels") in err
    installing = next(ln for ln in err.splitlines() if ln.startswith("sglpatch: flashinfer: installing: "))
    assert installing.startswith(f"sglpatch: flashinfer: installing: {inst} ")  # exactly pip's plan, with pip's configuration
    assert installing.endswith(" --no-deps flashinfer-python==0.7.2 nvidia-cutlass-dsl==4.6.2 cuda-tile==1.4.0"), installing
    assert ("--find-links" in installing and "--no-index" in installing) == (installer == "uv")  # uv is handed PIP_*
    assert "sglpatch: flashinfer: removing quack-kernels 0.2.4 (0.2.4 (0.5.9's pin) needs nvidia-cutlass-dsl<4.4" in err
    check = ["uv", "pip", "check", "--python", py] if installer == "uv" else [py, "-m", "pip", "check"]
    assert subprocess.run(check, capture_output=True).returncode == 0  # the installer's own check, clean
    # again: nothing to install, nothing to remove
    assert flashinfer_set.install_into(py, fs, installer) == [
        f"flashinfer: {py} already has flashinfer-python 0.7.2 and the set; nothing to change",
        "pip check: no conflict with the flashinfer set (clean)"]
    assert "installing:" not in capsys.readouterr().err
    # the way back it printed puts the old set back
    subprocess.run(shlex.split(back), check=True, capture_output=True)
    assert has(py)["flashinfer-python"] == "0.6.3" and has(py)["quack-kernels"] == "0.2.4"


def test_a_set_that_leaves_the_clash_fails_in_one_line_naming_it(box):
    """Without quack-kernels in [remove], pip check names its cutlass clash: the step fails."""
    toml = box["project"] / "deps" / "flashinfer.toml"
    toml.write_text(toml.read_text().replace("quack-kernels = ", "# quack-kernels = "))
    py = serving(box["tmp"], "uv")
    with pytest.raises(SglpatchError) as e:
        flashinfer_set.install_into(py, flashinfer_set.read(box["project"]), "uv")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"pip check in {py} after --with-flashinfer: 1 conflict(s) with the flashinfer set: ")
    assert "quack-kernels" in msg and "nvidia-cutlass-dsl" in msg and "the way back: " in msg
    assert "flashinfer-python==0.6.3" in msg.split("the way back: ")[1]


def test_dry_run_through_the_cli_shows_the_resolvers_plan_and_changes_nothing(box, project_copy):
    py = serving(box["tmp"], "uv")
    (project_copy / "deps").mkdir(exist_ok=True)
    (project_copy / "deps" / "flashinfer.toml").write_text((ROOT / "deps" / "flashinfer.toml").read_text())
    before = has(py)
    wd = box["tmp"] / "fork"
    proc = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--workdir", str(wd),
                           "--python", py, "--with-flashinfer", "--dry-run"], capture_output=True, text=True,
                          env=box["cli_env"], timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == "dry run: the tree is not built and nothing is installed"
    assert out[1].startswith(f"flashinfer: plan for {py} (pip's resolution with your pip configuration): 1 to add, 2 to change, "
                             "2 to remove, 0.0 MiB to download")
    plan = [ln.split()[:5] for ln in out[2:7]]
    assert plan == [["~", "flashinfer-python", "0.6.3", "->", "0.7.2"], ["~", "nvidia-cutlass-dsl", "4.3.4", "->", "4.6.2"],
                    ["+", "cuda-tile==1.4.0", "0.0", "MiB"], ["-", "flashinfer-cubin", "0.6.3", "(its", "version"],
                    ["-", "quack-kernels", "0.2.4", "(0.2.4", "(0.5.9's"]], out
    assert out[7] == (f"flashinfer (dry run): would install flashinfer-python==0.7.2 nvidia-cutlass-dsl>=4.6.2, then remove "
                      f"flashinfer-cubin 0.6.3, quack-kernels 0.2.4 in {py} (the plan above); the way back: flashinfer-python==0.6.3 "
                      "nvidia-cutlass-dsl==4.3.4 flashinfer-cubin==0.6.3 quack-kernels==0.2.4")
    assert has(py) == before and not wd.exists()
    # --no-install contradicts it; a project without the file says what it needs
    proc = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--no-install",
                           "--with-flashinfer"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=box["cli_env"])
    assert proc.returncode == 2 and "--no-install contradicts it" in proc.stderr
    (project_copy / "deps" / "flashinfer.toml").unlink()
    proc = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--python", py,
                           "--with-flashinfer", "--dry-run"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=box["cli_env"])
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"sglpatch: error: --with-flashinfer needs {project_copy}/deps/flashinfer.toml (which flashinfer, what it overrides "
        "and removes); the project has none"]


@pytest.mark.parametrize("text,error", [
    ('[flashinfer]\nversion = "0.7.2; rm"\n', "Invalid version"),
    ('[flashinfer]\nversion = "0.7.2"\nindex = "http://example.com/simple"\n', "not an https URL"),
    ('[flashinfer]\nversion = "0.7.2"\n[flashinfer.override]\n"--pre" = ">=1"\n', "is not a package name"),
    ('[flashinfer]\nversion = "0.7.2"\n[flashinfer.override]\nx = "latest"\n', "Invalid specifier"),
    ('[flashinfer]\nindex = ""\n', "no 'version' in [flashinfer]"),
])
def test_untrusted_file_is_checked_field_by_field(tmp_path, text, error):
    (tmp_path / "deps").mkdir()
    (tmp_path / "deps" / "flashinfer.toml").write_text(text)
    with pytest.raises(SglpatchError) as e:
        flashinfer_set.read(tmp_path)
    assert error in str(e.value) and str(e.value).startswith(f"{tmp_path}/deps/flashinfer.toml")


def test_rewrite_puts_the_set_into_a_releases_pins():
    reqs = ["torch==2.9.1", "flashinfer_python==0.6.3", "flashinfer_cubin==0.6.3", "quack-kernels==0.2.4",
            "nvidia-cutlass-dsl>=4.3.4", 'numpy; python_version >= "3.10"']
    out, notes = flashinfer_set.rewrite(reqs, flashinfer_set.read(ROOT))
    assert out == ["torch==2.9.1", "flashinfer-python==0.7.2", "nvidia-cutlass-dsl>=4.6.2", 'numpy; python_version >= "3.10"']
    assert notes == ["flashinfer-python ==0.6.3 -> ==0.7.2 (deps/flashinfer.toml)",
                     "flashinfer-cubin==0.6.3 dropped (its version must match flashinfer-python's (0.5.9 pins 0.6.3); the "
                     "cubins are fetched on demand instead)",
                     "quack-kernels==0.2.4 dropped (0.2.4 (0.5.9's pin) needs nvidia-cutlass-dsl<4.4, flashinfer 0.7.2 needs "
                     ">=4.6.2; in 0.5.9 only jit_kernel/flash_attention/cute/flash_fwd.py imports it)",
                     "nvidia-cutlass-dsl >=4.3.4 -> >=4.6.2 (flashinfer 0.7.2 needs it)"]
    out, notes = flashinfer_set.rewrite(["torch==2.9.1"], flashinfer_set.read(ROOT))  # a release without them: added
    assert out == ["torch==2.9.1", "flashinfer-python==0.7.2", "nvidia-cutlass-dsl>=4.6.2"]
    assert notes[-1] == "nvidia-cutlass-dsl>=4.6.2 added (deps/flashinfer.toml)"


def test_the_trees_own_pins_must_admit_the_set(tmp_path, patched_tree):
    """Before anything is installed: a pin of the patched tree that the set breaks (pip check would
    name it) refuses in one line. The real tree says what the series carries today."""
    fs = flashinfer_set.read(ROOT)
    tree = tmp_path / "wd"
    (tree / "python").mkdir(parents=True)
    pyproject = tree / "python" / "pyproject.toml"
    pyproject.write_text('[project]\nname = "sglang"\ndependencies = ["torch==2.9.1", "flashinfer_python==0.6.3", '
                         '"flashinfer_cubin==0.6.3", "quack-kernels==0.2.4", "nvidia-cutlass-dsl>=4.3.4"]\n')
    assert flashinfer_set.tree_conflicts(tree, fs) == ["flashinfer_python==0.6.3 (the set installs 0.7.2)",
                                              "flashinfer_cubin==0.6.3 (the set removes it)",
                                              "quack-kernels==0.2.4 (the set removes it)"]
    pyproject.write_text('[project]\nname = "sglang"\ndependencies = ["flashinfer_python==0.7.2", "nvidia-cutlass-dsl>=4.3.4"]\n')
    assert flashinfer_set.tree_conflicts(tree, fs) == []
    pyproject.unlink()  # a wheel-sourced tree: nothing to compare
    assert flashinfer_set.tree_conflicts(tree, fs) == []
    real = flashinfer_set.tree_conflicts(patched_tree, fs)
    pins = (patched_tree / "python" / "pyproject.toml").read_text()
    if '"flashinfer_python==0.6.3"' in pins:  # the series without P5's pin change
        assert real[0] == "flashinfer_python==0.6.3 (the set installs 0.7.2)"
    else:
        assert not [c for c in real if c.startswith("flashinfer_python")]


def test_apply_refuses_before_installing_when_the_tree_pins_the_old_set(box, project_copy, tmp_path):
    """The CLI: the tree is built, its pins are read, nothing goes into the Python."""
    (project_copy / "deps").mkdir(exist_ok=True)
    (project_copy / "deps" / "flashinfer.toml").write_text((ROOT / "deps" / "flashinfer.toml").read_text())
    py = serving(box["tmp"], "uv")
    wd = tmp_path / "fork"
    proc = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--workdir", str(wd),
                           "--source", "sdist", "--python", py, "--with-flashinfer"], capture_output=True, text=True,
                          env=box["cli_env"], timeout=600, cwd=ROOT)
    bad = flashinfer_set.tree_conflicts(wd, flashinfer_set.read(project_copy))
    if not bad:
        pytest.skip("the series pins deps/flashinfer.toml's set (P5's pin change): covered by the install tests")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"sglpatch: error: the patched tree's python/pyproject.toml pins {', '.join(bad)}: pip check would fail after "
        "--with-flashinfer; the series must carry P5's pin change (deps/flashinfer.toml); nothing was installed")
    assert has(py)["flashinfer-python"] == "0.6.3" and "sglang" not in flashinfer_set.installed(py)


# ----------------------------------------------------------------------------- issue 38: the user's pip configuration, torch


@pytest.fixture
def users_pip(tmp_path, monkeypatch):
    """The user's pip configuration: their mirror (a find-links folder, no other index) and a
    constraints file (torch==2.9.1, nvidia-cutlass-dsl<4.7). uv's own default index, which it reads
    instead when nobody hands it pip's settings, stands for PyPI: there the newest torch (the CUDA 13
    one) and the newest nvidia-cutlass-dsl."""
    mirror, pypi, empty = tmp_path / "mirror", tmp_path / "pypi", tmp_path / "empty"
    for d in (mirror, pypi, empty):
        d.mkdir()
    for index in (mirror, pypi):
        wheel(index, "flashinfer-python", "0.7.2", ("nvidia-cutlass-dsl>=4.6.2a0", "torch"))
        wheel(index, "flashinfer-python", "0.7.3", ("nvidia-cutlass-dsl>=4.6.2a0", "torch>=2.10"))
        for v in ("4.6.2", "4.7.0"):
            wheel(index, "nvidia-cutlass-dsl", v)
        wheel(index, "torch", "2.14.1", pad=1 << 20)
    wheel(mirror, "torch", "2.9.1", pad=1 << 20)  # 1 MiB that does not compress: the plan shows its size
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch==2.9.1\nnvidia-cutlass-dsl<4.7\n")
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(mirror), "PIP_CONSTRAINT": str(constraints),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "UV_DEFAULT_INDEX": f"file://{empty}", "UV_FIND_LINKS": str(pypi),
           "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "UV_CONSTRAINT", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "PYTHONPATH"):
        monkeypatch.delenv(k, raising=False)
    project = tmp_path / "project"
    (project / "deps").mkdir(parents=True)
    (project / "deps" / "flashinfer.toml").write_text((ROOT / "deps" / "flashinfer.toml").read_text())
    return SimpleNamespace(tmp=tmp_path, mirror=mirror, project=project)


def bare_venv(tmp: Path, *have: str) -> str:
    """A venv without pip (as uv makes them), holding have (from the user's mirror)."""
    d = tmp / "serving"
    venv.EnvBuilder(with_pip=False).create(d)
    py = str(d / "bin" / "python")
    if have:
        subprocess.run(["uv", "pip", "install", "-q", "--python", py, "--no-index", "--find-links", str(tmp / "mirror"), *have],
                       check=True, capture_output=True)
    return py


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_the_set_is_installed_within_the_users_pip_configuration_and_its_plan_comes_first(users_pip, installer, capsys):
    """torch 2.9.1 is there; the user's constraint keeps nvidia-cutlass-dsl below 4.7. uv used to
    take 4.7.0 from its own default index, ignoring pip's configuration."""
    py = bare_venv(users_pip.tmp, "torch==2.9.1")
    fs = flashinfer_set.read(users_pip.project)
    lines = flashinfer_set.install_into(py, fs, installer)
    got = has(py)
    assert got["flashinfer-python"] == "0.7.2" and got["nvidia-cutlass-dsl"] == "4.6.2", got
    assert flashinfer_set.installed(py)["torch"] == "2.9.1"
    out = capsys.readouterr()
    plan = [ln for ln in out.out.splitlines() if ln.startswith(("flashinfer: plan", "  + ", "  ~ ", "  - "))]
    assert plan[0].startswith(f"flashinfer: plan for {py} (pip's resolution with your pip configuration): 2 to add, 0 to change, "
                              "0 to remove, ") and plan[0].endswith(" MiB to download"), out.out
    assert any(ln.startswith("  + flashinfer-python==0.7.2 ") and ln.endswith(" MiB") for ln in plan), plan
    assert any(ln.startswith("  + nvidia-cutlass-dsl==4.6.2 ") for ln in plan), plan
    assert out.err.index("installing:") > 0 and lines[-1].startswith("pip check: no conflict")


def test_the_set_never_installs_torch_into_a_venv_without_one(users_pip, project_copy, capsys):
    """The issue's case: a venv without torch. One line refuses before any resolution (no plan: the
    user's took 36 s and showed 3.1 GB): --with-flashinfer never installs torch, and the line names
    what the set asks of torch, read from flashinfer-python's own metadata (any torch: here the
    resolver would pick the constraint's 2.9.1, on PyPI the newest). uv used to install the newest
    torch from its own index (6.3 GB of CUDA 13)."""
    py = bare_venv(users_pip.tmp)
    with pytest.raises(SglpatchError) as e:
        flashinfer_set.install_into(py, flashinfer_set.read(users_pip.project), "uv")
    msg = str(e.value)
    assert msg == (f"flashinfer: {py} has no torch, and flashinfer-python 0.7.2 requires torch (any version): --with-flashinfer "
                   f"never installs or upgrades torch; install the torch you serve with into {py} first, then re-run; "
                   "nothing was installed")
    assert "torch" not in flashinfer_set.installed(py) and "flashinfer-python" not in flashinfer_set.installed(py)
    assert "plan for" not in capsys.readouterr().out
    # the CLI: the refusal comes before the tree is built (project_copy: the same folder, now a whole project)
    assert project_copy == users_pip.project
    wd = users_pip.tmp / "fork"
    proc = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--workdir", str(wd),
                           "--source", "sdist", "--python", py, "--with-flashinfer"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == f"sglpatch: error: {msg}", proc.stdout + proc.stderr
    assert "plan for" not in proc.stdout and not wd.exists()


def test_a_set_that_needs_another_torch_is_refused_in_one_line(users_pip):
    toml = users_pip.project / "deps" / "flashinfer.toml"
    toml.write_text(toml.read_text().replace('version = "0.7.2"', 'version = "0.7.3"'))
    (users_pip.tmp / "constraints.txt").write_text("nvidia-cutlass-dsl<4.7\n")  # torch free: the set wants >=2.10
    py = bare_venv(users_pip.tmp, "torch==2.9.1")
    with pytest.raises(SglpatchError) as e:
        flashinfer_set.install_into(py, flashinfer_set.read(users_pip.project), "uv")
    assert str(e.value).startswith(f"flashinfer: the set needs torch 2.14.1 and {py} has torch 2.9.1: ")
    assert flashinfer_set.installed(py)["torch"] == "2.9.1" and "flashinfer-python" not in flashinfer_set.installed(py)
