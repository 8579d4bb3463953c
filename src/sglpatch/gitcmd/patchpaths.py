"""Which files a patch writes and reads, as git apply itself reads its headers.

git is asked in / with no repository around it (a Runner, not a checkout's Git), with
``--numstat`` so nothing is applied; the answer is kept per patch text for the process.
"""

from __future__ import annotations

import functools

from sglpatch.gitcmd.runner import GitError, Runner


def patch_paths(patch: bytes, strip: int = 1) -> tuple[list[str], list[str]]:
    """How git apply itself reads a patch's file headers (quoting, renames, copies, -pN).

    Returns, per file of the patch and in its order, (written, read): the path git apply
    writes (the new side; the old one for a deletion) and the path it reads (the old side;
    the new one for a creation). Runs in / with no repository around it, so that no
    checkout's subdirectory prefixes the paths; nothing is applied (``--numstat``).
    """
    written, read = _patch_paths(patch, strip)
    return list(written), list(read)


@functools.lru_cache(maxsize=256)
def _patch_paths(patch: bytes, strip: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """patch_paths, once per patch text in a process (errors are not kept: they raise again)."""
    git = Runner("/")
    env = {"GIT_CEILING_DIRECTORIES": "/"}
    out = []
    for extra in ((), ("-R",)):
        rc, text, err = git.run("apply", "--numstat", "-z", f"-p{strip}", *extra, "-", input=patch, env=env, check=False)
        if rc != 0:
            errors = [line for line in err.strip().splitlines() if line.strip()]  # the first says what
            raise GitError(errors[0].removeprefix("error: ") if errors else f"git apply --numstat: exit {rc}")
        out.append([entry.split("\t", 2)[2] for entry in text.split("\0") if entry])
    written, read = out
    return tuple(written), tuple(read[::-1])  # with -R git applies (and lists) the files last to first
