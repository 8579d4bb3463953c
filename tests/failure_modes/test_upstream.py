"""The upstream pin and getting its sdist: upstream.lock (hash, blobs, fields, hostile URLs and tags),
a hostile sdist, a download cut or tampered with, pip failing, a release artifact that lies.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import http.server
import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from conftest import ROOT, git
from sglpatch import exitcodes
from sglpatch.upstream.pin import read_lock, sha256_file
from failure_modes.world import Case, listing, ok, refused, refused_apply


def _lock_text(c: Case, old: str, new: str) -> None:
    path = c.project / "upstream.lock"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


@pytest.mark.inproc
def test_lock_wrong_sha256(case):
    """A wrong (well-formed) sha256: the good cached sdist is kept, the error names the field."""
    lock = read_lock(case.project)
    _lock_text(case, lock.sdist_sha256, "0" * 64)
    case.runs_pip = True
    dead = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
            "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "0", "PIP_NO_CACHE_DIR": "1"}
    refused_apply(case, "sdist.sha256", "upstream.lock", "fix sdist.sha256", env=dead)


@pytest.mark.inproc
def test_lock_wrong_blob_id(case):
    lock = read_lock(case.project)
    path = sorted(lock.blobs)[0]
    _lock_text(case, lock.blobs[path], "1" * 40)
    refused_apply(case, f"blobs.{path!r}")


@pytest.mark.inproc
def test_lock_unknown_field(case):
    _lock_text(case, 'version = "0.5.9"\n', 'version = "0.5.9"\nmirror = "https://example.com"\n')
    refused_apply(case, "unknown field upstream.mirror")


@pytest.mark.inproc
def test_lock_missing_field(case):
    _lock_text(case, 'filename = "sglang-0.5.9.tar.gz"\n', "")
    refused_apply(case, "missing field sdist.filename")


@pytest.mark.inproc
def test_lock_not_toml(case):
    _lock_text(case, "[sdist]", "[sdist")
    refused_apply(case, "not valid TOML")


@pytest.mark.inproc
def test_lock_commit_disagrees_with_sdist(case):
    _lock_text(case, 'commit = "bbe9c7eeb"', 'commit = "abcdef123"')
    refused_apply(case, "upstream.commit", "_version.py")


@pytest.mark.inproc
@pytest.mark.parametrize(
    "url, needle",
    [
        ("ext::sh -c touch% {sentinel}/ext", "upstream.url"),
        ("ext::sh", "transport helpers"),
        ("--upload-pack=touch {sentinel}/up", "upstream.url"),
        ("ssh://-oProxyCommand=touch%20{sentinel}/ssh/x", "must not start with '-'"),
        ("git@-oProxyCommand=x:y", "upstream.url"),
        ("fd::3", "transport helpers"),
        ("http://127.0.0.1:9/sglang", "only https"),
    ],
    ids=["ext-space", "ext", "upload-pack", "ssh-proxycommand", "scp-dash-host", "fd", "http"],
)
def test_lock_hostile_url(case, url, needle):
    lock_path = case.project / "upstream.lock"
    text = lock_path.read_text().replace("https://github.com/sgl-project/sglang", url.format(sentinel=case.sentinel), 1)
    lock_path.write_text(text)
    before = case.state()
    refused(case.apply("--source", "git"), needle)
    refused(case.apply("--source", "auto", "--probe-timeout", "2"), needle)
    assert case.state() == before
    case.outside_clean()
    case.restore("upstream.lock")
    ok(case.apply())


@pytest.mark.inproc
@pytest.mark.parametrize(
    "url", ["ext::sh -c touch% /tmp/sglpatch-pwned", "--upload-pack=touch /tmp/x", "ssh://-oProxyCommand=x/y"],
    ids=["ext", "upload-pack", "ssh-proxycommand"],
)
def test_cli_hostile_upstream_url(case, url):
    before = case.state()
    refused(case.apply("--source", "git", f"--upstream-url={url}"), "invalid upstream url")
    assert case.state() == before and not Path("/tmp/sglpatch-pwned").exists()
    case.outside_clean()
    ok(case.apply())


@pytest.mark.inproc
@pytest.mark.parametrize("tag", ["-v0.5.9", "--output=/tmp/x", "v0.5.9..HEAD"])
def test_lock_tag_option_looking(case, tag):
    _lock_text(case, 'tag = "v0.5.9"', f'tag = "{tag}"')
    before = case.state()
    refused(case.apply("--source", "git"), "upstream.tag")
    assert case.state() == before
    case.restore("upstream.lock")
    ok(case.apply())
    case.outside_clean()


def _evil_tarball(dest: Path, member: str, link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("sglang-0.5.9/sglang/__init__.py")
        info.size = 0
        tf.addfile(info, io.BytesIO(b""))
        info = tarfile.TarInfo(member)
        if link:
            info.type, info.linkname = tarfile.SYMTYPE, link
            tf.addfile(info)
        else:
            info.size = 4
            tf.addfile(info, io.BytesIO(b"pwnd"))
    return buf.getvalue()


@pytest.mark.inproc
@pytest.mark.parametrize("kind", ["dotdot", "symlink"])
def test_hostile_sdist_with_matching_sha(fresh, kind):
    """Even a tarball the lock vouches for cannot write outside the tree."""
    c = fresh
    cache = c.tmp / "t" / "cache"
    (cache / "sdist").mkdir(parents=True)
    if kind == "dotdot":
        data = _evil_tarball(cache, "sglang-0.5.9/../../sentinel/pwned")
    else:
        data = _evil_tarball(cache, "sglang-0.5.9/sglang/evil", link=str(c.sentinel))
    (cache / "sdist" / "sglang-0.5.9.tar.gz").write_bytes(data)
    import hashlib

    _lock_text(c, read_lock(c.project).sdist_sha256, hashlib.sha256(data).hexdigest())
    refused(c.apply(env={"SGLPATCH_CACHE": str(cache)}), "sglang-0.5.9.tar.gz", "refusing" if kind == "symlink" else "leaves the tree")
    assert list(c.sentinel.iterdir()) == []
    shutil.rmtree(cache)
    c.restore("upstream.lock")
    ok(c.apply())
    c.outside_clean()


# --------------------------------------------------------------------------------------
# network and pip


def _tampered_sdist(data: bytes) -> bytes:
    """The real sdist plus one extra file: a valid archive pip accepts, with another sha256."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as src, tarfile.open(fileobj=out, mode="w:gz") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        info = tarfile.TarInfo("sglang-0.5.9/sglang/injected.py")
        payload = b"import os  # not upstream\n"
        info.size = len(payload)
        dst.addfile(info, io.BytesIO(payload))
    return out.getvalue()


class _Index:
    """A PEP 503 index on 127.0.0.1 serving the sdist whole, cut in the middle, or tampered."""

    def __init__(self, data: bytes):
        self.data, self.mode = data, "cut"
        self.tampered = _tampered_sdist(data)
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.rstrip("/") == "/simple/sglang":
                    body = b'<html><body><a href="/files/sglang-0.5.9.tar.gz">sglang-0.5.9.tar.gz</a></body></html>'
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/files/sglang-0.5.9.tar.gz":
                    data = outer.tampered if outer.mode == "tampered" else outer.data
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if outer.mode == "cut":
                        self.wfile.write(data[: len(data) // 3])
                        self.wfile.flush()
                        self.connection.shutdown(2)
                    else:
                        self.wfile.write(data)
                else:
                    self.send_response(404)
                    self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _pip_env(index_url: str, cache: Path) -> dict:
    # the user's pip configuration with this index; no build isolation (offline build deps)
    return {
        "PIP_INDEX_URL": index_url,
        "PIP_RETRIES": "0",
        "PIP_DEFAULT_TIMEOUT": "10",
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_NO_CACHE_DIR": "1",
        "SGLPATCH_CACHE": str(cache),
    }


@pytest.mark.parametrize("mode", ["cut", "tampered"])
def test_interrupted_or_tampered_sdist_download(fresh, sdist_059, mode):
    c = fresh
    c.runs_pip = True
    cache = c.tmp / "cache"
    c.allowed.add("cache")
    index = _Index(sdist_059.read_bytes())
    index.mode = mode
    try:
        env = _pip_env(index.url, cache)
        proc = c.apply(env=env)
        refused(proc, *(("pip download", "re-run") if mode == "cut" else ("sdist.sha256",)))
        assert listing(cache / "sdist") == {}, "a partial or unverified sdist was kept"
        c.outside_clean()
        index.mode = "full"
        done = ok(c.apply(env=env))
        assert "  pip: Collecting sglang==0.5.9" in done.stderr  # the download shows progress
        assert sha256_file(cache / "sdist" / "sglang-0.5.9.tar.gz") == read_lock(c.project).sdist_sha256
        c.in_sync()
    finally:
        index.close()
    c.outside_clean()


def test_pip_failing_during_install(case):
    """Real pip with no reachable index cannot get build dependencies: the tree is kept, re-run installs."""
    from conftest import make_venv

    env_dir = case.tmp / "t" / "venv"
    py = make_venv(env_dir)
    args = ("apply", "--project", str(case.project), "--workdir", str(case.fork), "--source", "sdist", "--python", str(py), "--installer", "pip")
    with open(case.project / "series", "a") as s:
        s.write("# rebuild\n")
    bad = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
           "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "0", "PIP_NO_CACHE_DIR": "1"}
    before_notes = case.state()["notes"]
    proc = case.run(*args, env=bad)
    refused(proc, "installing", "failed", "fix the environment and re-run")
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    assert case.state()["notes"] == before_notes
    case.in_sync()
    proc = ok(case.run(*args, env={"PIP_NO_BUILD_ISOLATION": "0"}))
    assert f"imports sglang 0.5.9 from {case.fork.resolve()}/python/sglang/__init__.py" in proc.stdout
    assert git(case.fork, "status", "--porcelain", "--untracked-files=no") == ""
    shutil.rmtree(env_dir)
    case.runs_pip = True
    case.outside_clean()


def _sdist(path: Path, pkg_info: bytes) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        member = tarfile.TarInfo("sglang-0.5.9/PKG-INFO")
        member.size = len(pkg_info)
        tf.addfile(member, io.BytesIO(pkg_info))
    return path


def test_a_release_artifact_whose_pkg_info_is_not_utf8_is_one_line(project_copy, tmp_path):
    art = _sdist(tmp_path / "sglang-0.5.9.tar.gz", b"Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.9\nSummary: caf\xe9\n")
    r = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project_copy), "--workdir", str(tmp_path / "fork"),
                        "--venv", str(tmp_path / "new"), "--dry-run", "--release-artifact", str(art), "--python", sys.executable],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120, cwd=tmp_path)
    assert r.returncode == exitcodes.ERROR and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"sglpatch: error: {art}: its PKG-INFO is not UTF-8 text (invalid continuation byte at byte 62): "
        "pass the release's own sdist or wheel (--release-artifact)"]
