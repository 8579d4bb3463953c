"""Which files a patch writes and reads, as git apply itself reads its headers.

git is asked in / with no repository around it (a Runner, not a checkout's Git), with
``--numstat`` so nothing is applied; the answer is kept per patch text for the process.
``read_together`` asks once for a whole series (two git processes instead of two per patch).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from sglpatch.fsutil import private_tmpdir
from sglpatch.gitcmd.runner import GitError, Runner

Paths = tuple[tuple[str, ...], tuple[str, ...]]
_KNOWN: dict[tuple[bytes, int], Paths] = {}  # (patch text, strip) -> (written, read), for the process
_KEEP = 256


def patch_paths(patch: bytes, strip: int = 1) -> tuple[list[str], list[str]]:
    """How git apply itself reads a patch's file headers (quoting, renames, copies, -pN).

    Returns, per file of the patch and in its order, (written, read): the path git apply
    writes (the new side; the old one for a deletion) and the path it reads (the old side;
    the new one for a creation). Runs in / with no repository around it, so that no
    checkout's subdirectory prefixes the paths; nothing is applied (``--numstat``).
    Errors are not kept: they raise again.
    """
    got = _KNOWN.get((patch, strip))
    if got is None:
        got = _keep(patch, strip, _ask([patch], strip)[0])
    written, read = got
    return list(written), list(read)


def read_together(patches: list[tuple[bytes, int]]) -> None:
    """Read the paths of several patches at once (per -pN: one git apply per direction, each
    patch a file argument of its own, which git reads on its own), for patch_paths to answer
    from. When git refuses any of them nothing is kept: patch_paths then asks per patch, and
    the error names that one."""
    todo: dict[int, list[bytes]] = {}
    for data, strip in patches:
        if (data, strip) not in _KNOWN and data not in todo.get(strip, []):
            todo.setdefault(strip, []).append(data)
    for strip, group in todo.items():
        if len(group) < 2:
            continue
        try:
            answers = _ask(group, strip)
        except GitError:
            continue
        for data, paths in zip(group, answers):
            _keep(data, strip, paths)


def _keep(patch: bytes, strip: int, paths: Paths) -> Paths:
    if len(_KNOWN) >= _KEEP:
        _KNOWN.pop(next(iter(_KNOWN)))
    _KNOWN[patch, strip] = paths
    return paths


def _ask(patches: list[bytes], strip: int) -> list[Paths]:
    """(written, read) per patch: git apply --numstat over them, forwards and with -R. Several
    patches are files of a private temporary folder with a separator patch between them (a new
    file of a random name, which no patch can know), so that each one's files can be told apart."""
    git = Runner("/")
    env = {"GIT_CEILING_DIRECTORIES": "/"}
    sep = f".sglpatch-separator-{secrets.token_hex(8)}"
    if len(patches) == 1:
        return [_both(git, env, strip, ["-"], patches[0], sep, 1)[0]]
    with private_tmpdir("paths") as tmp:
        header = "/".join(["s"] * strip + [sep])
        Path(tmp, "sep").write_text(f"diff --git {header} {header}\nnew file mode 100644\n--- /dev/null\n+++ {header}\n"
                                    "@@ -0,0 +1 @@\n+x\n")
        args = []
        for i, data in enumerate(patches):
            Path(tmp, f"{i}.patch").write_bytes(data)
            args += [str(Path(tmp, "sep"))] * bool(i) + [str(Path(tmp, f"{i}.patch"))]
        return _both(git, env, strip, args, None, sep, len(patches))


def _both(git: Runner, env: dict, strip: int, args: list[str], data: bytes | None, sep: str, n: int) -> list[Paths]:
    sides = []
    for extra in ((), ("-R",)):
        rc, text, err = git.run("apply", "--numstat", "-z", f"-p{strip}", *extra, *args, input=data, env=env, check=False)
        if rc != 0:
            errors = [line for line in err.strip().splitlines() if line.strip()]  # the first says what
            raise GitError(errors[0].removeprefix("error: ") if errors else f"git apply --numstat: exit {rc}")
        groups: list[list[str]] = [[]]
        for entry in text.split("\0"):
            if entry:
                path = entry.split("\t", 2)[2]
                if path == sep:
                    groups.append([])
                else:
                    groups[-1].append(path)
        if len(groups) != n:
            raise GitError(f"git apply --numstat read {len(groups)} patches of {n}")
        # with -R git applies (and lists) each file argument's files last to first
        sides.append(groups if not extra else [g[::-1] for g in groups])
    return [(tuple(w), tuple(r)) for w, r in zip(*sides)]
