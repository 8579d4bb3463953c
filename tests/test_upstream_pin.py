"""sglpatch.upstream.materialize.upstream_pin: the pin an upstream branch carries, read in one git
run: its commit's trailer, else the pin recorded in the repository's config for exactly that
commit (a branch built from git, or moved by a rebase), else none; none without the branch."""

from __future__ import annotations

from conftest import git
from sglpatch.gitcmd import Git
from sglpatch.upstream.materialize import PIN_TRAILER, upstream_pin
from sglpatch.workdir import pin_key

PIN, OTHER = "a" * 64, "b" * 64


def commit(repo, message: str) -> str:
    (repo / "f").write_text(message)
    git(repo, "add", "f")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD").strip()


def test_the_pin_from_the_trailer_the_config_or_none(tmp_path, request):
    repo = tmp_path / "wd"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    g = Git(repo)
    assert upstream_pin(g) is None  # no upstream branch
    first = commit(repo, f"sglang 0.5.9 from the registry sdist\n\n{PIN_TRAILER}: {PIN}")
    git(repo, "branch", "upstream")
    (repo / "upstream").write_text("a file named like the branch\n")  # the ref is a revision, not a path
    runs = request.getfixturevalue("git_runs")  # counted from here on
    assert upstream_pin(g) == PIN and [a[0] for a in runs] == ["log"]
    git(repo, "checkout", "-q", "-b", "moved")
    moved = commit(repo, "upstream at its new release, from git (no trailer)")
    git(repo, "branch", "-f", "upstream", moved)
    assert upstream_pin(g) is None  # no trailer, nothing recorded
    g.config_set(pin_key("upstream"), f"{OTHER} {moved}")
    assert upstream_pin(g) == OTHER  # recorded for this very commit
    g.config_set(pin_key("upstream"), f"{OTHER} {first}")
    assert upstream_pin(g) is None  # recorded for another commit
    assert upstream_pin(g, "moved") is None and upstream_pin(g, "nosuch") is None
