"""Which rebase may write a line's folder in the project, and what its --abort may undo there.

Two workdirs of one checkout may rebase onto the same release; both finish into lines/R/. So:

* one finishing step, or one --abort's restore, at a time in a project: an exclusive lock,
  `rebase.lock` in the project's folder of the tool's cache (sglpatch's cache dir, projects/ and a
  digest of the project's real path: nothing written into the checkout); a second one is refused
  in one line and can be re-run;
* each finishing step claims the folder it writes (`claims.json` there: {folder: id}), with an id
  kept in its own state folder (finishing-id) before it writes anything, and gives the claim up
  once it finished;
* an --abort of a rebase that began finishing undoes its journal only while its claim stands: when
  another rebase has claimed or finished the folder since, it refuses in one line, nothing changed.

The claims file is untrusted when read: anything but a
{str: str} object counts as no claim, so an --abort refuses rather than undo another's work.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

from sglpatch.fsutil import exclusive, write_if_changed
from sglpatch.gitcmd import Git
from sglpatch.rebase_plan_file import RebaseError
from sglpatch.workdir import rebase_state_dir

LOCK, CLAIMS, ID_FILE = "rebase.lock", "claims.json", "finishing-id"


def _dir(project: Path) -> Path:
    from sglpatch.upstream.cachedir import cache_dir

    return cache_dir() / "projects" / hashlib.sha256(os.path.realpath(project).encode()).hexdigest()[:16]


@contextmanager
def holding(project: Path):
    with exclusive(_dir(project) / LOCK, f"{project} (a rebase's finishing step or --abort)"):
        yield


def _read(project: Path) -> dict[str, str]:
    try:
        doc = json.loads((_dir(project) / CLAIMS).read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(doc, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items())
    return doc if ok else {}


def _write(project: Path, claims: dict[str, str]) -> None:
    f = _dir(project) / CLAIMS
    if claims:
        write_if_changed(f, (json.dumps(claims, indent=1, sort_keys=True) + "\n").encode())
    else:
        f.unlink(missing_ok=True)


def _folder(dest: str) -> str:
    return dest or "."


def claim(project: Path, git: Git, dest: str) -> str:
    """At the finishing step's start (under holding): this rebase's id, kept first in its state folder."""
    own = uuid.uuid4().hex
    write_if_changed(rebase_state_dir(git) / ID_FILE, own.encode())
    _write(project, {**_read(project), _folder(dest): own})
    return own


def release(project: Path, own: str) -> None:
    """Give up own's claims (a finish that completed, an abort that restored)."""
    claims = _read(project)
    _write(project, {k: v for k, v in claims.items() if v != own})


def own_id(git: Git) -> str | None:
    try:
        return (rebase_state_dir(git) / ID_FILE).read_text().strip() or None
    except OSError:
        return None


def check_abort(project: Path, git: Git) -> str | None:
    """Before an --abort moves anything (under holding): its id when it began finishing and still holds
    its claim, None when it never began finishing; refused when its folder was claimed since."""
    own = own_id(git)
    if own is None:
        return None
    if own not in _read(project).values():
        raise RebaseError(
            f"the rebase in {git.workdir} began writing its line in {project}, and another rebase has claimed or finished "
            f"that folder since: undoing this one's writes would delete the other's work; nothing was changed. To abort "
            f"only the workdir, keeping the project as it is: delete {rebase_state_dir(git) / ID_FILE} and "
            f"{rebase_state_dir(git) / 'written.json'}, then re-run --abort"
        )
    return own
