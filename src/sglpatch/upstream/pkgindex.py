"""The package index, read: which sdists and wheels it lists for a project, with the sha256 it
publishes for each (PEP 691 JSON, or the ``#sha256=`` fragment of a PEP 503 HTML page), from the
index pip is configured with (``PIP_INDEX_URL``, else pip's settings as ``pip_settings`` reads
them, else PyPI) or another one named; which releases it offers and which file of a release to take. The
index is untrusted input: odd file names and URLs are ignored, an answer of the wrong shape is
one line. Its last answer is kept in the cache and used, with a warning, when it does not
answer. Downloading what it lists is ``sglpatch.upstream.artifacts``'.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path

from sglpatch import exitcodes, redact
from sglpatch.upstream.cachedir import cache_dir
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint

DEFAULT_INDEX = "https://pypi.org/simple"
WHEEL_PY = "3.11"  # which CPython's wheel to take when a release ships only compiled wheels
WHEEL_PLATFORM = "manylinux_2_34_x86_64"


class ArtifactError(SglpatchError):
    pass


@dataclass(frozen=True)
class Artifact:
    filename: str
    version: str
    kind: str  # sdist | wheel
    sha256: str
    url: str


# pip's settings of where packages come from (pip download and pip install read them; uv reads none)
PIP_SOURCES = ("index-url", "extra-index-url", "find-links", "constraint", "no-index")


def pip_settings(command: str) -> dict[str, list[str]]:
    """pip's settings of PIP_SOURCES as ``pip <command>`` reads them, from ``pip config list`` (every
    file pip reads, PIP_CONFIG_FILE's included, and the PIP_* variables): {name: values}, the most
    specific place winning (a PIP_* variable over [command] over [global])."""
    rank = {"global": 0, command: 1, ":env:": 2}
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, cwd="/").stdout
    got: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        key, eq, value = line.partition("=")
        where, _, name = key.rpartition(".")
        if eq and name in PIP_SOURCES and where in rank and rank[where] >= got.get(name, (-1, ""))[0]:
            try:
                got[name] = (rank[where], str(ast.literal_eval(value)))
            except (ValueError, SyntaxError):
                continue
    return {name: value.split() for name, (_, value) in got.items()}


@lru_cache(maxsize=None)
def index_url() -> str:
    """The index ``pip download`` reads: PIP_INDEX_URL, else its configured index-url, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            url = (pip_settings("download").get("index-url") or [""])[-1]
        except (OSError, subprocess.SubprocessError):
            url = ""
    return (url or DEFAULT_INDEX).rstrip("/")


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href:
            self.links.append((data.strip(), self._href))
            self._href = None


def _parse_index(name: str, body: bytes, ctype: str, base: str) -> list[dict]:
    if "json" in ctype:
        data = json.loads(body)
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
            raise _IndexShape("its JSON is not a PEP 691 project page (no list of file objects under 'files')")
        out = []
        for f in files:
            hashes = f.get("hashes") if isinstance(f.get("hashes"), dict) else {}
            if not isinstance(f.get("filename"), str) or not isinstance(f.get("url"), str) or not isinstance(hashes.get("sha256", ""), str):
                raise _IndexShape(f"its JSON lists a file whose filename, url or sha256 is not a string ({json.dumps(f)[:80]})")
            out.append({"filename": f["filename"], "sha256": hashes.get("sha256", ""), "url": urllib.parse.urljoin(base, f["url"])})
        return out
    p = _Links()
    p.feed(body.decode("utf-8", "replace"))
    out = []
    for text, href in p.links:
        m = re.search(r"#sha256=([0-9a-f]{64})", href)
        out.append({"filename": text, "sha256": m.group(1) if m else "", "url": urllib.parse.urljoin(base, href.split("#")[0])})
    return out


class _IndexShape(ValueError):
    """An index answer (or a saved one) that is not what a package index answers."""


def _saved_shape(files) -> list[dict]:
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and all(isinstance(f.get(k), str) for k in ("filename", "sha256", "url")) for f in files
    ):
        raise _IndexShape("not a list of {filename, sha256, url} objects")
    return files


def _save_answer(saved: Path, files: list[dict], base: str) -> None:
    """Keep the index's answer for when it does not answer: a temporary file of this process's
    own (several runs at once) renamed into place; a cache that cannot be written only costs that."""
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{saved.name}.", suffix=".tmp", dir=saved.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(files))
            crashpoint("index:written")
            os.replace(tmp, saved)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        say(f"cannot save the answer of the package index {redact.url(base)} in {saved} ({e.strerror or e}); using it without saving it")


# the index is untrusted input: a file name is a plain name (it becomes a path in the cache), a
# download URL is http(s) or uses the index's own scheme (a local file:// index), nothing else
_SAFE_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def _safe_url(url: str, base: str) -> bool:
    scheme = urllib.parse.urlsplit(url).scheme
    return scheme in ("https", "http", urllib.parse.urlsplit(base).scheme) and not url.startswith("-")


@lru_cache(maxsize=None)
def index_files(name: str) -> tuple[Artifact, ...]:
    """Every sdist and wheel the index lists for name (fetched once per process; the last
    answer is kept in the cache and used, with a warning, when the index does not answer)."""
    base = f"{index_url()}/{name}/"
    saved = cache_dir() / "index" / f"{name}.json"
    try:
        req = urllib.request.Request(base, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            files = _parse_index(name, resp.read(), resp.headers.get("Content-Type", ""), base)
    except _IndexShape as e:
        raise ArtifactError(f"the package index {redact.url(base)} answered, but {e}; check PIP_INDEX_URL / your pip index and re-run") from None
    except (OSError, ValueError) as e:
        if not saved.is_file():
            raise ArtifactError(f"cannot read the package index {redact.url(base)} ({e}); check the network / pip index and re-run") from None
        try:
            files = _saved_shape(json.loads(saved.read_text()))
        except (OSError, ValueError) as bad:
            raise ArtifactError(
                f"the package index {redact.url(base)} does not answer ({e}), and its answer saved in {saved} is damaged ({bad}); "
                "delete that file, restore the network and re-run"
            ) from None
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(saved.stat().st_mtime))
        say(f"the package index {redact.url(base)} does not answer ({e}); using its answer saved in {saved} on {when}: "
            "nothing was verified online (the files and sha256s are the ones that answer listed)")
    else:
        _save_answer(saved, files, base)
    crashpoint("index:read")
    return _artifacts(files, name, base)


def files_at(index: str, name: str) -> tuple[Artifact, ...]:
    """Every sdist and wheel another index (not pip's) lists for name, read now (PEP 691 JSON or
    PEP 503 HTML), with the same checks as index_files; () when it has no page for name."""
    base = f"{index.rstrip('/')}/{re.sub(r'[-_.]+', '-', name).lower()}/"
    try:
        req = urllib.request.Request(base, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return _artifacts(_parse_index(name, resp.read(), resp.headers.get("Content-Type", ""), base), name, base)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return ()
        raise ArtifactError(f"cannot read the package index {redact.url(base)} ({e}); check the network and re-run") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"cannot read the package index {redact.url(base)} ({e}); check the network and re-run") from None


def _artifacts(files: list[dict], name: str, base: str) -> tuple[Artifact, ...]:
    out = []
    norm = re.sub(r"[-_.]+", "_", name).lower()
    for f in files:
        fn = f["filename"]
        if not _SAFE_FILENAME.match(fn) or not _safe_url(f.get("url", ""), base):
            say(f"the package index {redact.url(base)} lists {fn!r} at {f.get('url', '')!r}: not a plain file name or URL; ignored")
            continue
        if fn.endswith(".whl"):
            parts = fn[:-4].split("-")
            kind, version = "wheel", parts[1] if len(parts) >= 5 else ""
        elif fn.endswith(".tar.gz"):
            stem = fn[: -len(".tar.gz")]
            kind, version = "sdist", stem.rsplit("-", 1)[-1] if "-" in stem else ""
        else:
            continue
        if re.sub(r"[-_.]+", "_", fn.split("-", 1)[0]).lower() != norm or not version:
            continue
        out.append(Artifact(fn, version, kind, f.get("sha256", ""), f.get("url", "")))
    return tuple(out)


def releases(name: str, after: str | None = None, upto: str | None = None, first: str | None = None) -> list[str]:
    """Final releases (no pre/dev) the index offers, ascending; after < v <= upto, or first <= v."""
    from packaging.version import InvalidVersion, Version

    vs = set()
    for a in index_files(name):
        try:
            v = Version(a.version)
        except InvalidVersion:
            continue
        if not v.is_prerelease and not v.is_devrelease:
            vs.add(a.version)
    out = sorted(vs, key=Version)
    if after:
        out = [v for v in out if Version(v) > Version(after)]
    if first:
        out = [v for v in out if Version(v) >= Version(first)]
    if upto:
        out = [v for v in out if Version(v) <= Version(upto)]
    return out


def _wheel_rank(fn: str) -> int | None:
    tags = fn[:-4].split("-")[-3:]
    py, abi, plat = tags
    if plat == "any" and abi == "none" and py.startswith("py3"):
        return 0
    want = "cp" + WHEEL_PY.replace(".", "")
    if "x86_64" in plat and "manylinux" in plat and want in py.split("."):
        return 1
    return None


def choose(name: str, version: str, kind: str) -> Artifact | None:
    """The artifact of that kind for version: the sdist; the py3-none-any wheel, else the
    CPython {WHEEL_PY} manylinux x86_64 one (the .py files are the same in every wheel)."""
    cands = [a for a in index_files(name) if a.version == version and a.kind == kind]
    if kind == "wheel":
        ranked = sorted((r, a.filename, a) for a in cands if (r := _wheel_rank(a.filename)) is not None)
        return ranked[0][2] if ranked else None
    return cands[0] if cands else None


def wheel_for(name: str, version: str, cp: str, platform: str = WHEEL_PLATFORM) -> Artifact | None:
    """The index's CPython-cp (e.g. cp312) wheel of version for platform, with its sha256; None when
    the index offers none."""
    return next((a for a in index_files(name) if a.version == version and a.kind == "wheel"
                 and a.filename[:-4].split("-")[-3:] == [cp, cp, platform] and re.fullmatch(r"[0-9a-f]{64}", a.sha256)), None)


def kinds_offered(name: str, version: str) -> list[str]:
    return [k for k in ("sdist", "wheel") if choose(name, version, k) is not None]


def no_release(name: str, version: str, what: str, each_side: int = 2) -> SglpatchError:
    """what, and when version is not a release the index knows, the releases nearest to it (a
    usage error: the version asked for is wrong)."""
    from packaging.version import InvalidVersion, Version

    try:
        known, v = releases(name), Version(version)
    except (InvalidVersion, SglpatchError):
        return SglpatchError(what)
    if version in known:
        return SglpatchError(what)
    below = [r for r in known if Version(r) < v][-each_side:]
    above = [r for r in known if Version(r) > v][:each_side]
    if not (below or above):
        return SglpatchError(what, exitcodes.USAGE)
    newest = f" ({below[-1]} is the newest)" if not above else ""
    return SglpatchError(f"{name} {version} is not a release on the index; the nearest: {', '.join(below + above)}{newest}", exitcodes.USAGE)
