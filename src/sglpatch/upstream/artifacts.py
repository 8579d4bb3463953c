"""Registry artifacts of a release (sdist or wheel): a verified download into the cache,
unpacking, and their metadata. This is the one module that downloads release files (``git
fetch`` of a tag is ``upstream``'s; which files a release has is ``sglpatch.upstream.pkgindex``'s).

Every artifact, also one found in the cache, is checked against a sha256 before it is used:
``fetch`` against the one the package index publishes for it (``pkgindex``: PEP 691 JSON, or the
``#sha256=`` fragment of the HTML simple page, of the index pip is configured with); ``fetch_sdist``
against the one upstream.lock pins. A mismatch is a one-line error naming the file, and nothing
is written.
"""

from __future__ import annotations

import email.parser
import gzip
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path

from sglpatch.upstream import pkgindex
from sglpatch.upstream.cachedir import cache_dir, cache_subdir
from sglpatch.errors import SglpatchError, say
from sglpatch.gitcmd import last_line
from sglpatch.upstream.pin import Lock, LockError, sha256_file
from sglpatch.upstream.pkgindex import WHEEL_PLATFORM, WHEEL_PY, Artifact, ArtifactError


def fetch(name: str, version: str, kind: str, python: str | None = None, expect_sha256: str | None = None) -> tuple[Artifact, Path]:
    """(artifact, path): the index-verified file, from the cache or downloaded with pip."""
    art = pkgindex.choose(name, version, kind)
    if art is None:
        offered = pkgindex.kinds_offered(name, version)
        raise ArtifactError(f"the index offers no {kind} of {name} {version}" + (f" (it has: {', '.join(offered)})" if offered else ""))
    if not re.fullmatch(r"[0-9a-f]{64}", art.sha256):
        raise ArtifactError(f"the index publishes no sha256 for {art.filename}; refusing to use it unverified")
    if expect_sha256 and expect_sha256 != art.sha256:
        raise ArtifactError(f"{art.filename}: the recorded sha256 {expect_sha256} is not the one the index publishes ({art.sha256})")
    return art, fetch_verified(name, version, art, python)


def fetch_verified(name: str, version: str, art: Artifact, python: str | None = None, py_version: str = WHEEL_PY) -> Path:
    """art (an index entry with its sha256) from the cache or downloaded with pip (a wheel for CPython
    py_version), checked against the index's sha256 either way."""
    kind = art.kind
    if not re.fullmatch(r"[0-9a-f]{64}", art.sha256):
        raise ArtifactError(f"the index publishes no sha256 for {art.filename}; refusing to use it unverified")
    cdir = cache_dir() / kind
    target = cdir / art.filename
    if target.exists():
        got = sha256_file(target)
        if got != art.sha256:
            raise ArtifactError(
                f"cached {target} has sha256 {got}, not {art.sha256} as the index publishes for {art.filename}; "
                "delete it and re-run (nothing was written)"
            )
        return target
    cache_subdir(kind)
    with tempfile.TemporaryDirectory(prefix="sglpatch-dl-", dir=str(cdir)) as tmp:
        got_path = Path(tmp) / art.filename
        if kind == "wheel":
            _pip_wheel(name, version, art, tmp, python, py_version)
        else:
            # not `pip download --no-binary`: for an sdist pip prepares its metadata, which builds
            # the build dependencies (Cython, grpcio-tools) from source for minutes
            _download(art, got_path)
        got = sha256_file(got_path)
        if got != art.sha256:
            raise ArtifactError(f"downloaded {art.filename} has sha256 {got}, not {art.sha256} as the index publishes; nothing was written")
        os.replace(got_path, target)
    return target


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


def _pip_wheel(name: str, version: str, art: Artifact, tmp: str, python: str | None, py_version: str = WHEEL_PY) -> None:
    say(f"downloading {art.filename} with pip (your pip configuration applies)")
    rc, why = _pip_download(python, tmp, f"{name}=={version}", "--only-binary", ":all:", "--platform", WHEEL_PLATFORM,
                            "--platform", "any", "--python-version", py_version, "--implementation", "cp")
    if rc != 0 or not (Path(tmp) / art.filename).is_file():
        raise ArtifactError(f"pip download of {art.filename} failed ({why}); check the network / pip index and re-run")


def cached(lock: Lock) -> Path | None:
    """The registry artifact lock pins (sdist or wheel) when the cache holds it with the lock's sha256,
    else None; nothing is fetched (for a command that only reads, e.g. `sglpatch lines`)."""
    path = cache_dir() / lock.artifact_kind / lock.sdist_filename
    return path if path.is_file() and sha256_file(path) == lock.sdist_sha256 else None


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


def wheel_members(zf: zipfile.ZipFile, path: Path):
    """(member, executable) of the wheel's sglang/ files, the repository files: dist-info and
    anything outside sglang/ are not. Refuses a member that leaves the tree or is a link."""
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
        yield info, bool(mode & 0o111)


def extract_wheel(path: Path, dest: Path) -> None:
    """The wheel's sglang/ package under dest/sglang (dest is the tree's python/ folder)."""
    with readable(path), zipfile.ZipFile(path) as zf:
        for info, executable in wheel_members(zf, path):
            out = dest / info.filename
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
            os.chmod(out, 0o755 if executable else 0o644)


def version_py_commit(text: str) -> str:
    m = re.search(r"commit_id\s*=\s*['\"]g?([0-9a-f]{7,40})['\"]", text)
    return m.group(1) if m else ""


def recorded_commit(path: Path) -> str:
    """The commit id sglang/_version.py in the artifact records ('' when None)."""
    if path.name.endswith(".whl"):
        with readable(path), zipfile.ZipFile(path) as zf:
            try:
                return version_py_commit(zf.read("sglang/_version.py").decode("utf-8", "replace"))
            except KeyError:
                return ""
    with readable(path), tarfile.open(path, "r:gz") as tf:
        for m in tf:  # read as far as the file (near the start of SGLang's sdists), not the whole archive
            if m.name.split("/")[1:] == ["sglang", "_version.py"] and m.isfile():
                return version_py_commit(tf.extractfile(m).read().decode("utf-8", "replace"))
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
            for m in tf:  # PKG-INFO comes first in an sdist: no need to read the rest
                if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO") and m.isfile():
                    text = tf.extractfile(m).read().decode("utf-8", "replace")
                    break
    return email.parser.Parser().parsestr(text)


def metadata_bytes(path: Path) -> bytes:
    """A wheel's METADATA file, byte for byte (b"" when it has none)."""
    with readable(path), zipfile.ZipFile(path) as zf:
        name = next((n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
        return zf.read(name) if name else b""


def zip_has(path: Path, member: str) -> bool:
    with readable(path), zipfile.ZipFile(path) as zf:
        return member in zf.namelist()


def zip_read(path: Path, member: str) -> str | None:
    with readable(path), zipfile.ZipFile(path) as zf:
        try:
            return zf.read(member).decode("utf-8", "replace")
        except KeyError:
            return None
