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

import pytest

from conftest import ROOT
from sglpatch import fiset
from sglpatch.errors import SglpatchError

OLD = ["flashinfer-python==0.6.3", "flashinfer-cubin==0.6.3", "quack-kernels==0.2.4", "nvidia-cutlass-dsl==4.3.4"]


def wheel(index: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(index / f"{dist}-py3-none-any.whl", "w") as zf:
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
    return {k: v for k, v in fiset.installed(py).items() if k in ("flashinfer-python", "flashinfer-cubin", "quack-kernels",
                                                                  "nvidia-cutlass-dsl", "cuda-tile")}


def test_the_projects_file_is_read_as_documented():
    fs = fiset.read(ROOT)
    assert fs.requirements == ["flashinfer-python==0.7.2", "nvidia-cutlass-dsl>=4.6.2"]
    assert list(fs.remove) == ["flashinfer-cubin", "flashinfer-jit-cache", "quack-kernels"] and fs.index == ""


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_into_the_serving_python_one_set_pip_check_clean_idempotent_and_the_way_back_works(box, installer, capsys):
    py = serving(box["tmp"], installer)
    fs = fiset.read(box["project"])
    inst = f"uv pip install --python {py}" if installer == "uv" else f"{py} -m pip install --disable-pip-version-check"
    inst = inst.replace("uv ", f"{fiset.find_uv()} ", 1)
    lines = fiset.install_into(py, fs, installer)
    back = f"{inst} flashinfer-python==0.6.3 nvidia-cutlass-dsl==4.3.4 flashinfer-cubin==0.6.3 quack-kernels==0.2.4"
    assert lines == [f"flashinfer: {py} now has flashinfer-python 0.7.2, nvidia-cutlass-dsl 4.6.2; removed flashinfer-cubin, "
                     f"quack-kernels; the way back: {back}", "pip check: no conflict with the flashinfer set (clean)"]
    assert has(py) == {"flashinfer-python": "0.7.2", "nvidia-cutlass-dsl": "4.6.2", "cuda-tile": "1.4.0"}
    err = capsys.readouterr().err
    assert (f"sglpatch: flashinfer: {py} has flashinfer-python 0.6.3, nvidia-cutlass-dsl 4.3.4, flashinfer-cubin 0.6.3, "
            "quack-kernels 0.2.4; deps/flashinfer.toml wants flashinfer-python==0.7.2 nvidia-cutlass-dsl>=4.6.2 without "
            "flashinfer-cubin, flashinfer-jit-cache, quack-kernels") in err
    assert f"sglpatch: flashinfer: installing: {inst} flashinfer-python==0.7.2 nvidia-cutlass-dsl>=4.6.2\n" in err
    assert "sglpatch: flashinfer: removing quack-kernels 0.2.4 (0.2.4 (0.5.9's pin) needs nvidia-cutlass-dsl<4.4" in err
    check = ["uv", "pip", "check", "--python", py] if installer == "uv" else [py, "-m", "pip", "check"]
    assert subprocess.run(check, capture_output=True).returncode == 0  # the installer's own check, clean
    # again: nothing to install, nothing to remove
    assert fiset.install_into(py, fs, installer) == [
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
        fiset.install_into(py, fiset.read(box["project"]), "uv")
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
    assert out[1] == (f"flashinfer (dry run): would install flashinfer-python==0.7.2 nvidia-cutlass-dsl>=4.6.2, then remove "
                      f"flashinfer-cubin 0.6.3, quack-kernels 0.2.4 in {py}; the way back: flashinfer-python==0.6.3 "
                      "nvidia-cutlass-dsl==4.3.4 flashinfer-cubin==0.6.3 quack-kernels==0.2.4")
    assert "  + flashinfer-python==0.7.2" in out and "  + nvidia-cutlass-dsl==4.6.2" in out and "  + cuda-tile==1.4.0" in out
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
        fiset.read(tmp_path)
    assert error in str(e.value) and str(e.value).startswith(f"{tmp_path}/deps/flashinfer.toml")


def test_rewrite_puts_the_set_into_a_releases_pins():
    reqs = ["torch==2.9.1", "flashinfer_python==0.6.3", "flashinfer_cubin==0.6.3", "quack-kernels==0.2.4",
            "nvidia-cutlass-dsl>=4.3.4", 'numpy; python_version >= "3.10"']
    out, notes = fiset.rewrite(reqs, fiset.read(ROOT))
    assert out == ["torch==2.9.1", "flashinfer-python==0.7.2", "nvidia-cutlass-dsl>=4.6.2", 'numpy; python_version >= "3.10"']
    assert notes == ["flashinfer-python ==0.6.3 -> ==0.7.2 (deps/flashinfer.toml)",
                     "flashinfer-cubin==0.6.3 dropped (its version must match flashinfer-python's (0.5.9 pins 0.6.3); the "
                     "cubins are fetched on demand instead)",
                     "quack-kernels==0.2.4 dropped (0.2.4 (0.5.9's pin) needs nvidia-cutlass-dsl<4.4, flashinfer 0.7.2 needs "
                     ">=4.6.2; in 0.5.9 only jit_kernel/flash_attention/cute/flash_fwd.py imports it)",
                     "nvidia-cutlass-dsl >=4.3.4 -> >=4.6.2 (flashinfer 0.7.2 needs it)"]
    out, notes = fiset.rewrite(["torch==2.9.1"], fiset.read(ROOT))  # a release without them: added
    assert out == ["torch==2.9.1", "flashinfer-python==0.7.2", "nvidia-cutlass-dsl>=4.6.2"]
    assert notes[-1] == "nvidia-cutlass-dsl>=4.6.2 added (deps/flashinfer.toml)"


def test_the_trees_own_pins_must_admit_the_set(tmp_path, patched_tree):
    """Before anything is installed: a pin of the patched tree that the set breaks (pip check would
    name it) refuses in one line. The real tree says what the series carries today."""
    fs = fiset.read(ROOT)
    tree = tmp_path / "wd"
    (tree / "python").mkdir(parents=True)
    pyproject = tree / "python" / "pyproject.toml"
    pyproject.write_text('[project]\nname = "sglang"\ndependencies = ["torch==2.9.1", "flashinfer_python==0.6.3", '
                         '"flashinfer_cubin==0.6.3", "quack-kernels==0.2.4", "nvidia-cutlass-dsl>=4.3.4"]\n')
    assert fiset.tree_conflicts(tree, fs) == ["flashinfer_python==0.6.3 (the set installs 0.7.2)",
                                              "flashinfer_cubin==0.6.3 (the set removes it)",
                                              "quack-kernels==0.2.4 (the set removes it)"]
    pyproject.write_text('[project]\nname = "sglang"\ndependencies = ["flashinfer_python==0.7.2", "nvidia-cutlass-dsl>=4.3.4"]\n')
    assert fiset.tree_conflicts(tree, fs) == []
    pyproject.unlink()  # a wheel-sourced tree: nothing to compare
    assert fiset.tree_conflicts(tree, fs) == []
    real = fiset.tree_conflicts(patched_tree, fs)
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
    bad = fiset.tree_conflicts(wd, fiset.read(project_copy))
    if not bad:
        pytest.skip("the series pins deps/flashinfer.toml's set (P5's pin change): covered by the install tests")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"sglpatch: error: the patched tree's python/pyproject.toml pins {', '.join(bad)}: pip check would fail after "
        "--with-flashinfer; the series must carry P5's pin change (deps/flashinfer.toml); nothing was installed")
    assert has(py)["flashinfer-python"] == "0.6.3" and "sglang" not in fiset.installed(py)
