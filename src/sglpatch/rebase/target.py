"""The target of `sglpatch rebase --onto VERSION|TAG|COMMIT` (and of its dry run, the watch's
classification): which release it names, from which source, and its upstream.lock, every field
filled and checked against the index (and the recorded pin in resolutions/<version>/target.toml).
Materializing the tree it pins is sglpatch.upstream.materialize's."""

from __future__ import annotations

import re
import tempfile

from sglpatch.upstream import artifacts, pkgindex
from sglpatch.errors import SglpatchError, say
from sglpatch.gitcmd import Git, validate_ref, validate_url
from sglpatch.upstream.pin import UNKNOWN_COMMIT, Lock, LockError
from sglpatch.upstream.pkgindex import no_release
from sglpatch.upstream.materialize import commits_match

VERSION_RE = re.compile(r"^v?([0-9]+(\.[0-9]+)*((a|b|rc|\.post|\.dev)[0-9]+)*)$")
SHA_RE = re.compile(r"^[0-9a-f]{7,40}$")


def _ls_remote_tags(url: str, timeout: float = 20.0) -> dict[str, str] | None:
    """tag -> peeled commit id at url, or None when the URL does not answer."""
    url = validate_url(url)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rc, out, _ = Git(tmp).run("ls-remote", "--tags", "--end-of-options", url, check=False, network=True, timeout=timeout)
        except Exception:  # GitPython raises on kill_after_timeout
            return None
    if rc != 0:
        return None
    tags: dict[str, str] = {}
    for line in out.splitlines():
        if "\t" not in line:
            continue
        sha, ref = line.split("\t", 1)
        if not ref.startswith("refs/tags/"):
            continue
        name = ref[len("refs/tags/") :]
        if name.endswith("^{}"):
            tags[name[:-3]] = sha
        else:
            tags.setdefault(name, sha)
    return tags


def onto_release(onto: str) -> tuple[str, str] | None:
    """(tag, version) of --onto when it names a release (VERSION or vVERSION); None for a commit or tag."""
    m = VERSION_RE.match(onto.strip())
    return (onto if onto.startswith("v") else f"v{m.group(1)}", m.group(1)) if m else None


def target_lock(
    current: Lock,
    onto: str,
    source: str,
    recorded: dict[str, str] | None = None,
    commit: str | None = None,
    python: str | None = None,
    url: str | None = None,
    ls_remote: bool = True,
) -> Lock:
    """The Lock for a rebase target, every field filled and checked.

    onto: a registry version (0.5.10.post1), a release tag (v0.5.10.post1) or, with the git
    source, a commit id that a release tag points at. The registry artifact is the sdist when
    the index has one, else the wheel (source "wheel" asks for the wheel); its sha256 is the
    one the index publishes (a recorded one in resolutions/<version>/target.toml must agree)
    and the file is verified against it. The commit comes from the recorded pin, --commit, the
    artifact's _version.py or `git ls-remote` of the tag; when none says it (every release
    from 0.5.10 on records none) the lock says commit = "unknown".
    """
    onto = onto.strip()
    m = VERSION_RE.match(onto)
    if m:
        version = m.group(1)
        tag = onto if onto.startswith("v") else f"v{version}"
    elif SHA_RE.match(onto):
        if source != "git":
            raise SglpatchError(f"--onto {onto}: a commit id needs --source git (the registry knows versions, not commits)")
        tags = _ls_remote_tags(url or current.url)
        if tags is None:
            raise SglpatchError(f"--onto {onto}: cannot list the tags of {url or current.url}; pass the release tag or version instead")
        hits = sorted(t for t, sha in tags.items() if sha.startswith(onto) and VERSION_RE.match(t))
        if not hits:
            raise SglpatchError(f"--onto {onto}: no release tag points at this commit; upstream.lock pins releases (tag + artifact)")
        tag = hits[0]
        version = VERSION_RE.match(tag).group(1)
    else:
        raise SglpatchError(f"--onto {onto!r}: expected a version (0.5.10.post1), a tag (v0.5.10.post1) or a commit id")
    recorded = recorded or {}
    if recorded.get("version", version) != version:
        raise SglpatchError(f"recorded target pin is for version {recorded['version']}, not {version}")
    tag = recorded.get("tag", tag)
    kinds = pkgindex.kinds_offered(current.name, version)
    if not kinds:
        raise no_release(current.name, version, f"the registry offers no sdist and no usable wheel of {current.name} {version}")
    kind = "wheel" if source == "wheel" or "sdist" not in kinds else "sdist"
    if kind not in kinds:
        raise SglpatchError(f"the registry offers no {kind} of {current.name} {version} (it has: {', '.join(kinds)})")
    art = pkgindex.choose(current.name, version, kind)
    if recorded.get("sdist_sha256") and kind == "sdist" and recorded["sdist_sha256"] != art.sha256:
        raise LockError(f"{art.filename}: the recorded sha256 {recorded['sdist_sha256']} is not the one the index publishes ({art.sha256})")
    lock = Lock(
        name=current.name, url=url or current.url, tag=validate_ref(tag, "tag"), commit=UNKNOWN_COMMIT, version=version,
        sdist_filename=art.filename, sdist_sha256=art.sha256, sdist_subdir=current.sdist_subdir,
    )
    in_artifact = ""
    if source != "git":
        _, path = artifacts.fetch(lock.name, version, kind, python)  # verified against the index
        in_artifact = artifacts.recorded_commit(path)
    candidates = [("recorded target pin", recorded.get("commit")), ("--commit", commit), (f"the {kind}'s _version.py", in_artifact)]
    chosen = next(((why, c) for why, c in candidates if c), None)
    if chosen is None and (ls_remote or source == "git"):
        tags = _ls_remote_tags(lock.url)
        if tags and tags.get(tag):
            chosen = (f"git ls-remote {lock.url}", tags[tag])
    if chosen is None:
        if source == "git":
            raise SglpatchError(f"cannot tell which commit {tag} is and {lock.url} does not answer; use --source sdist or wheel")
        say(f"{tag}: the {kind} records no commit and {lock.url} does not answer: upstream.commit = {UNKNOWN_COMMIT!r}")
        lock.validate(f"target {version}")
        return lock
    for why, c in candidates:
        if c and not commits_match(c, chosen[1]):
            raise LockError(f"upstream.commit: {why} says {c} but {chosen[0]} says {chosen[1]}")
    lock.commit = chosen[1]
    lock.validate(f"target {version}")
    return lock
