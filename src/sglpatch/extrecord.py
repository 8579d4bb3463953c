"""The record of the compiled extensions sglpatch wrote beside a line's tree: DIR/.git/sglpatch-extensions.

A line pinned to one CPython's wheel (0.5.23: cp311) installed into another Python gets that
CPython's extensions from the release's own wheel, written untracked beside the tree
(sglpatch.lineguard.compiled_for). The record keeps one entry per CPython, so a 3.12 install and
then a 3.13 one both stay listed:

    {"schema": "sglpatch.extensions/2",
     "cp312": {"pin": "<the lock's pin digest>", "files": {"python/sglang/...cpython-312-....so": "<sha256>"}}}

When the tree moves to another pin, every entry of another pin goes (`drop_other_pins`): only a
file the record names, of an extension's shape under python/sglang/, untracked, a regular file
inside DIR and not under .git, whose bytes still have the sha256 recorded when sglpatch wrote
it. The record is untrusted when read: one that is not the shape above is one line naming it,
and nothing is deleted. A record of the first format (text: "PIN cpXY", then paths, no hashes)
is read too; the files it names are kept and named, as nothing proves sglpatch wrote them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import no_link, write_if_changed

SCHEMA = "sglpatch.extensions/2"
NAME = "sglpatch-extensions"
CP = re.compile(r"^cp3\d{1,2}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
SHAPE = re.compile(r"^python/sglang/(?:[\w.-]+/)*[\w.-]+\.cpython-3\d{1,2}[\w.-]*\.so$")


def path(workdir: Path) -> Path:
    return no_link(Path(workdir) / ".git" / NAME, "sglpatch keeps its record of the extensions it wrote there: remove the link and re-run")


def _bad(rec: Path, why: str) -> SglpatchError:
    return SglpatchError(f"{rec} is not a record sglpatch wrote ({why}); nothing was deleted: check the compiled extensions "
                         f"beside the tree (`git -C {rec.parent.parent} status --ignored`), remove {rec} and re-run")


def _check_rel(rec: Path, rel) -> str:
    if not isinstance(rel, str) or ".." in rel.split("/") or not SHAPE.match(rel):
        raise _bad(rec, f"{rel!r} is not an extension's path under python/sglang/")
    return rel


def read(workdir: Path) -> dict[str, dict]:
    """{cpXY: {"pin": digest, "files": {rel: sha256 or None (first format)}}}; {} when there is none."""
    rec = path(workdir)
    if not rec.exists():
        return {}
    if not rec.is_file():
        raise _bad(rec, "not a regular file")
    try:
        text = rec.read_text()[:1 << 20] if rec.stat().st_size <= 1 << 20 else None
    except (OSError, UnicodeDecodeError) as e:
        raise _bad(rec, f"unreadable: {e}") from None
    if text is None:
        raise _bad(rec, "larger than 1 MiB")
    if not text.lstrip().startswith("{"):
        return _first_format(rec, text)
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise _bad(rec, f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise _bad(rec, "no sglpatch.extensions schema")
    out = {}
    for cp, entry in doc.items():
        if cp == "schema":
            continue
        if not CP.match(str(cp)) or not isinstance(entry, dict) or not HEX64.match(str(entry.get("pin", ""))) \
                or not isinstance(entry.get("files"), dict):
            raise _bad(rec, f"entry {cp!r} is not {{pin, files}} for a CPython")
        files = {}
        for rel, sha in entry["files"].items():
            if not isinstance(sha, str) or not HEX64.match(sha):
                raise _bad(rec, f"{rel!r} has no sha256")
            files[_check_rel(rec, rel)] = sha
        out[cp] = {"pin": entry["pin"], "files": files}
    return out


def _first_format(rec: Path, text: str) -> dict[str, dict]:
    head, *rels = text.splitlines() or [""]
    pin, _, cp = head.partition(" ")
    if not HEX64.match(pin) or not CP.match(cp):
        raise _bad(rec, "its first line is not 'PIN cpXY'")
    return {cp: {"pin": pin, "files": {_check_rel(rec, r): None for r in rels if r}}}


def write(workdir: Path, entries: dict[str, dict]) -> None:
    rec = path(workdir)
    if not entries:
        rec.unlink(missing_ok=True)
        return
    write_if_changed(rec, (json.dumps({"schema": SCHEMA, **entries}, indent=1, sort_keys=True) + "\n").encode())


def add(workdir: Path, pin: str, cp: str, files: dict[str, bytes]) -> None:
    """Record cp's extensions for pin (beside every other CPython's entry), then write them: a kill
    between the two leaves none unlisted."""
    entries = read(workdir)
    entries[cp] = {"pin": pin, "files": {_check_rel(path(workdir), rel): hashlib.sha256(data).hexdigest() for rel, data in files.items()}}
    write(workdir, entries)
    for rel, data in files.items():
        out = Path(workdir) / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)


def _removable(root: Path, rel: str, sha: str | None, tracked: set[str]) -> str:
    """'remove', 'gone', or why the file stays."""
    f = root / rel
    if rel in tracked:
        return "tracked by git"
    if f.is_symlink():
        return "a symbolic link"
    if not f.exists():
        return "gone"
    real = f.resolve()
    if not f.is_file() or not real.is_relative_to(root) or real.is_relative_to(root / ".git"):
        return "not a regular file inside the tree"
    if sha is None:
        return "recorded without a hash (an older sglpatch)"
    return "remove" if hashlib.sha256(f.read_bytes()).hexdigest() == sha else "changed since sglpatch wrote it"


def drop_other_pins(git, pin: str) -> None:
    """Before the tree stays on pin: every other pin's extensions go, as the module's text says."""
    entries = read(git.workdir)
    others = {cp: e for cp, e in entries.items() if e["pin"] != pin}
    if not others:
        return
    root = Path(git.workdir).resolve()
    rels = [rel for e in others.values() for rel in e["files"]]
    tracked = set(git.run("ls-files", "-z", "--", *rels).split("\0")) if rels else set()
    for cp, entry in sorted(others.items()):
        gone, kept = 0, []
        for rel, sha in entry["files"].items():
            why = _removable(root, rel, sha, tracked)
            if why == "remove":
                os.unlink(root / rel)
                gone += 1
            elif why != "gone":
                kept.append(f"{rel} ({why})")
        del entries[cp]
        write(git.workdir, entries)
        say(f"removed {gone} compiled extension(s) for Python {cp[2:3]}.{cp[3:]} that an install of another release left beside "
            f"{git.workdir}'s tree" + (f"; kept {len(kept)}: {', '.join(kept[:3])}" if kept else ""))
