"""Every file the series touches passes upstream SGLang's own formatters on the patched tree.

SGLang pins black 24.10.0 and isort 5.13.2 (profile black) in its pre-commit config;
requirements-test.txt installs exactly those. The series is read from $SGLPATCH_PROJECT when
set (the rebase test re-runs this on a rebased series), else from this repository.
"""

from __future__ import annotations

import os
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


@pytest.mark.parametrize("tool, args", [("black", ["--check", "--diff"]), ("isort", ["--profile", "black", "--check-only", "--diff"])])
def test_touched_files_pass_upstream_formatters(patched_tree, tool, args):
    mod = pytest.importorskip(tool)
    files = [f for f in _touched_python_files() if (patched_tree / f).is_file()]
    assert files, "the series touches no Python file?"
    proc = subprocess.run([sys.executable, "-m", tool, *args, *files], cwd=patched_tree, capture_output=True, text=True)
    assert proc.returncode == 0, f"{tool} {getattr(mod, '__version__', '')} would change:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
