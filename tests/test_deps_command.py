"""The command the tool prints to install sglang's own dependencies (sglpatch.pythonenv.interpreter.deps_command),
printed by apply, the cpu tier, the doctor and the JIT check.

The patched 0.5.9 tree pins flashinfer-python 0.7.2 (P5 changes python/pyproject.toml), so that install
brings flashinfer 0.7.2 in, but removes nothing of 0.5.9's flashinfer set (flashinfer-cubin,
flashinfer-jit-cache, quack-kernels), runs no pip check and no JIT check, and records no way back. The
printed command goes on with the `apply --with-flashinfer` that completes the set (issue 51)."""

from __future__ import annotations

import shlex
from pathlib import Path

from sglpatch.pythonenv.interpreter import P5_ADAPTER, deps_command


def _tree(base: Path, p5: bool) -> Path:
    tree = base / "sglang-fork" / "python"
    (tree / "sglang").mkdir(parents=True)
    (tree / "pyproject.toml").write_text('[project]\ndependencies = ["flashinfer_python==0.7.2"]\n' if p5 else
                                         '[project]\ndependencies = ["flashinfer_python==0.6.3", "flashinfer_cubin==0.6.3"]\n')
    if p5:
        (tree / "sglang" / P5_ADAPTER).parent.mkdir(parents=True)
        (tree / "sglang" / P5_ADAPTER).write_text("")
    return tree


def test_a_tree_with_p5_gets_the_install_then_the_flashinfer_set(tmp_path):
    tree, py = _tree(tmp_path, p5=True), "/home/u/ml-env/bin/python3"
    then = f" && sglpatch apply --with-flashinfer --python {py} --workdir {tree.parent}"
    assert deps_command(py, str(tree), "0.5.9", None) == \
        f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG=0.5.9 {py} -m pip install -e {tree}{then}"
    assert deps_command(py, str(tree), "0.5.9", "/home/u/.local/bin/uv") == \
        f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG=0.5.9 /home/u/.local/bin/uv pip install --python {py} -e {tree}{then}"


def test_a_tree_without_p5_gets_the_install_alone(tmp_path):
    """Upstream's own pins (a bisect step below P5, a hand-edited checkout): a consistent set, nothing to complete."""
    tree, py = _tree(tmp_path, p5=False), "/home/u/ml-env/bin/python3"
    assert deps_command(py, str(tree), "0.5.9", None) == f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_SGLANG=0.5.9 {py} -m pip install -e {tree}"
    assert deps_command(py, str(tmp_path / "gone"), None, None) == f"{py} -m pip install -e {tmp_path / 'gone'}"


def test_the_command_is_one_shell_line_with_odd_paths(tmp_path):
    tree, py = _tree(tmp_path / "a b", p5=True), str(tmp_path / "my venv" / "bin" / "python3")
    words = shlex.split(deps_command(py, str(tree), "0.5.9", None))
    assert words[words.index("&&") + 1:] == ["sglpatch", "apply", "--with-flashinfer", "--python", py, "--workdir", str(tree.parent)]
    assert words[1:5] == [py, "-m", "pip", "install"] and words[6] == str(tree)
