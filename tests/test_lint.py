"""The tool's own lint: `ruff check` (pyproject's [tool.ruff]) over src/ and tests/ is clean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed: scripts/test.sh installs it from requirements-test.txt"
    r = subprocess.run([ruff, "check", "--no-cache", "src", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
