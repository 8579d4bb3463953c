"""Every file the series touches passes upstream SGLang's own formatters on the patched tree.

SGLang pins black 24.10.0 and isort 5.13.2 (profile black) in its pre-commit config;
requirements-test.txt installs exactly those. The series is read from $SGLPATCH_PROJECT when
set (the rebase test re-runs this on a rebased series), else from this repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglpatch.series import read_patch, read_series

PROJECT = Path(os.environ.get("SGLPATCH_PROJECT") or Path(__file__).resolve().parents[2])


def _touched_python_files() -> list[str]:
    files: set[str] = set()
    for entry in read_series(PROJECT).entries:
        files.update(f for f in read_patch(PROJECT, entry).files if f.endswith(".py"))
    return sorted(files)


def _fails(tool: str, args: list[str], root: Path, f: str) -> bool:
    """Whether the tool would change f, run from python/ like upstream's pre-commit (so isort knows sglang is first-party)."""
    return subprocess.run([sys.executable, "-m", tool, *args, f], cwd=root / "python", capture_output=True, text=True).returncode != 0


def _failing(tool: str, args: list[str], root: Path, files: list[str]) -> set[str]:
    """Files the tool would change: one run over all of them (exit 0: none); else the files it
    names (black: "would reformat" / "cannot format", isort: "ERROR:"), each confirmed by a run of
    its own, and every file on its own when it named none."""
    if not files:
        return set()
    quiet = [a for a in args if a != "-q"]
    proc = subprocess.run([sys.executable, "-m", tool, *quiet, *files], cwd=root / "python", capture_output=True, text=True)
    if proc.returncode == 0:
        return set()
    named = {f for f in files for line in (proc.stdout + proc.stderr).splitlines()
             if re.search(r"would reformat|cannot format|^ERROR:", line) and re.search(rf"(^|[\s/]){re.escape(f)}(\s|:|$)", line)}
    bad = {f for f in named if _fails(tool, args, root, f)}
    return bad or {f for f in files if _fails(tool, args, root, f)}


@pytest.fixture(scope="module")
def upstream_tree(patched_tree, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("upstream") / "tree"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(dest), "upstream"], cwd=patched_tree, check=True)
    yield dest
    subprocess.run(["git", "worktree", "remove", "--force", str(dest)], cwd=patched_tree, check=False)


@pytest.mark.parametrize("tool, args", [("black", ["--check", "-q"]), ("isort", ["--profile", "black", "--check-only", "-q"])])
def test_patches_keep_touched_files_formatter_clean(patched_tree, upstream_tree, tool, args):
    """A touched file that upstream's formatters accept must still pass after the series.

    (Upstream does not keep every file clean under these versions, e.g. 0.5.10.post1's
    eagle_worker_v2.py under isort 5.13.2; such files are reported, not blamed on us.)
    """
    pytest.importorskip(tool)
    files = [f.removeprefix("python/") for f in _touched_python_files() if (patched_tree / f).is_file()]
    assert files, "the series touches no Python file?"
    new_files = [f for f in files if not (upstream_tree / "python" / f).is_file()]
    upstream_bad = _failing(tool, args, upstream_tree, [f for f in files if f not in new_files])
    if upstream_bad:
        print(f"{tool}: upstream itself is not clean in {sorted(upstream_bad)}")
    patched_bad = _failing(tool, args, patched_tree, [f for f in files if f not in upstream_bad])
    assert not patched_bad, f"{tool} would reformat {sorted(patched_bad)} after the series (run `{tool}` on them in DIR/python)"
