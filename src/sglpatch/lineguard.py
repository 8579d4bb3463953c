"""What apply checks, before any work, about the Python it installs a line into: that Python keeps
the release it serves (a line's tree over another release's dependencies needs --venv NEWDIR or
--other-release), and it can load the tree (a tree from a wheel carries compiled extensions for
that wheel's CPython only); and what export checks: the tree is on the line's pin. Each refusal is one
line naming the way out, with the line's --line."""

from __future__ import annotations

import re
from pathlib import Path

from sglpatch import exitcodes, extrecord
from sglpatch.errors import SglpatchError
from sglpatch.pythonenv.interpreter import probe, same_version  # noqa: F401  (apply asks them here too)

_WHEEL_PY = re.compile(r"-(cp\d+)-(cp\d+|abi3|none)-[^-]+\.whl$")


def guard_release(python: str, line, opt: str, allowed: bool, workdir: Path) -> None:
    """Refuse to install line's tree into python while python serves another SGLang release (from
    elsewhere than workdir's tree), unless allowed (--other-release)."""
    facts = probe(python)
    if facts is None or not facts[0] or allowed:
        return
    have, origin, _ = facts
    if same_version(have, line.release):
        return
    if origin and Path(origin).resolve().is_relative_to((Path(workdir) / "python").resolve()):
        return  # its own tree: apply's move guard decides (sglpatch.lines.guard_move)
    raise SglpatchError(
        f"{python} serves sglang {have}, not {line.release}: installing the line {line.release} there (--no-deps) would run it "
        f"on {have}'s dependencies; nothing was changed: `sglpatch apply{opt} --venv NEWDIR` builds a complete venv "
        "(or pass --other-release to install it there anyway)", exitcodes.USAGE)


def wheel_python(line) -> str | None:
    """cpXY of the wheel line's lock pins (None: an sdist, or a pure-Python wheel)."""
    m = _WHEEL_PY.search(line.lock.sdist_filename or "")
    return m.group(1) if m and line.lock.artifact_kind == "wheel" and m.group(2) != "abi3" else None


def guard_wheel_python(python: str, line, opt: str) -> str | None:
    """A tree taken from a cpXY wheel carries compiled extensions (*.cpython-XY-*.so) for CPython XY
    only: for a Python of another version, the cpZW (e.g. cp312) its extensions are to be taken for
    (the release's own cpZW wheel on the index, sglpatch.lineguard.compiled_for, at the install);
    None when nothing is needed. Refused before any work when the index has no such wheel."""
    want = wheel_python(line)
    facts = probe(python) if want else None
    if not want or facts is None or facts[2] == want:
        return None
    ver = lambda tag: f"{tag[2]}.{tag[3:]}"  # noqa: E731
    art, offered = _offered(line, facts[2], ver(facts[2]))
    if art is not None:
        return facts[2]
    raise SglpatchError(
        f"the line {line.release} pins {line.lock.sdist_filename} (CPython {ver(want)} only): its tree's compiled extensions "
        f"(*.cpython-{want[2:]}-*.so) do not load in {python} (Python {ver(facts[2])}), and {line.where}upstream.lock carries no "
        f"wheel for Python {ver(facts[2])} ({offered}); nothing was changed: install into a Python {ver(want)} "
        f"(`sglpatch apply{opt} --python PY{ver(want)}` or `--venv NEWDIR --python PY{ver(want)}`)", exitcodes.USAGE)


def _offered(line, cp: str, v: str):
    """(the index's wheel of the line's release for that CPython, or None; the words for a refusal)."""
    from sglpatch.upstream import pkgindex

    try:
        art = pkgindex.wheel_for(line.lock.name, line.release, cp)
    except SglpatchError as e:
        return None, f"the package index could not be asked: {e}"
    return art, f"the package index has no {line.lock.name} {line.release} wheel for Python {v} either"


def compiled_for(workdir: Path, line, cp: str, python: str) -> str:
    """The release's own cp wheel (the index's, checked against the index's sha256) supplies the
    compiled extensions for that CPython beside the line's tree: its sources must be the lock's
    (every blob the lock records), and its *.cpython-XY-*.so files are written untracked (git ignores
    *.so in DIR) next to the pinned wheel's. Inside apply's transaction, before the install."""
    import hashlib
    import zipfile

    from sglpatch.upstream import artifacts, pkgindex

    lock, v = line.lock, f"{cp[2]}.{cp[3:]}"
    art = pkgindex.wheel_for(lock.name, line.release, cp)
    if art is None:
        raise SglpatchError(f"the package index has no {lock.name} {line.release} wheel for Python {v}; nothing was installed")
    path = artifacts.fetch_verified(lock.name, line.release, art, python, py_version=v)
    so = re.compile(rf"^sglang/[^\\]*\.cpython-{cp[2:]}-[^/]*\.so$")
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        for rel, blob in lock.blobs.items():
            member = rel.removeprefix(f"{lock.sdist_subdir}/")
            data = zf.read(member) if member in names else None
            got = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() if data is not None else "missing"
            if got != blob:
                raise SglpatchError(f"{art.filename}: {rel} is not the file {line.where}upstream.lock pins ({got[:12]}, not {blob[:12]}); "
                                    "its compiled extensions are not taken; nothing was installed")
        taken = [n for n in sorted(names) if so.match(n) and ".." not in n.split("/")]
        extrecord.add(workdir, lock.pin_digest(), cp, {f"{lock.sdist_subdir}/{n}": zf.read(n) for n in taken})
    return (f"the line {line.release} pins {lock.sdist_filename}; for Python {v}: {len(taken)} compiled extension(s) of {art.filename} "
            f"(sha256 {art.sha256}, the index's) beside its tree, untracked; its sources are the lock's")


def guard_pin(git, project_root: Path) -> None:
    """Export writes a line's files only from a tree on that line's pin: a tree on another release
    (another line's commits) is refused with one line naming both, whatever else lines/ holds."""
    from sglpatch import lines
    from sglpatch.upstream import materialize as upstream

    line = lines.at(project_root)
    pin = upstream.upstream_pin(git)
    if pin and pin != line.lock.pin_digest():
        held = lines.holding(lines.checkout_of(project_root), pin)
        what = f"the line {held.release}" if held else "another release than any line's lock"
        opt = f" --line {held.release}" if held and not held.primary else ""
        raise SglpatchError(f"{git.workdir} holds {what}, not the line {line.release} ({line.where} pins {line.lock.describe()}); "
                            f"nothing was written" + (f": `sglpatch export{opt} --workdir {git.workdir}`" if held else ""), exitcodes.USAGE)
