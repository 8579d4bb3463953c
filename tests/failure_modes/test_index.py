"""The package index and the artifacts it vouches for: answers of the wrong shape, a wheel that is not a
zip, two watch runs at once, a read-only cache, an unreachable index.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from failure_modes.world import ok, refused
from failure_modes.faults import Barrier, KILLED, ReadOnly, T, closed_port_url, index_listing, popen, private_cache, saved_answer


BAD_INDEX = {
    "files-not-a-list": {"meta": {}, "files": 3},
    "entry-not-an-object": {"files": [3]},
    "filename-not-a-string": {"files": [{"filename": 3, "url": "/x", "hashes": {}}]},
    "not-an-object": [1, 2],
    "saved-answer-of-the-wrong-shape": None,
}


@pytest.mark.parametrize("kind", list(BAD_INDEX))
def test_index_answer_of_the_wrong_shape(case, index, kind):
    c = case
    cache = private_cache(c)
    if BAD_INDEX[kind] is None:  # the index does not answer; the answer saved last time is damaged
        (cache / "index").mkdir()
        (cache / "index" / "sglang.json").write_text(json.dumps({"files": "x"}))
        url = closed_port_url()
    else:
        url = index(BAD_INDEX[kind]).url
    w = c.run("watch", "--project", str(c.project), "--releases", T, env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": url})
    refused(w, "index")
    c.outside_clean()


def test_vouched_wheel_that_is_not_a_zip(case, index):
    """The index publishes the sha256 of a "wheel" that is not a zip file (and that is what the
    cache holds): one line naming the file."""
    c = case
    cache = private_cache(c)
    junk = b"this is not a zip file\n" * 100
    fn = "sglang-0.5.99-py3-none-any.whl"
    (cache / "wheel").mkdir()
    (cache / "wheel" / fn).write_bytes(junk)
    srv = index({"files": index_listing([{"filename": fn, "url": f"/files/{fn}", "hashes": {"sha256": hashlib.sha256(junk).hexdigest()}}])})
    w = c.run("watch", "--project", str(c.project), "--releases", "0.5.99", env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": srv.url})
    refused(w, fn, "zip")
    c.outside_clean()


def test_concurrent_watch_runs_do_not_share_the_index_temp_file(case, index):
    """Two watches save the index answer at once (one paused between writing its temporary file
    and renaming it): neither loses the fresh answer nor says the index does not answer."""
    c = case
    cache = private_cache(c)
    srv = index({"files": index_listing()})
    env = {"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": srv.url, "SGLPATCH_CRASH_AT": "index:read"}
    cmd = ("watch", "--project", str(c.project), "--releases", T)
    bar = Barrier(c)
    first = popen(c, *cmd, env=dict(env, **bar.env("index:written")))
    bar.reached(first)
    second = c.run(*cmd, env=env)
    bar.go()
    out, err = first.communicate(timeout=120)
    assert first.returncode == KILLED and second.returncode == KILLED, err + second.stderr  # both read the index
    for text in (err, second.stderr):  # not even a failed save: each saves through its own temporary file
        assert "does not answer" not in text and "cannot save" not in text and "Traceback" not in text, text
    assert [p.name for p in (cache / "index").iterdir()] == ["sglang.json"]
    assert len(json.loads((cache / "index" / "sglang.json").read_text())) == 2
    c.outside_clean()


def test_read_only_cache_keeps_the_fresh_index_answer(case, index):
    c = case
    ro = ReadOnly(c.tmp / "cache")
    try:
        cache = private_cache(c)
        subprocess.run(["git", "init", "-q", "--bare", str(cache / "trees.git")], check=True)
        (cache / "index").mkdir()
        (cache / "index" / "sglang.json").write_text(saved_answer(index_listing()[:1]))  # an old answer
        ro.ro()
        srv = index({"files": index_listing()})
        w = c.run("watch", "--project", str(c.project), "--releases", T,
                  env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": srv.url, "SGLPATCH_CRASH_AT": "index:read"})
        assert w.returncode == KILLED, w.stdout + w.stderr  # got as far as reading the index
        assert "does not answer" not in w.stderr, w.stderr
        assert "cannot save" in w.stderr and "Read-only file system" in w.stderr, w.stderr
    finally:
        ro.close()
    c.outside_clean()


def test_unreachable_index_says_nothing_was_verified_online(case):
    """The index does not answer: the answer saved last time (and the sdists it vouched for) are
    used, and stderr says plainly that nothing was verified online."""
    c = case
    cache = private_cache(c)
    (cache / "index").mkdir()
    (cache / "index" / "sglang.json").write_text(saved_answer(index_listing()))
    w = ok(c.run("watch", "--project", str(c.project), "--releases", T, env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": closed_port_url()}))
    lines = [line for line in w.stderr.splitlines() if "nothing was verified online" in line]
    assert len(lines) == 1 and "sglang.json" in lines[0], w.stderr
    c.outside_clean()
