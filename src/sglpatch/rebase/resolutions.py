"""Recorded resolutions (resolutions/<version>/), keyed by the conflict they resolve, like git rerere."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from sglpatch import toml
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import inside, write_if_changed
from sglpatch.gitcmd import Git
from sglpatch.series import check_name
from sglpatch.rebase.outcome import Outcome, RESOLUTIONS_DIR
from sglpatch.rebase_plan_file import RebaseError


# --------------------------------------------------------------------------------------
# recorded resolutions


@dataclass
class Recorded:
    action: str  # replace | drop
    why: str
    patch_sha256: str
    data: bytes | None = None
    conflict: str = ""  # conflict_key() of the conflict it resolves (like git rerere)
    version: str = ""  # the release it was recorded for


def resolutions_dir(project: Path, version: str) -> Path:
    return Path(project) / RESOLUTIONS_DIR / version


def _checked(project: Path, path: Path) -> Path:
    """A file of resolutions/<version>/: a regular file inside the project, never a link."""
    if path.is_symlink():
        raise RebaseError(f"{path} is a symbolic link; recorded resolutions must be regular files in the project")
    inside(project, path)
    return path


def _toml(project: Path, f: Path) -> dict:
    try:
        data = toml.loads(_checked(project, f).read_text(encoding="utf-8"))
    except toml.TOMLDecodeError as e:
        raise RebaseError(f"{f}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise RebaseError(f"{f}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise RebaseError(f"{f}: cannot be read ({e.strerror})") from None
    return data


def _name(f: Path, name: str) -> str:
    """A patch name as the series allows it (no '..', not absolute, no odd characters)."""
    try:
        check_name(name, f"{f}: [patch.{json.dumps(name)}]")
    except SglpatchError as e:
        raise RebaseError(str(e)) from None
    return name


def read_resolutions(project: Path, version: str) -> tuple[dict[str, Recorded], dict[str, str]]:
    d = resolutions_dir(project, version)
    recs: dict[str, Recorded] = {}
    target: dict[str, str] = {}
    if d.exists():
        inside(project, d, f"{RESOLUTIONS_DIR}/{version}")
    f = d / "resolutions.toml"
    if f.is_file() or f.is_symlink():
        data = _toml(project, f)
        patches = data.get("patch", {})
        if not isinstance(patches, dict):
            raise RebaseError(f"{f}: 'patch' must be a table of [patch.\"NAME\"] tables")
        for name, t in patches.items():
            _name(f, name)
            if not isinstance(t, dict):
                raise RebaseError(f"{f}: patch {name!r} must be a table (action, patch_sha256, why)")
            action = t.get("action")
            if action not in ("replace", "drop"):
                raise RebaseError(f"{f}: patch {name!r}: action must be 'replace' or 'drop'")
            if not re.fullmatch(r"[0-9a-f]{64}", str(t.get("patch_sha256", ""))):
                raise RebaseError(f"{f}: patch {name!r}: patch_sha256 must be 64 hex digits")
            body = None
            if action == "replace":
                pf = d / name
                if not pf.is_file() and not pf.is_symlink():
                    raise RebaseError(f"{f}: patch {name!r} is 'replace' but {pf} is missing")
                body = _checked(project, pf).read_bytes()
            recs[name] = Recorded(action, str(t.get("why", "")).strip(), t["patch_sha256"], body, str(t.get("conflict", "")), version)
    tf = d / "target.toml"
    if tf.is_file() or tf.is_symlink():
        t = _toml(project, tf).get("target", {})
        if not isinstance(t, dict):
            raise RebaseError(f"{tf}: 'target' must be a table")
        target = {k: str(v) for k, v in t.items() if k in ("version", "tag", "commit", "sdist_sha256")}
    return recs, target


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def write_resolutions(project: Path, version: str, recs: dict[str, Recorded]) -> None:
    d = resolutions_dir(project, version)
    lines = [
        f"# Recorded resolutions for rebasing the series onto sglang {version}.",
        "# Written by `sglpatch rebase` (hand resolutions are recorded on success); see docs/rebase.md.",
        "# action = \"replace\": apply the file of the same name in this folder instead of the patch;",
        "# action = \"drop\": leave the patch out. Used only for the patch whose sha256 is patch_sha256.",
        "",
    ]
    for name in sorted(recs):
        r = recs[name]
        lines += [f"[patch.{_toml_str(name)}]", f"action = {_toml_str(r.action)}", f"patch_sha256 = {_toml_str(r.patch_sha256)}"]
        if r.conflict:
            lines.append(f"conflict = {_toml_str(r.conflict)}")
        lines.append(f"why = {_toml_str(r.why)}")
        lines.append("")
        if r.action == "replace" and r.data is not None:
            write_if_changed(d / _name(d / "resolutions.toml", name), r.data, within=Path(project))
    write_if_changed(d / "resolutions.toml", "\n".join(lines).encode(), within=Path(project))


def conflict_key(git: Git, tree: str, files: list[str]) -> str:
    """The conflict itself, like git rerere: the conflicting files and the text of every
    conflict region (both sides) of the 3-way result, marker labels dropped, hashed."""
    h = hashlib.sha256()
    for path in sorted(files):
        text = git.blob_text(tree, path)
        h.update(f"{path}\0".encode())
        if text is None:
            h.update(b"gone\0")
            continue
        inside = False
        for line in text.split("\n"):
            if line.startswith("<<<<<<<"):
                inside = True
                h.update(b"<<<\n")
            elif inside and line.startswith((">>>>>>>", "=======", "|||||||")):
                h.update(line[:3].encode() + b"\n")
                inside = not line.startswith(">>>>>>>")
            elif inside:
                h.update(line.encode() + b"\n")
    return h.hexdigest()


def rerere(project: Path, name: str, key: str, sha: str, o: Outcome) -> Recorded | None:
    """A recorded resolution of this patch for the same conflict, from any release's folder."""
    root = project / RESOLUTIONS_DIR
    other = None
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not (d / "resolutions.toml").is_file():
            continue
        rec = lenient_resolutions(project, d.name)[0].get(name)
        if rec is None:
            continue
        if rec.conflict == key or rec.patch_sha256 == sha and not rec.conflict:
            return rec
        other = rec
    if other is not None:
        o.note = (o.note + "; " if o.note else "") + f"the recorded resolution for {other.version} is for another conflict: not used"
    return None


_WARNED: set[str] = set()


def lenient_resolutions(project: Path, version: str) -> tuple[dict[str, Recorded], dict[str, str]]:
    """read_resolutions, but a folder that cannot be read is left out with one line (once per
    folder and process): another release's folder, or the watch, must not stop at it."""
    try:
        return read_resolutions(project, version)
    except SglpatchError as e:
        if version not in _WARNED:
            _WARNED.add(version)
            say(f"warning: {e}; the recorded resolutions of {RESOLUTIONS_DIR}/{version}/ are not used")
        return {}, {}
