"""The project: upstream.lock + series + patches/, read together (and found from a folder)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from sglpatch import exitcodes
from sglpatch.errors import SglpatchError
from sglpatch.upstream.pin import LOCK_NAME, Lock, read_lock
from sglpatch.series import SERIES_NAME, PatchFile, Series, read_patches, read_series


@dataclass
class Project:
    root: Path
    lock: Lock
    series: Series
    patches: list[PatchFile]

    @classmethod
    def load(cls, root: Path) -> "Project":
        root = Path(root)
        lock = read_lock(root)
        series = read_series(root)
        patches = read_patches(root, series.entries)
        return cls(root=root, lock=lock, series=series, patches=patches)

    def digest(self, upstream_commit: str) -> str:
        h = hashlib.sha256(upstream_commit.encode())
        for entry, patch in zip(self.series.entries, self.patches):
            h.update(f"\0{entry.name}\0{entry.strip}\0".encode())
            h.update(hashlib.sha256(patch.data).digest())
        return h.hexdigest()


def find_project(start: Path | None = None) -> Path:
    here = Path(start or Path.cwd()).resolve()
    home = os.environ.get("SGLPATCH_PROJECT")  # scripts/sglpatch: its checkout, where no folder above is a project
    for d in (here, *here.parents, *([Path(home).resolve()] if home and not start else [])):
        if (d / SERIES_NAME).is_file() and (d / "upstream.lock").is_file():
            return d
    raise SglpatchError("no sglpatch project here (no series + upstream.lock in this folder or above); pass --project DIR", exitcodes.USAGE)


LINES_DIR = "lines"  # lines/<R>/: another supported line of the checkout (sglpatch.lines)


def checkout_of(root: Path) -> Path:
    """The checkout a project root belongs to: the root itself, or the folder above lines/<R>/."""
    root = Path(root)
    up = root.parent.parent
    if root.parent.name == LINES_DIR and (up / SERIES_NAME).is_file() and (up / LOCK_NAME).is_file():
        return up
    return root
