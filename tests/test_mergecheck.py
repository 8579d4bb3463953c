"""Merged is not working: planted upstream changes on the real 0.5.10.post1 tree, real git.

The new upstream is the real tree plus a planted change (a rename of an attribute the patch
reads; a definition of the name the patch adds) and a few lines at the top of the file so the
patch needs a 3-way merge. The merge is clean; the check must call it broken.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ROOT
from sglpatch.upstream import artifacts, treecache
from sglpatch.rebase import outcome, classify
from sglpatch.stack import export
from sglpatch.gitcmd import Git
from sglpatch.upstream.pin import read_lock

CAR = "python/sglang/srt/distributed/device_communicators/custom_all_reduce.py"


@pytest.fixture(scope="session")
def base_0510(tmp_path_factory):
    cg = treecache.cache_repo()
    art, path = artifacts.fetch("sglang", "0.5.10.post1", "sdist")
    base = treecache.tree_commit(cg, "sdist", path, art.sha256)
    repo = tmp_path_factory.mktemp("mc") / "repo"
    repo.mkdir()
    g = Git(repo)
    g.run("init", "-q", "--bare")
    (repo / "objects" / "info" / "alternates").write_text(str((cg.workdir / "objects").resolve()) + "\n")
    return g, base


def edit(g: Git, commit: str, changes: dict[str, str], msg: str = "edit\n") -> str:
    """A commit on commit with files replaced (real git: temp index, hash-object, commit-tree)."""
    import tempfile

    with tempfile.TemporaryDirectory() as idx:
        env = {"GIT_INDEX_FILE": str(Path(idx) / "i")}
        g.run("read-tree", commit, env=env)
        for path, text in changes.items():
            blob = g.run("hash-object", "-w", "--stdin", input=text)
            g.run("update-index", "--cacheinfo", f"100644,{blob},{path}", env=env)
        tree = g.run("write-tree", env=env)
    return g.run("commit-tree", tree, "-p", commit, input=msg)


def show(g: Git, commit: str, path: str) -> str:
    return g.run("show", f"{commit}:{path}", strip=False)


def classify_one(g: Git, tmp: Path, old_base: str, old_commit: str, new_base: str) -> outcome.Outcome:
    """Run rebase's own classification on a one-patch project made of old_base..old_commit."""
    project = tmp / "project"
    (project / "patches").mkdir(parents=True)
    shutil.copy2(ROOT / "upstream.lock", project / "upstream.lock")
    (project / "patches" / "0001-probe.patch").write_bytes(export.format_patch(g, old_commit))
    (project / "series").write_text("0001-probe.patch\n")
    (project / "CHANGELOG.md").write_text("# Changelog\n")
    lock = read_lock(ROOT)
    (out,) = classify.classify(g, project, old_base, [old_commit], lock, new_base, "sdist")
    return out


def test_planted_upstream_rename_is_3way_but_broken(base_0510, tmp_path):
    g, base = base_0510
    text = show(g, base, CAR)
    assert "self.full_nvlink" in text
    probe = "\n\ndef _sglpatch_probe(ca):\n    return ca.full_nvlink and ca.world_size\n"
    patched = edit(g, base, {CAR: text + probe}, "probe: read full_nvlink\n\nDescription: test\n")
    # upstream renames the attribute everywhere it is defined or used, and moves the file's code
    renamed = {}
    for path in g.run("grep", "-l", "-w", "full_nvlink", base, "--", "*.py").splitlines():
        path = path.split(":", 1)[1]
        renamed[path] = show(g, base, path).replace("full_nvlink", "fully_connected")
    renamed[CAR] = "# moved\n# by\n# upstream\n" + renamed[CAR]
    new = edit(g, base, renamed)
    o = classify_one(g, tmp_path, base, patched, new)
    assert o.status == "3way-broken" and o.action == "stop", o
    assert o.how.startswith("3-way but broken: ") and f"{CAR}:" in o.how
    assert "'full_nvlink' is defined in the old upstream but nowhere in the new one" in o.how
    # control: the same merge without the rename is a clean, carried 3-way
    moved = edit(g, base, {CAR: "# moved\n# by\n# upstream\n" + text})
    ok = classify_one(g, tmp_path / "ok", base, patched, moved)
    assert ok.status == "3way" and ok.action == "refresh", ok


def test_planted_redefinition_is_caught(base_0510, tmp_path):
    g, base = base_0510
    text = show(g, base, CAR)
    patched = edit(g, base, {CAR: text + "\n\ndef sglpatch_limit():\n    return 65536\n"})
    # upstream adds its own function of that name at the top of the file
    new = edit(g, base, {CAR: "def sglpatch_limit():\n    return 1 << 20\n\n\n" + text})
    o = classify_one(g, tmp_path, base, patched, new)
    assert o.status == "3way-broken", o
    assert any("redefinition of unused 'sglpatch_limit'" in h for h in o.hunks), o.hunks


def test_merge_check_clean_on_sound_merge(base_0510):
    from sglpatch.rebase import mergecheck

    g, base = base_0510
    text = show(g, base, CAR)
    merged = edit(g, base, {CAR: text + "\n\ndef sglpatch_ok(ca):\n    return ca.world_size\n"})
    assert mergecheck.check(g, base, base, merged, [CAR]) == []
    broken = edit(g, base, {CAR: text + "\n\ndef sglpatch_bad(:\n"})
    (p,) = mergecheck.check(g, base, base, broken, [CAR])
    assert p.startswith(f"{CAR}:") and "does not compile" in p


def test_upstream_redefinition_moved_by_the_patch_is_not_new(base_0510):
    """Upstream's own 'redefinition ... from line N' moves with lines the patch adds above it
    (0.5.23's add_norm.py under P1): the same message at other line numbers is not new."""
    from sglpatch.rebase import mergecheck

    g, base = base_0510
    text = show(g, base, CAR)
    dup = "\n\ndef sglpatch_dup():\n    return 1\n\n\ndef sglpatch_dup():\n    return 2\n"
    upstream = edit(g, base, {CAR: text + dup})  # upstream already has the redefinition
    merged = edit(g, upstream, {CAR: "# added by the patch\n# above it\n" + text + dup})
    assert mergecheck.check(g, upstream, upstream, merged, [CAR]) == []
    # a redefinition the patch adds is still caught
    worse = edit(g, upstream, {CAR: text + dup + "\n\ndef sglpatch_dup():\n    return 3\n"})
    probs = mergecheck.check(g, base, upstream, worse, [CAR])
    assert any("redefinition of unused 'sglpatch_dup'" in p for p in probs), probs


WORDS = ["Any", "Dict", "append", "backend", "self", "x", "tp_size", "get_bool_env_var", "_planted_9", "größe", "a.b"]
EDGE = ("xappend = 1\nappend_x = 2\n_planted_9=3\n_planted_90 = 4\nx\ngröße = 5\nab = 6\n(a.b)\n"
        "def f(self, tp_size):\n    return self\n")


def test_the_word_grep_finds_the_lines_git_grep_w_f_finds(base_0510, monkeypatch):
    """mergecheck's one `git grep -P` alternation returns the very lines `git grep -w -F -e ...`
    does (SGLang's real tree plus words at line ends, inside longer words, non-ASCII, a dot), and
    defined_names answers the same through the -w -F fallback of a git without PCRE."""
    from sglpatch.rebase import mergecheck

    g, base = base_0510
    commit = edit(g, base, {CAR: show(g, base, CAR) + EDGE})
    args = ["grep", "-I", "-h", "-w", "-F", *[a for w in WORDS for a in ("-e", w)], commit, "--", "*.py"]
    want = g.run(*args, check=False, strip=False)[1]
    got = mergecheck._lines_naming(g, commit, WORDS)
    assert got == want and "xappend" not in got.replace("append_x", "") and "größe = 5" in got and "(a.b)" in got
    assert "_planted_90" not in got and "ab = 6" not in got
    found = mergecheck.defined_names(g, commit, set(WORDS))
    assert {"_planted_9", "größe", "tp_size", "self", "x", "get_bool_env_var"} <= found and "_planted_90" not in found
    real_run = g.run

    def no_pcre(*a, **kw):  # the one thing stood in for: a git built without PCRE refuses -P
        if "-P" in a:
            return 128, "", "fatal: cannot use Perl-compatible regexes when not compiled with USE_LIBPCRE"
        return real_run(*a, **kw)

    monkeypatch.setattr(g, "run", no_pcre)
    assert mergecheck._lines_naming(g, commit, WORDS) == want
    mergecheck._NAMES.clear()
    monkeypatch.setattr(mergecheck.treecache, "load_facts", lambda kind, oid: {})
    monkeypatch.setattr(mergecheck.treecache, "save_facts", lambda kind, oid, facts: None)
    assert mergecheck.defined_names(g, commit, set(WORDS)) == found
