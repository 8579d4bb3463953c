"""The quilt ``series`` file and the patch files it names.

series: one patch name per line, optionally followed by ``-pN``; ``#`` comments and blank
lines are kept, in order, when the file is rewritten.

Patch files are ``git format-patch`` mbox files whose commit message carries DEP-3 fields::

    Subject: [PATCH] component: what it does

    Description: one line
     long description, continuation lines start with one space
    Origin: vendor, ...
    Forwarded: no
    Applied-Upstream: v0.5.10, https://...   (when known)
    Last-Update: 2026-11-30
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import unidiff

from sglpatch.errors import SglpatchError
from sglpatch.fsutil import inside
from sglpatch.gitcmd import GitError, patch_paths, read_together
from sglpatch.upstream.pin import safe_relpath

SERIES_NAME = "series"
PATCH_DIR = "patches"
REQUIRED_DEP3 = ("Description", "Origin", "Forwarded", "Last-Update")
KNOWN_DEP3 = (
    "Description",
    "Subject",
    "Origin",
    "Bug",
    "Forwarded",
    "Author",
    "From",
    "Reviewed-by",
    "Acked-by",
    "Last-Update",
    "Applied-Upstream",
    "X-Superseded-By",  # sglpatch: how to recognise upstream's replacement (sglpatch.watch.supersede)
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+/-]*$")


class SeriesError(SglpatchError):
    pass


@dataclass
class Entry:
    name: str
    strip: int = 1
    comments: list[str] = field(default_factory=list)  # comment/blank lines just above it
    raw: str | None = None  # original line, re-emitted unchanged when the entry survives


@dataclass
class Series:
    entries: list[Entry]
    trailer: list[str] = field(default_factory=list)  # comment/blank lines after the last entry

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @classmethod
    def parse(cls, text: str, origin: str = SERIES_NAME) -> "Series":
        entries: list[Entry] = []
        pending: list[str] = []
        seen: set[str] = set()
        if "\r" in text:
            raise SeriesError(f"{origin}: has CRLF line endings; convert it to LF (e.g. dos2unix {origin})")
        for lineno, line in enumerate(text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"), 1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                pending.append(line)
                continue
            body = stripped.split("#", 1)[0].strip() if " #" in stripped else stripped
            parts = body.split()
            name, opts = parts[0], parts[1:]
            where = f"{origin}:{lineno}"
            check_name(name, where)
            strip = 1
            for opt in opts:
                m = re.fullmatch(r"-p([01])", opt)
                if m:
                    strip = int(m.group(1))
                else:
                    raise SeriesError(f"{where}: unknown option {opt!r} for {name} (only -p0 and -p1 are supported)")
            if name in seen:
                raise SeriesError(f"{where}: {name} is listed twice")
            seen.add(name)
            entries.append(Entry(name=name, strip=strip, comments=pending, raw=line))
            pending = []
        return cls(entries=entries, trailer=pending)

    def dumps(self) -> str:
        out: list[str] = []
        for e in self.entries:
            out += e.comments
            out.append(e.raw if e.raw is not None else (e.name if e.strip == 1 else f"{e.name} -p{e.strip}"))
        out += self.trailer
        return "\n".join(out) + "\n" if out else ""


def check_name(name: str, where: str) -> None:
    if name.startswith("-"):
        raise SeriesError(f"{where}: patch name {name!r} looks like an option")
    try:
        safe_relpath(name, "patch name")
    except SglpatchError as e:
        raise SeriesError(f"{where}: {e}") from None
    if not _NAME_RE.match(name):
        raise SeriesError(f"{where}: patch name {name!r} has characters outside [A-Za-z0-9._+/-]")


def read_series(project: Path) -> Series:
    path = Path(project) / SERIES_NAME
    if path.is_symlink():  # read through, then replaced by a file on export
        raise SeriesError(f"{path} is a symbolic link (to {os.readlink(path)}); the series must be a regular file in the "
                          "project, as the patch files are: replace the link by the file")
    if path.exists() and not path.is_file():
        raise SeriesError(f"{path} is not a regular file; the series must be one: replace it with the file and re-run")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SeriesError(f"{path} not found; is --project the sglpatch project folder?") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SeriesError(f"{path}: not UTF-8 text") from None
    if text.startswith("\ufeff"):
        raise SeriesError(f"{path} starts with a byte-order mark (an editor saved it as 'UTF-8 with BOM'); save it as plain UTF-8 and re-run")
    # errors name the file as the user finds it: lines/R/series for a line (sglpatch.lines), else series
    line = Path(project).resolve()
    origin = f"lines/{line.name}/{SERIES_NAME}" if line.parent.name == "lines" and (line.parent.parent / SERIES_NAME).is_file() else SERIES_NAME
    return Series.parse(text, origin)


# --------------------------------------------------------------------------------------
# patch files


@dataclass
class Hunk:
    old_start: int  # 1-based line in the old file where old_lines must sit
    old_lines: list[str]  # context and removed lines, without their newline
    header: str  # "@@ -a,b +c,d @@"
    new_lines: list[str] = field(default_factory=list)  # context and added lines, without their newline


@dataclass
class FileDiff:
    old: str | None  # repository-relative path before the patch; None for a created file
    new: str | None  # path after the patch; None for a deleted file
    hunks: list[Hunk]


@dataclass
class PatchFile:
    name: str
    data: bytes
    subject: str
    dep3: dict[str, str]
    files: list[str]  # paths touched (old and new sides), repository-relative
    diffs: list[FileDiff] = field(default_factory=list)
    strip: int = 1

    @property
    def description(self) -> str:
        return self.dep3.get("Description", "")


def parse_patch(name: str, data: bytes, strip: int = 1) -> PatchFile:
    """Parse header and touched paths; errors name the patch."""
    if not data.strip():
        raise SeriesError(f"patch {name} is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SeriesError(f"patch {name} is not UTF-8 (byte {e.start}); re-export it with `sglpatch export`") from None
    # A mail header with CRLF means the whole file was converted (mail client, editor); CRLF
    # inside hunks is legitimate (upstream has CRLF files) and goes to git apply untouched.
    head_end = min((i for i in (text.find("\ndiff --git "), text.find("\n--- ")) if i >= 0), default=len(text))
    if "\r\n" in text[:head_end]:
        raise SeriesError(f"patch {name} has CRLF line endings; convert it to LF (dos2unix) and re-run")
    lines = text.split("\n")
    # header: until the first 'diff --git' / '---' separator
    subject = ""
    body: list[str] = []
    in_headers = True
    diff_start = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git ") or (line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            diff_start = i
            break
        if in_headers:
            if line.startswith("Subject:"):
                subject = line[len("Subject:") :].strip()
                while i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t")):
                    i += 1
                    subject += " " + lines[i].strip()
            elif line == "" and subject:
                in_headers = False
        else:
            if line == "---":
                # rest up to the diff is the diffstat
                j = i + 1
                while j < len(lines) and not (
                    lines[j].startswith("diff --git ")
                    or (lines[j].startswith("--- ") and j + 1 < len(lines) and lines[j + 1].startswith("+++ "))
                ):
                    j += 1
                diff_start = j if j < len(lines) else None
                break
            body.append(line)
        i += 1
    if diff_start is None:
        raise SeriesError(f"patch {name} contains no diff")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", _mime_decoded(subject))
    dep3 = parse_dep3(body)
    if not subject:
        subject = dep3.get("Description", "").split("\n", 1)[0] or dep3.get("Subject", "")
    diffs = parse_diff(name, data, "\n".join(lines[diff_start:]), strip)
    files: list[str] = []
    for d in diffs:
        for p in (d.old, d.new):
            if p is not None and p not in files:  # once each (a modification has old == new)
                files.append(p)
    if not files:
        raise SeriesError(f"patch {name} touches no files")
    return PatchFile(name=name, data=data, subject=subject, dep3=dep3, files=files, diffs=diffs, strip=strip)


def parse_dep3(lines: list[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    current = None
    for line in lines:
        m = re.match(r"^([A-Za-z][A-Za-z0-9-]*):(?:\s(.*))?$", line)
        if m and m.group(1) in KNOWN_DEP3:
            current = m.group(1)
            fields[current] = (m.group(2) or "").strip()
        elif current and line.startswith(" "):
            fields[current] += "\n" + line[1:]
        else:
            current = None
    return fields


def parse_diff(name: str, data: bytes, diff_text: str, strip: int) -> list[FileDiff]:
    """The one place a patch's diff is read: paths as git apply reads them (it is what writes
    them: quoting, renames and copies exactly as applied), hunks from unidiff; every path is
    checked to stay inside the tree. Errors name the patch."""
    try:
        written, read = patch_paths(data, strip)
    except GitError as e:
        raise SeriesError(f"patch {name} does not apply: git cannot read it ({e})") from None
    for p in written + read:
        try:
            safe_relpath(p, "path")
        except SglpatchError as e:
            raise SeriesError(f"patch {name}: {e}") from None
    try:
        files = unidiff.PatchSet.from_string(diff_text)
    except unidiff.UnidiffParseError as e:
        raise SeriesError(f"patch {name}: malformed diff ({e})") from None
    if len(files) != len(written):
        raise SeriesError(f"patch {name}: malformed diff (git reads {len(written)} file(s) in it, unidiff {len(files)})")
    diffs = []
    for f, new, old in zip(files, written, read):
        hunks = [
            Hunk(
                old_start=h.source_start if h.source_length else h.source_start + 1,
                old_lines=[ln.value[:-1] if ln.value.endswith("\n") else ln.value for ln in h.source_lines()],
                header=f"@@ -{h.source_start},{h.source_length} +{h.target_start},{h.target_length} @@",
                new_lines=[ln.value[:-1] if ln.value.endswith("\n") else ln.value for ln in h.target_lines()],
            )
            for h in f
        ]
        diffs.append(FileDiff(old=None if f.is_added_file else old, new=None if f.is_removed_file else new, hunks=hunks))
    return diffs


def hunks_by_path(patch: PatchFile, strip: int | None = None) -> dict[str, list[Hunk]]:
    """old path -> hunks, for the files that exist before the patch."""
    diffs = patch.diffs if strip in (None, patch.strip) else parse_patch(patch.name, patch.data, strip).diffs
    result: dict[str, list[Hunk]] = {}
    for d in diffs:
        if d.old is not None:
            result.setdefault(d.old, []).extend(d.hunks)
    return result


def patch_path(project: Path, name: str) -> Path:
    """patches/NAME, refused when it leads outside the project (a linked folder on the way)."""
    path = Path(project) / PATCH_DIR / name
    inside(project, path, f"{PATCH_DIR}/{name}")
    return path


def read_patch(project: Path, entry: Entry) -> PatchFile:
    return parse_patch(entry.name, _patch_bytes(project, entry), entry.strip)


def read_patches(project: Path, entries: list[Entry]) -> list[PatchFile]:
    """read_patch of each entry, in order; git reads the paths of them all at once."""
    data = [_patch_bytes(project, e) for e in entries]
    read_together([(d, e.strip) for d, e in zip(data, entries)])
    return [parse_patch(e.name, d, e.strip) for d, e in zip(data, entries)]


def _patch_bytes(project: Path, entry: Entry) -> bytes:
    path = Path(project) / PATCH_DIR / entry.name
    if path.is_symlink():
        raise SeriesError(f"{PATCH_DIR}/{entry.name} is a symbolic link; patch files must be regular files")
    patch_path(project, entry.name)
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO would be read forever
        raise SeriesError(f"{PATCH_DIR}/{entry.name} is not a regular file (a FIFO, a socket or a device); patch files must be "
                          "regular files: replace it with the patch and re-run")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SeriesError(f"series lists {entry.name} but {PATCH_DIR}/{entry.name} does not exist") from None
    except IsADirectoryError:
        raise SeriesError(f"{PATCH_DIR}/{entry.name} is a directory, not a patch") from None
    return data


def _mime_decoded(subject: str) -> str:
    """A Subject as git format-patch writes a non-ASCII one (RFC 2047 `=?UTF-8?q?...?=`), decoded."""
    if "=?" not in subject:
        return subject
    from email.header import decode_header, make_header

    try:
        return str(make_header(decode_header(subject)))
    except (ValueError, LookupError, UnicodeDecodeError):
        return subject


def slug(subject: str) -> str:
    """File-name slug the way git format-patch makes it, accents folded to ASCII first (Füge: Fuge)."""
    folded = "".join(c for c in unicodedata.normalize("NFKD", subject) if not unicodedata.combining(c))
    s = re.sub(r"[^A-Za-z0-9._]+", "-", folded).strip("-.")
    s = re.sub(r"\.+", ".", s)
    return s[:52].rstrip("-.") or "patch"
