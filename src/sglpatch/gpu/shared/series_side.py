"""The GPU suite's one window on the series side: what an installed workdir carries.

Imported lazily by the server tier; the series side needs GitPython, which a GPU box may lack.
"""

from __future__ import annotations

from pathlib import Path


def patches_of(project: Path, workdir: Path) -> dict:
    """{'carried': [...], 'status': [...], 'line': ...} for the sglpatch workdir an installed sglang
    comes from, read against the line of the checkout it holds (sglpatch.lines; line: "0.5.23
    (lines/0.5.23/)", "0.5.9 (primary)", or None when it holds none of them)."""
    from sglpatch import lines
    from sglpatch.stack import status

    held = lines.held_by(project, workdir)
    root = held.root if held else project
    line = f"{held.release} ({'primary' if held.primary else held.where})" if held else None
    return {"carried": status.carried(root, workdir), "status": status.status(root, workdir), "line": line}


def installed_python(workdir: Path) -> str | None:
    """The interpreter `sglpatch apply` last installed workdir's tree into (recorded there), or None
    (nothing recorded, not a workdir, or no GitPython on this box)."""
    try:
        from sglpatch.pythonenv import install
    except ImportError:
        return None
    from sglpatch.errors import SglpatchError

    try:
        return install.recorded(Path(workdir))
    except SglpatchError:
        return None


def flashinfer_way_back(workdir: Path) -> str | None:
    """The command that restores the flashinfer set `sglpatch apply --with-flashinfer` replaced,
    recorded in workdir, or None (nothing recorded, not a workdir, or no GitPython on this box)."""
    try:
        from sglpatch.pythonenv import flashinfer_set
        from sglpatch.errors import SglpatchError

        return flashinfer_set.recorded_way_back(Path(workdir))
    except (ImportError, SglpatchError):
        return None
