"""Where sglpatch keeps what it downloads and derives: release files, the package index's last
answers, unpacked trees and git mirrors, under one cache folder (``SGLPATCH_CACHE``, else
``$XDG_CACHE_HOME/sglpatch``, else ``~/.cache/sglpatch``)."""

from __future__ import annotations

import os
from pathlib import Path

from sglpatch.errors import SglpatchError


def cache_dir() -> Path:
    """Where downloaded release files, index answers and unpacked trees are kept."""
    base = os.environ.get("SGLPATCH_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "sglpatch" if xdg else Path.home() / ".cache" / "sglpatch"


def cache_subdir(name: str) -> Path:
    """cache_dir()/name, made when missing; a cache that cannot be made is one line naming the fix."""
    d = cache_dir() / name
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SglpatchError(
            f"cannot create the cache folder {d} ({e.strerror}); set SGLPATCH_CACHE to a folder you can write "
            "(it holds downloaded release files and their unpacked trees)"
        ) from None
    return d
