"""The one naming rule between lines and workdirs, and its inverse (as gbp pq keeps
``pq_branch_name`` and ``pq_branch_base`` side by side): the primary line builds into the base
workdir ($SGLANG_FORK_DIR, else ~/sglang-fork), release R into the base with ``-R`` appended.
Nobody else appends ``-R`` to a path or reads $SGLANG_FORK_DIR; scripts/*.sh pass options through."""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV = "SGLANG_FORK_DIR"
DEFAULT_NAME = "sglang-fork"
RELEASE = re.compile(r"^[0-9]+(\.[0-9]+)+((a|b|rc|\.post|\.dev)[0-9]+)*$")  # a line's name: a release version


def is_release(name: str | None) -> bool:
    return bool(name) and bool(RELEASE.match(name))


def base(given: str | os.PathLike | None = None) -> Path:
    """The base workdir: given (--workdir), else $SGLANG_FORK_DIR, else ~/sglang-fork; absolute,
    without a trailing slash ("/x/fork/" is /x/fork, so its line's is /x/fork-R, never /x/fork/-R)."""
    raw = str(given) if given else (os.environ.get(ENV) or str(Path.home() / DEFAULT_NAME))
    path = Path(os.path.normpath(os.path.abspath(os.path.expanduser(raw))))
    if not path.name:  # "/": no workdir, and no name to append -R to
        from sglpatch import exitcodes
        from sglpatch.errors import SglpatchError

        where = f"--workdir {raw}" if given else f"{ENV}={raw}"
        raise SglpatchError(f"{where}: the workdir cannot be the filesystem root; name a folder of its own, "
                            f"e.g. {Path.home() / DEFAULT_NAME}", exitcodes.USAGE)
    return path


def workdir_of(base_dir: Path, release: str | None) -> Path:
    """The workdir of release's line (None: the primary) beside base_dir."""
    base_dir = Path(os.path.normpath(str(base_dir)))
    return base_dir if not release else base_dir.with_name(f"{base_dir.name}-{release}")


def release_of(base_dir: Path, workdir: Path) -> str | None:
    """The inverse: the release whose line's workdir is workdir ('' for the primary's, None when
    workdir follows no line's name beside base_dir)."""
    base_dir, workdir = Path(os.path.normpath(str(base_dir))), Path(os.path.normpath(str(workdir)))
    if workdir == base_dir:
        return ""
    prefix = f"{base_dir.name}-"
    if workdir.parent == base_dir.parent and workdir.name.startswith(prefix) and is_release(workdir.name[len(prefix):]):
        return workdir.name[len(prefix):]
    return None
