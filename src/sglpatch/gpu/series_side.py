"""The GPU suite's one window on the series side: what an installed workdir carries.

Imported lazily by the server tier; the series side needs GitPython, which a GPU box may lack.
"""

from __future__ import annotations

from pathlib import Path


def patches_of(project: Path, workdir: Path) -> dict:
    """{'carried': [...], 'status': [...]} for the sglpatch workdir an installed sglang comes from."""
    from sglpatch import stack

    return {"carried": stack.carried(project, workdir), "status": stack.status(project, workdir)}


def installed_python(workdir: Path) -> str | None:
    """The interpreter `sglpatch apply` last installed workdir's tree into (recorded there), or None
    (nothing recorded, not a workdir, or no GitPython on this box)."""
    try:
        from sglpatch import install
    except ImportError:
        return None
    from sglpatch.errors import SglpatchError

    try:
        return install.recorded(Path(workdir))
    except SglpatchError:
        return None
