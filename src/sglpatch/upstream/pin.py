"""upstream.lock: read, write and verify the pinned SGLang release.

The lock is TOML. Every field is required and checked; an unknown field or a
malformed value is a one-line error naming the field.

    [upstream]
    name = "sglang"
    url = "https://github.com/sgl-project/sglang"   # for --source git
    tag = "v0.5.9"
    commit = "bbe9c7eeb"                             # 7-40 hex; full after `lock --resolve`; or "unknown"
    version = "0.5.9"

    [sdist]                                          # the registry artifact (--source sdist|wheel)
    filename = "sglang-0.5.9.tar.gz"                 # or the wheel's name for wheel-only releases
    sha256 = "..."
    subdir = "python"                                # where the sdist sits in the repo

    [blobs]                                          # git blob id of every upstream file the series touches
    "python/sglang/srt/layers/communicator.py" = "..."
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch import toml
from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import validate_ref, validate_sha, validate_url

LOCK_NAME = "upstream.lock"
UNKNOWN_COMMIT = "unknown"  # the release records no commit and GitHub did not answer

_VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*((a|b|rc|\.post|\.dev)[0-9]+)*$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

_SCHEMA = {
    "upstream": ("name", "url", "tag", "commit", "version"),
    "sdist": ("filename", "sha256", "subdir"),
}


class LockError(SglpatchError):
    pass


def safe_relpath(path: str, what: str = "path") -> str:
    """A repository-relative path that cannot leave the tree."""
    if not isinstance(path, str) or not path:
        raise SglpatchError(f"invalid {what}: empty")
    if path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path):
        raise SglpatchError(f"invalid {what} {path!r}: absolute paths are not allowed")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in path or "\0" in path:
        raise SglpatchError(f"invalid {what} {path!r}: must be a plain relative path without '..'")
    if parts[0] == ".git":
        raise SglpatchError(f"invalid {what} {path!r}: must not point into .git")
    return path


@dataclass
class Lock:
    name: str
    url: str
    tag: str
    commit: str
    version: str
    sdist_filename: str
    sdist_sha256: str
    sdist_subdir: str
    blobs: dict[str, str] = field(default_factory=dict)

    @property
    def artifact_kind(self) -> str:
        """'wheel' when the pinned registry artifact is a wheel (releases without an sdist), else 'sdist'."""
        return "wheel" if self.sdist_filename.endswith(".whl") else "sdist"

    # -- identity -----------------------------------------------------------
    def pin_digest(self) -> str:
        """Digest of what determines the upstream tree (not the blob list)."""
        text = "\n".join(
            [self.name, self.url, self.tag, self.commit, self.version, self.sdist_filename, self.sdist_sha256, self.sdist_subdir]
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> str:
        return f"{self.name} {self.version} ({self.tag}, commit {self.commit[:12]})"

    # -- (de)serialisation ------------------------------------------------------
    @classmethod
    def parse(cls, text: str, origin: str = LOCK_NAME) -> "Lock":
        try:
            data = toml.loads(text)
        except toml.TOMLDecodeError as e:
            raise LockError(f"{origin}: not valid TOML ({e})") from None
        for section in data:
            if section not in (*_SCHEMA, "blobs"):
                raise LockError(f"{origin}: unknown section [{section}]")
        values = {}
        for section, keys in _SCHEMA.items():
            table = data.get(section)
            if not isinstance(table, dict):
                raise LockError(f"{origin}: missing section [{section}]")
            for key in table:
                if key not in keys:
                    raise LockError(f"{origin}: unknown field {section}.{key}")
            for key in keys:
                if key not in table:
                    raise LockError(f"{origin}: missing field {section}.{key}")
                if not isinstance(table[key], str):
                    raise LockError(f"{origin}: field {section}.{key} must be a string")
                values[f"{section}.{key}"] = table[key]
        blobs = data.get("blobs", {})
        if not isinstance(blobs, dict):
            raise LockError(f"{origin}: [blobs] must be a table")
        lock = cls(
            name=values["upstream.name"],
            url=values["upstream.url"],
            tag=values["upstream.tag"],
            commit=values["upstream.commit"],
            version=values["upstream.version"],
            sdist_filename=values["sdist.filename"],
            sdist_sha256=values["sdist.sha256"],
            sdist_subdir=values["sdist.subdir"],
            blobs=dict(blobs),
        )
        lock.validate(origin)
        return lock

    def validate(self, origin: str = LOCK_NAME) -> None:
        def bad(fieldname: str, why: str):
            raise LockError(f"{origin}: field {fieldname} {why}")

        if self.name != "sglang":
            bad("upstream.name", f"is {self.name!r}; only 'sglang' is supported")
        try:
            validate_url(self.url)
        except SglpatchError as e:
            bad("upstream.url", f"is not acceptable: {e}")
        try:
            validate_ref(self.tag, "tag")
        except SglpatchError as e:
            bad("upstream.tag", f"is not acceptable: {e}")
        if self.commit != UNKNOWN_COMMIT:
            try:
                validate_sha(self.commit)
            except SglpatchError:
                bad("upstream.commit", f"is {self.commit!r}; expected 7-40 lowercase hex digits or {UNKNOWN_COMMIT!r}")
        if not _VERSION_RE.match(self.version):
            bad("upstream.version", f"is {self.version!r}; expected a release version such as 0.5.9")
        expected_name = f"{self.name}-{self.version}.tar.gz"
        wheel = re.fullmatch(rf"{re.escape(self.name)}-{re.escape(self.version)}-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+\.whl", self.sdist_filename)
        if self.sdist_filename != expected_name and not wheel:
            bad("sdist.filename", f"is {self.sdist_filename!r}; expected {expected_name!r} or a wheel of {self.name} {self.version}")
        if not _HEX64.match(self.sdist_sha256):
            bad("sdist.sha256", "must be 64 lowercase hex digits")
        try:
            safe_relpath(self.sdist_subdir, "sdist.subdir")
        except SglpatchError as e:
            bad("sdist.subdir", f"is not acceptable: {e}")
        for path, blob in self.blobs.items():
            try:
                safe_relpath(path, "blob path")
            except SglpatchError as e:
                raise LockError(f"{origin}: [blobs] {e}") from None
            if not isinstance(blob, str) or not _HEX40.match(blob):
                raise LockError(f"{origin}: field blobs.{path!r} must be a 40-hex git blob id")

    def dumps(self) -> str:
        def q(s: str) -> str:
            return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

        lines = [
            "# The SGLang release this series applies to. Written by `sglpatch`; every field is",
            "# verified whenever an upstream tree is materialized (git or sdist).",
            "",
            "[upstream]",
            f"name = {q(self.name)}",
            f"url = {q(self.url)}",
            f"tag = {q(self.tag)}",
            f"commit = {q(self.commit)}",
            f"version = {q(self.version)}",
            "",
            "[sdist]",
            f"filename = {q(self.sdist_filename)}",
            f"sha256 = {q(self.sdist_sha256)}",
            f"subdir = {q(self.sdist_subdir)}",
            "",
            "# git blob id of every upstream file the series touches: proves that a git checkout",
            "# and the sdist agree on exactly the files we patch.",
            "[blobs]",
        ]
        lines += [f"{q(path)} = {q(self.blobs[path])}" for path in sorted(self.blobs)]
        return "\n".join(lines) + "\n"


def read_lock(project: Path) -> Lock:
    path = Path(project) / LOCK_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LockError(f"{path} not found; is --project the sglpatch project folder?") from None
    except UnicodeDecodeError:
        raise LockError(f"{path}: not UTF-8 text") from None
    return Lock.parse(text, LOCK_NAME)


def write_lock(project: Path, lock: Lock) -> bool:
    """Write the lock if its bytes change; returns whether it changed."""
    from sglpatch.fsutil import write_if_changed

    lock.validate()
    return write_if_changed(Path(project) / LOCK_NAME, lock.dumps().encode(), within=Path(project))


def sha256_file(path: Path) -> str:
    from sglpatch.fsutil import open_regular

    h = hashlib.sha256()
    with open_regular(path) as f:  # a cached artifact linked to /dev/zero: one line, not an endless read
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
