"""Registry artifacts of a release (sdist or wheel): which files the index lists, their
published sha256, a verified download into the cache, unpacking, and their metadata. This is
the one module that downloads release files (``git fetch`` of a tag is ``upstream``'s).

Every artifact, also one found in the cache, is checked against a sha256 before it is used:
``fetch`` against the one the package index publishes for it (PEP 691 JSON, or the
``#sha256=`` fragment of the HTML simple page) of the index pip is configured with
(``PIP_INDEX_URL`` / ``pip config get global.index-url``, else PyPI); ``fetch_sdist`` against
the one upstream.lock pins. A mismatch is a one-line error naming the file, and nothing is written.
"""

from __future__ import annotations

import email.parser
import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path

from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint
from sglpatch.gitcmd import last_line
from sglpatch.lock import Lock, LockError, sha256_file

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


@lru_cache(maxsize=None)
def index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True, timeout=30
            )
            url = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
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
        say(f"cannot save the answer of the package index {base} in {saved} ({e.strerror or e}); using it without saving it")


def cache_dir() -> Path:
    """Where downloaded release files, index answers and unpacked trees are kept."""
    base = os.environ.get("SGLPATCH_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "sglpatch" if xdg else Path.home() / ".cache" / "sglpatch"


def cache_subdir(name: str) -> Path:
    """cache_dir()/name, made when missing; a cache that cannot be made is one line naming the fix."""
    d = cache_dir() / name
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SglpatchError(
            f"cannot create the cache folder {d} ({e.strerror}); set SGLPATCH_CACHE to a folder you can write "
            "(it holds downloaded release files and their unpacked trees)"
        ) from None
    return d


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
        raise ArtifactError(f"the package index {base} answered, but {e}; check PIP_INDEX_URL / your pip index and re-run") from None
    except (OSError, ValueError) as e:
        if not saved.is_file():
            raise ArtifactError(f"cannot read the package index {base} ({e}); check the network / pip index and re-run") from None
        try:
            files = _saved_shape(json.loads(saved.read_text()))
        except (OSError, ValueError) as bad:
            raise ArtifactError(
                f"the package index {base} does not answer ({e}), and its answer saved in {saved} is damaged ({bad}); "
                "delete that file, restore the network and re-run"
            ) from None
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(saved.stat().st_mtime))
        say(f"the package index {base} does not answer ({e}); using its answer saved in {saved} on {when}: "
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
        raise ArtifactError(f"cannot read the package index {base} ({e}); check the network and re-run") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"cannot read the package index {base} ({e}); check the network and re-run") from None


def _artifacts(files: list[dict], name: str, base: str) -> tuple[Artifact, ...]:
    out = []
    norm = re.sub(r"[-_.]+", "_", name).lower()
    for f in files:
        fn = f["filename"]
        if not _SAFE_FILENAME.match(fn) or not _safe_url(f.get("url", ""), base):
            say(f"the package index {base} lists {fn!r} at {f.get('url', '')!r}: not a plain file name or URL; ignored")
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


def kinds_offered(name: str, version: str) -> list[str]:
    return [k for k in ("sdist", "wheel") if choose(name, version, k) is not None]


def fetch(name: str, version: str, kind: str, python: str | None = None, expect_sha256: str | None = None) -> tuple[Artifact, Path]:
    """(artifact, path): the index-verified file, from the cache or downloaded with pip."""
    art = choose(name, version, kind)
    if art is None:
        offered = kinds_offered(name, version)
        raise ArtifactError(f"the index offers no {kind} of {name} {version}" + (f" (it has: {', '.join(offered)})" if offered else ""))
    if not re.fullmatch(r"[0-9a-f]{64}", art.sha256):
        raise ArtifactError(f"the index publishes no sha256 for {art.filename}; refusing to use it unverified")
    if expect_sha256 and expect_sha256 != art.sha256:
        raise ArtifactError(f"{art.filename}: the recorded sha256 {expect_sha256} is not the one the index publishes ({art.sha256})")
    cdir = cache_dir() / kind
    target = cdir / art.filename
    if target.exists():
        got = sha256_file(target)
        if got != art.sha256:
            raise ArtifactError(
                f"cached {target} has sha256 {got}, not {art.sha256} as the index publishes for {art.filename}; "
                "delete it and re-run (nothing was written)"
            )
        return art, target
    cache_subdir(kind)
    with tempfile.TemporaryDirectory(prefix="sglpatch-dl-", dir=str(cdir)) as tmp:
        got_path = Path(tmp) / art.filename
        if kind == "wheel":
            _pip_wheel(name, version, art, tmp, python)
        else:
            # not `pip download --no-binary`: for an sdist pip prepares its metadata, which builds
            # the build dependencies (Cython, grpcio-tools) from source for minutes
            _download(art, got_path)
        got = sha256_file(got_path)
        if got != art.sha256:
            raise ArtifactError(f"downloaded {art.filename} has sha256 {got}, not {art.sha256} as the index publishes; nothing was written")
        os.replace(got_path, target)
    return art, target


_PROGRESS_LINES = ("Collecting", "Downloading", "Saved", "File was already downloaded", "Successfully downloaded")


def run_showing_lines(cmd: list[str], prefix: str) -> subprocess.CompletedProcess:
    """Run cmd, echoing each output line to stderr (progress for a long download), keep the text."""
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        for line in proc.stdout:
            lines.append(line)
            if line.strip().startswith(_PROGRESS_LINES):  # the rest only goes into the error line
                print(prefix + line.strip(), file=sys.stderr, flush=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), "")


def _pip_download(python: str | None, dest: str, requirement: str, *flags: str) -> tuple[int, str]:
    """`pip download` of one requirement into dest through the user's pip configuration; (rc, why)
    where why is pip's last output line (or the exit status) for the error line."""
    cmd = [python or sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", dest,
           *flags, requirement]
    proc = run_showing_lines(cmd, prefix="  pip: ")
    return proc.returncode, last_line(proc.stdout, f"exit {proc.returncode}")


def _pip_wheel(name: str, version: str, art: Artifact, tmp: str, python: str | None) -> None:
    say(f"downloading {art.filename} with pip (your pip configuration applies)")
    rc, why = _pip_download(python, tmp, f"{name}=={version}", "--only-binary", ":all:", "--platform", WHEEL_PLATFORM,
                            "--platform", "any", "--python-version", WHEEL_PY, "--implementation", "cp")
    if rc != 0 or not (Path(tmp) / art.filename).is_file():
        raise ArtifactError(f"pip download of {art.filename} failed ({why}); check the network / pip index and re-run")


def fetch_sdist(lock: Lock, python: str | None = None) -> Path:
    """The sdist tarball upstream.lock pins, checked against its sdist.sha256: from the cache, or
    downloaded with pip (the user's pip configuration, no index lookup of our own)."""
    cdir = cache_subdir("sdist")
    target = cdir / lock.sdist_filename
    cached_digest = None
    if target.exists():
        cached_digest = sha256_file(target)
        if cached_digest == lock.sdist_sha256:
            return target
        # Either the cache is damaged or the lock is wrong: download again to tell which, and
        # replace the cached file only by a download that matches the lock.
        say(f"cached {target.name} does not match sdist.sha256 (it has {cached_digest}); downloading again to check")
    say(f"downloading {lock.sdist_filename} with pip (your pip configuration applies)")
    with tempfile.TemporaryDirectory(prefix="sglpatch-dl-", dir=str(cdir)) as tmp:
        rc, why = _pip_download(python, tmp, f"{lock.name}=={lock.version}", "--no-binary", ":all:")
        if rc != 0:
            if cached_digest is not None:
                raise LockError(
                    f"upstream.lock: field sdist.sha256 does not match the cached {target} ({cached_digest}) and a new "
                    f"download failed ({why}); fix sdist.sha256 in upstream.lock, or restore the network and re-run"
                )
            raise SglpatchError(f"pip download of {lock.name}=={lock.version} failed ({why}); check the network / pip index and re-run")
        got = Path(tmp) / lock.sdist_filename
        if not got.exists():
            raise SglpatchError(f"pip download did not produce {lock.sdist_filename}; found {sorted(os.listdir(tmp))}")
        digest = sha256_file(got)
        if lock.sdist_sha256 and digest != lock.sdist_sha256:
            same = " (the same as the cached copy, so upstream.lock is what is wrong)" if digest == cached_digest else ""
            raise LockError(
                f"upstream.lock: field sdist.sha256 does not match the downloaded {lock.sdist_filename} (got {digest}){same}; "
                "check the lock and your pip index, then re-run"
            )
        os.replace(got, target)
    return target


def _download(art: Artifact, dest: Path) -> None:
    say(f"downloading {art.filename} from {urllib.parse.urlsplit(art.url).netloc or 'the index'}")
    try:
        with urllib.request.urlopen(art.url, timeout=120) as resp, open(dest, "wb") as f:
            total, done, shown = int(resp.headers.get("Content-Length") or 0), 0, 0
            while chunk := resp.read(1 << 20):
                f.write(chunk)
                done += len(chunk)
                if total and done * 4 // total > shown:
                    shown = done * 4 // total
                    say(f"  {art.filename}: {done >> 20} of {total >> 20} MiB")
    except OSError as e:
        raise ArtifactError(f"download of {art.filename} failed ({e}); check the network / pip index and re-run") from None


# --------------------------------------------------------------------------------------
# unpacking and metadata


@contextmanager
def readable(path: Path):
    """A vouched-for artifact that is not the archive it claims to be: one line, not a traceback."""
    try:
        yield
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        kind = "wheel (zip file)" if path.name.endswith(".whl") else "sdist (gzip'd tar file)"
        raise ArtifactError(
            f"{path}: not a readable {kind} ({e}), although its sha256 is the one the package index publishes: "
            "the index serves a broken file; nothing was unpacked"
        ) from None


def extract_wheel(path: Path, dest: Path) -> None:
    """The wheel's sglang/ package under dest/sglang (dest is the tree's python/ folder);
    dist-info and anything outside sglang/ are not repository files."""
    with readable(path), zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0] != "sglang" or name.endswith("/"):
                continue
            if name.startswith("/") or ".." in parts or "\\" in name:
                raise ArtifactError(f"{path.name}: member {name!r} leaves the tree")
            mode = (info.external_attr >> 16) & 0o170777
            if mode & 0o170000 == 0o120000:
                raise ArtifactError(f"{path.name}: member {name!r} is a link; refusing")
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
            os.chmod(out, 0o755 if mode & 0o111 else 0o644)


def _version_py_commit(text: str) -> str:
    m = re.search(r"commit_id\s*=\s*['\"]g?([0-9a-f]{7,40})['\"]", text)
    return m.group(1) if m else ""


def recorded_commit(path: Path) -> str:
    """The commit id sglang/_version.py in the artifact records ('' when None)."""
    if path.name.endswith(".whl"):
        with readable(path), zipfile.ZipFile(path) as zf:
            try:
                return _version_py_commit(zf.read("sglang/_version.py").decode("utf-8", "replace"))
            except KeyError:
                return ""
    with readable(path), tarfile.open(path, "r:gz") as tf:
        for m in tf.getmembers():
            if m.name.split("/")[1:] == ["sglang", "_version.py"] and m.isfile():
                return _version_py_commit(tf.extractfile(m).read().decode("utf-8", "replace"))
    return ""


def metadata(path: Path) -> email.message.Message:
    """The core metadata (wheel METADATA / sdist PKG-INFO)."""
    text = ""
    if path.name.endswith(".whl"):
        with readable(path), zipfile.ZipFile(path) as zf:
            name = next((n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
            text = zf.read(name).decode("utf-8", "replace") if name else ""
    else:
        with readable(path), tarfile.open(path, "r:gz") as tf:
            for m in tf.getmembers():
                if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO") and m.isfile():
                    text = tf.extractfile(m).read().decode("utf-8", "replace")
                    break
    return email.parser.Parser().parsestr(text)


def zip_has(path: Path, member: str) -> bool:
    with readable(path), zipfile.ZipFile(path) as zf:
        return member in zf.namelist()


def zip_read(path: Path, member: str) -> str | None:
    with readable(path), zipfile.ZipFile(path) as zf:
        try:
            return zf.read(member).decode("utf-8", "replace")
        except KeyError:
            return None
