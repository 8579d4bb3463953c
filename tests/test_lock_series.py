"""upstream.lock and series parsing: every field checked, comments and order preserved."""

from __future__ import annotations

import pytest

from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import validate_ref, validate_url
from sglpatch.upstream.pin import Lock, read_lock
from sglpatch.series import Series, parse_patch, read_patch, read_series

LOCK_TEXT = (
    '[upstream]\nname = "sglang"\nurl = "https://github.com/sgl-project/sglang"\ntag = "v0.5.9"\n'
    'commit = "bbe9c7eeb"\nversion = "0.5.9"\n\n[sdist]\nfilename = "sglang-0.5.9.tar.gz"\n'
    'sha256 = "11b1445bfb039c20217783850fda66a71b814391b2cf313f4e6cadc3b9fea41b"\nsubdir = "python"\n\n[blobs]\n'
)


def test_committed_lock_pins_059(project_root):
    lock = read_lock(project_root)
    assert (lock.version, lock.tag) == ("0.5.9", "v0.5.9")
    assert lock.commit.startswith("bbe9c7eeb")
    assert lock.sdist_sha256 == "11b1445bfb039c20217783850fda66a71b814391b2cf313f4e6cadc3b9fea41b"
    assert lock.blobs, "the lock records the blob id of every upstream file the series touches"
    # round trip is byte-stable
    assert Lock.parse(lock.dumps()).dumps() == lock.dumps()
    assert (project_root / "upstream.lock").read_text() == lock.dumps()


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda t: t.replace('sha256 = "11b1', 'sha256 = "21b1'), None),  # still valid hex: accepted by parse
        (lambda t: t.replace('sha256 = "11b1445bfb039c20217783850fda66a71b814391b2cf313f4e6cadc3b9fea41b"', 'sha256 = "xyz"'), "sdist.sha256"),
        (lambda t: t.replace('commit = "bbe9c7eeb"', 'commit = "--upload-pack=evil"'), "upstream.commit"),
        (lambda t: t.replace("https://github.com/sgl-project/sglang", "ext::sh -c touch% /tmp/pwned"), "upstream.url"),
        (lambda t: t.replace("https://github.com/sgl-project/sglang", "--upload-pack=touch /tmp/x"), "upstream.url"),
        (lambda t: t.replace('tag = "v0.5.9"', 'tag = "-v0.5.9"'), "upstream.tag"),
        (lambda t: t.replace('version = "0.5.9"\n', 'version = "0.5.9"\nextra = "1"\n'), "upstream.extra"),
        (lambda t: t.replace('subdir = "python"\n', ""), "sdist.subdir"),
        (lambda t: t.replace('subdir = "python"', 'subdir = "../python"'), "sdist.subdir"),
        (lambda t: t + '"../etc/passwd" = "' + "0" * 40 + '"\n', "blobs"),
        (lambda t: t + '"python/x.py" = "abc"\n', "blobs"),
        (lambda t: t.replace("[sdist]", "[sdistx]"), "sdistx"),
    ],
)
def test_lock_fields_validated(mutate, field):
    text = mutate(LOCK_TEXT)
    if field is None:
        Lock.parse(text)
        return
    with pytest.raises(SglpatchError) as e:
        Lock.parse(text)
    msg = str(e.value)
    assert "\n" not in msg and field in msg


@pytest.mark.parametrize("url", ["ext::sh -c id", "--upload-pack=x", "http://insecure/x", "fd::3", "https://a b", "git://host/x"])
def test_bad_urls_refused(url):
    with pytest.raises(SglpatchError):
        validate_url(url)


@pytest.mark.parametrize("url", ["https://github.com/sgl-project/sglang", "ssh://git@github.com/x/y", "git@github.com:x/y.git", "file:///srv/mirror/sglang"])
def test_good_urls(url):
    assert validate_url(url) == url


@pytest.mark.parametrize("ref", ["-v1", "--output=x", "a..b", "v1@{0}", "", "x y", "refs/heads/x.lock"])
def test_bad_refs_refused(ref):
    with pytest.raises(SglpatchError):
        validate_ref(ref)


def test_series_roundtrip_keeps_comments_and_order():
    text = "# header\n\n0002-b.patch\n# about a\n0001-a.patch -p0\n\n# trailing\n"
    s = Series.parse(text)
    assert s.names == ["0002-b.patch", "0001-a.patch"]
    assert s.entries[1].strip == 0
    assert s.dumps() == text


@pytest.mark.parametrize(
    "text, needle",
    [
        ("a.patch -p2\n", "unknown option"),
        ("a.patch --reverse\n", "unknown option"),
        ("a.patch\na.patch\n", "listed twice"),
        ("../a.patch\n", ".."),
        ("/etc/a.patch\n", "absolute"),
        ("-rf.patch\n", "option"),
        ("a.patch\r\n", "CRLF"),
    ],
)
def test_series_malformed(text, needle):
    with pytest.raises(SglpatchError) as e:
        Series.parse(text)
    assert needle in str(e.value)


def test_committed_patches_have_dep3_headers(project_root):
    series = read_series(project_root)
    assert len(series.entries) >= 1
    for entry in series.entries:
        patch = read_patch(project_root, entry)
        for field in ("Description", "Origin", "Forwarded", "Last-Update"):
            assert patch.dep3.get(field), f"{entry.name} lacks {field}"
        assert patch.subject and not patch.subject.startswith("[PATCH")
        assert all(f.startswith("python/") for f in patch.files)
        assert len(patch.files) == len(set(patch.files)), patch.files  # a modified file once, not as old and new side


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"", "empty"),
        (b"Subject: [PATCH] x\n\nDescription: y\n---\n", "no diff"),
        (b"Subject: x\n\n---\ndiff --git a/../x b/../x\n--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-a\n+b\n", ".."),
        (b"Subject: x\n\n---\ndiff --git a//etc/x b//etc/x\n--- a//etc/x\n+++ b//etc/x\n@@ -1 +1 @@\n-a\n+b\n", "path"),
        (b"Subject: x\r\n\r\n---\r\ndiff --git a/x b/x\r\n", "CRLF"),
        (b"Subject: \xff\xfe\n\n---\ndiff --git a/x b/x\n", "UTF-8"),
    ],
)
def test_patch_file_malformed(data, needle):
    with pytest.raises(SglpatchError) as e:
        parse_patch("bad.patch", data)
    assert needle in str(e.value)
