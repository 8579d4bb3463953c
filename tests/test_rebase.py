"""sglpatch rebase on the real 0.5.9 and 0.5.10.post1 sdist trees, with real git.

Two projects:
* a synthetic one (built here on the real 0.5.9 tree): an exact patch, a patch on the
  custom-allreduce NVLink gate that 0.5.10.post1 moved (conflict), the real P3 (already
  upstream, with different text), and a patch whose Applied-Upstream hint is false;
* the committed series (P1-P6) with the committed recorded resolutions (skips until the
  series lists them).
Every test works on copies: the repository's own files and main's pin are never touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, copy_project, git, sglpatch
from sglpatch.stack import build, export, status
from sglpatch.series import parse_patch, read_series

TARGET = "0.5.10.post1"
GATE = "python/sglang/srt/distributed/device_communicators/custom_all_reduce.py"
P3 = "0003-kimi-k25-eagle3-delegation.patch"
P6 = "0006-jit_kernel-flashinfer-bundled-CCCL-for-rope.patch"
HINT_PR = "v0.5.10, https://github.com/sgl-project/sglang/pull/99999"

HEADER = """Description: {desc}
Origin: vendor, sglpatch tests
Forwarded: not-needed
{extra}Last-Update: 2026-11-30
"""


# --------------------------------------------------------------------------------------
# helpers


def snapshot(workdir: Path, project: Path) -> dict:
    """Everything abort must restore: refs, HEAD, config, every worktree and project byte."""
    snap = {
        "refs": git(workdir, "for-each-ref", "--format=%(refname) %(objectname)"),
        "HEAD": (workdir / ".git" / "HEAD").read_bytes(),
        "config": (workdir / ".git" / "config").read_bytes(),
        "index-tree": git(workdir, "write-tree"),
    }
    for root, tag in ((workdir, "w"), (project, "p")):
        for p in sorted(root.rglob("*")):
            if ".git" in p.relative_to(root).parts or not p.is_file():
                continue
            snap[f"{tag}:{p.relative_to(root)}"] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def author_patch(author: Path, path: str, edit, subject: str, desc: str, extra: str = "") -> bytes:
    """Commit an edit on the 0.5.9 tree in the authoring clone and export it like sglpatch does."""
    f = author / path
    f.write_text(edit(f.read_text()))
    msg = f"{subject}\n\n" + HEADER.format(desc=desc, extra=extra)
    git(author, "commit", "-q", "-a", "-m", msg)
    data = export.format_patch(build.Git(author), "HEAD")
    git(author, "reset", "-q", "--hard", "HEAD~1")
    return data


def copy_tree(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def run(*args, **kw) -> subprocess.CompletedProcess:
    return sglpatch("rebase", *args, **kw)


# --------------------------------------------------------------------------------------
# the synthetic project (session): built once, copied per test


@pytest.fixture(scope="session")
def synth(tmp_path_factory, sdist_059, sdist_0510):
    top = tmp_path_factory.mktemp("rebase-synth")
    project = top / "project"
    (project / "patches").mkdir(parents=True)
    shutil.copy2(ROOT / "upstream.lock", project / "upstream.lock")
    (project / "series").write_text("")
    (project / "resolutions" / TARGET).mkdir(parents=True)  # the committed pin of the target, nothing else
    shutil.copy2(ROOT / "resolutions" / TARGET / "target.toml", project / "resolutions" / TARGET / "target.toml")
    (project / "CHANGELOG.md").write_text("# Changelog\n\nTest project.\n\n## 0.1.0\n- started\n")
    workdir = top / "workdir"
    build.apply(project, workdir)  # empty series: just the 0.5.9 upstream
    author = top / "author"
    git(top, "clone", "-q", "--branch", "upstream", str(workdir), str(author))
    git(author, "config", "user.name", "Test Author")
    git(author, "config", "user.email", "test@example.invalid")
    patches = {
        "0001-utils-exact.patch": author_patch(
            author,
            "python/sglang/srt/utils/__init__.py",
            lambda t: t + "# sglpatch test: an exact patch\n",
            "utils: exact test patch",
            "touches a file that 0.5.10.post1 did not change",
        ),
        "0002-custom-ar-gate.patch": author_patch(
            author,
            GATE,
            lambda t: t.replace(
                "        if world_size > 2 and not full_nvlink:\n",
                "        if world_size > 2 and not full_nvlink and not _pcie_allowed():\n",
            ),
            "custom_all_reduce: test patch on the NVLink gate",
            "edits the gate that 0.5.10.post1 moved into custom_all_reduce_utils",
        ),
        P3: (ROOT / "patches" / P3).read_bytes(),
        "0004-false-hint.patch": author_patch(
            author,
            "python/sglang/srt/constants.py",
            lambda t: "def sglpatch_hint_probe():\n    return 42\n\n\n" + t,
            "constants: helper that upstream does NOT have",
            "claims to be upstream but is not",
            extra=f"Applied-Upstream: {HINT_PR}\n",
        ),
    }
    for name, data in patches.items():
        (project / "patches" / name).write_bytes(data)
    (project / "series").write_text("# synthetic series for the rebase tests\n" + "\n".join(patches) + "\n")
    build.apply(project, workdir)
    status.update_blobs(project, workdir)
    assert build.apply(project, workdir).changed is False
    return project, workdir


@pytest.fixture
def synth_copy(synth, tmp_path):
    project, workdir = synth
    return copy_tree(project, tmp_path / "project"), copy_tree(workdir, tmp_path / "workdir")


# --------------------------------------------------------------------------------------
# synthetic: classification, stop, abort, continue, recorded replay


def test_dry_run_classifies_and_changes_nothing(synth):
    project, workdir = synth
    before = snapshot(workdir, project)
    res = run("--workdir", str(workdir), "--project", str(project), "--onto", TARGET, "--dry-run")
    out = res.stdout
    assert res.returncode == 3, res.stdout + res.stderr  # a conflict without a recorded resolution
    rows = {line.split()[1]: line.split()[2] for line in out.splitlines() if line[:3].strip().isdigit()}
    assert rows == {
        "0001-utils-exact.patch": "exact",
        "0002-custom-ar-gate.patch": "conflict",
        P3: "upstream",
        "0004-false-hint.patch": rows.get("0004-false-hint.patch") if rows.get("0004-false-hint.patch") in ("exact", "3way") else "kept",
    }, out
    assert f"conflict: {GATE}" in out
    assert "hunk #1" in out  # the hunk whose context is gone
    assert "same behaviour" in out  # P3: text differs, change present
    assert "Applied-Upstream says" in out and "not in the new tree: kept" in out
    assert snapshot(workdir, project) == before


def test_conflict_stops_resumable_and_abort_restores_bytes(synth_copy):
    project, workdir = synth_copy
    before = snapshot(workdir, project)
    res = run("--workdir", str(workdir), "--project", str(project), "--onto", TARGET, "--promote")
    assert res.returncode == 3, res.stdout + res.stderr
    out = res.stdout
    assert "rebase stopped at patch 2/4: 0002-custom-ar-gate.patch" in out
    assert GATE in out and "--continue" in out and "--abort" in out
    assert "<<<<<<<" in (workdir / GATE).read_text()  # markers in place
    assert git(workdir, "ls-files", "-u")  # unmerged entries, as git users expect
    # a second start is refused while one is in progress
    again = run("--workdir", str(workdir), "--project", str(project), "--onto", TARGET, "--promote")
    assert again.returncode == 1 and "already in progress" in again.stderr
    (workdir / GATE).write_text("user scribbles\n")  # abort must undo edits made while stopped too
    res = run("--workdir", str(workdir), "--project", str(project), "--abort")
    assert res.returncode == 0, res.stderr
    assert snapshot(workdir, project) == before


def test_a_line_rebase_in_its_own_workdir_stops_and_abort_finds_it(synth, tmp_path):
    """Without --workdir a real rebase works in the line's own workdir (HOME/sglang-fork-R), never in
    ~/sglang-fork; --abort without --workdir finds the one stopped there and puts the project back,
    the line folder it began included."""
    project, workdir = synth
    project = copy_tree(project, tmp_path / "project")
    home = tmp_path / "home"
    home.mkdir()
    (home / "sglang-fork").mkdir()  # the primary's tree: not to be touched
    own = copy_tree(workdir, home / f"sglang-fork-{TARGET}")
    before = snapshot(own, project)
    env = {"HOME": str(home), "SGLANG_FORK_DIR": str(home / "sglang-fork")}
    res = run("--project", str(project), "--onto", TARGET, env=env)
    assert res.returncode == 3 and f"sglpatch rebase --workdir {own} --continue" in res.stdout, res.stdout + res.stderr
    assert not any((home / "sglang-fork").iterdir())
    res = run("--project", str(project), "--abort", env=env)
    assert res.returncode == 0 and f"rebase aborted: {own} and {project} are back as they were" in res.stdout, res.stderr
    assert snapshot(own, project) == before and not (project / "lines").exists()


def test_continue_after_scripted_resolution_then_replay_is_unattended(synth_copy, tmp_path):
    project, workdir = synth_copy
    pristine = copy_tree(project, tmp_path / "pristine")
    pristine_wd = copy_tree(workdir, tmp_path / "pristine-wd")
    res = run("--workdir", str(workdir), "--project", str(project), "--onto", TARGET, "--promote")
    assert res.returncode == 3
    # scripted resolution: take the new upstream's file and port the intent (a marker line)
    new_text = git(workdir, "show", f"HEAD:{GATE}") + "\n"
    (workdir / GATE).write_text(new_text.replace("class CustomAllreduce:", "# ported gate (test)\nclass CustomAllreduce:", 1))
    res = run("--workdir", str(workdir), "--project", str(project), "--continue")
    assert res.returncode == 0, res.stdout + res.stderr
    series = read_series(project).names
    assert series == ["0001-utils-exact.patch", "0002-custom-ar-gate.patch", "0004-false-hint.patch"]
    assert not (project / "patches" / P3).exists()
    lock = (project / "upstream.lock").read_text()
    assert 'version = "0.5.10.post1"' in lock and GATE in lock and "01f7adfe7cde" in lock
    log = (project / "CHANGELOG.md").read_text()
    assert log.index("## Rebase onto sglang 0.5.10.post1") < log.index("## 0.1.0")
    assert "pull/19689" in log and "resolved by hand" in log and "not in the new tree: kept" in log
    report = (project / "rebase-reports" / "0.5.9..0.5.10.post1" / "report.md").read_text()
    assert "range-diff" in report and "custom_all_reduce: test patch" in report
    assert (project / "rebase-reports" / "0.5.9..0.5.10.post1" / "dropped" / P3).is_file()
    rec = project / "resolutions" / TARGET
    assert (rec / "0002-custom-ar-gate.patch").is_file() and "replace" in (rec / "resolutions.toml").read_text()
    # the hand resolution is keyed by the conflict it resolves (rerere-like), the key the lookup computes
    from sglpatch.rebase import resolutions, classify

    recorded = resolutions.read_resolutions(project, TARGET)[0]["0002-custom-ar-gate.patch"]
    stopped = next(o for o in classify.dry_run(pristine, pristine_wd, TARGET).outcomes if o.name == "0002-custom-ar-gate.patch")
    assert stopped.status == "conflict" and len(stopped.conflict) == 64 and recorded.conflict == stopped.conflict
    # the workdir is the new stack, in sync, and the export is a no-op
    assert git(workdir, "rev-parse", "--abbrev-ref", "HEAD") == "patched"
    assert "in sync" in "\n".join(status.status(project, workdir))
    assert "# ported gate (test)" in (workdir / GATE).read_text()
    # replay: the recorded resolution makes the same rebase unattended from the old project
    shutil.copytree(rec, pristine / "resolutions" / TARGET, dirs_exist_ok=True)
    dry = run("--workdir", str(pristine_wd), "--project", str(pristine), "--onto", TARGET, "--dry-run")
    assert dry.returncode == 0 and "does unattended (exit 0)" in dry.stdout, dry.stdout + dry.stderr
    res = run("--workdir", str(pristine_wd), "--project", str(pristine), "--onto", TARGET, "--promote")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (pristine / "patches" / "0002-custom-ar-gate.patch").read_bytes() == (project / "patches" / "0002-custom-ar-gate.patch").read_bytes()
    assert git(pristine_wd, "rev-parse", "patched^{tree}") == git(workdir, "rev-parse", "patched^{tree}")


def test_recorded_resolution_for_another_patch_version_is_not_used(synth_copy):
    from sglpatch.rebase import resolutions, classify, outcome

    project, workdir = synth_copy
    rec = resolutions.Recorded("drop", "test", "0" * 64)
    resolutions.write_resolutions(project, TARGET, {"0002-custom-ar-gate.patch": rec})
    res = classify.dry_run(project, workdir, TARGET)
    gate = next(o for o in res.outcomes if o.name == "0002-custom-ar-gate.patch")
    assert gate.action == "stop" and "another version of this patch" in gate.note
    assert res.exit_code == outcome.EXIT_HUMAN


def test_upstream_detection_is_behavioural_not_textual(synth):
    """P3's text differs from upstream's; a changed behaviour must not count as upstream."""
    from sglpatch.rebase import upstreamed
    from sglpatch.gitcmd import Git

    _, workdir = synth
    g = Git(workdir)
    commits = g.commits("upstream", "patched")
    p3_parent, p3 = commits[1], commits[2]
    onto = None
    with __import__("tempfile").TemporaryDirectory() as tmp:
        sg = Git(tmp)
        sg.run("init", "-q", "--bare")
        (Path(tmp) / "objects" / "info" / "alternates").write_text(str(workdir / ".git" / "objects") + "\n")
        from sglpatch.upstream import materialize as up
        from conftest import lock_0510

        onto = up.build_from_sdist(sg, lock_0510())
        patch = parse_patch(P3, export.format_patch(g, p3))
        ok, why = upstreamed._definitions_present(sg, onto, p3_parent, p3, patch)
        assert ok, why
        # same names, different behaviour: returns the head only -> not upstream
        text = g.run("show", f"{p3}:python/sglang/srt/models/kimi_k25.py", strip=False)
        bad = text.replace('return self._language_model_method("get_embed_and_head")()',
                           'return self._language_model_method("get_embed_and_head")()[1]')
        assert bad != text
        blob = sg.run("hash-object", "-w", "--stdin", input=bad)
        with __import__("tempfile").TemporaryDirectory() as idx:
            env = {"GIT_INDEX_FILE": str(Path(idx) / "i")}
            sg.run("read-tree", p3, env=env)
            sg.run("update-index", "--cacheinfo", f"100644,{blob},python/sglang/srt/models/kimi_k25.py", env=env)
            tree = sg.run("write-tree", env=env)
        changed = sg.run("commit-tree", tree, "-p", p3_parent, input="x\n")
        ok, why = upstreamed._definitions_present(sg, onto, p3_parent, changed, patch)
        assert not ok and "get_embed_and_head behaves differently" in why


# --------------------------------------------------------------------------------------
# the committed series onto 0.5.10.post1 with the committed recorded resolutions

REAL_SERIES = (ROOT / "series").is_file() and P3 in (ROOT / "series").read_text() and any(
    "custom" in n and "allreduce" in n.replace("-", "").replace("_", "") or "custom-ar" in n or "pcie" in n.lower()
    for n in (ROOT / "series").read_text().split()
)
real = pytest.mark.skipif(not REAL_SERIES, reason="the committed series does not list P2 and P3 yet")


def real_project(dest: Path) -> Path:
    return copy_project(dest)


def _row(out: str, needle: str) -> str:
    return next(line for line in out.splitlines() if line[:3].strip().isdigit() and needle in line)


@real
def test_real_dry_run_reports_p3_upstream_p2_conflict(patched_tree, tmp_path):
    project = real_project(tmp_path / "project")
    patched_tree = copy_tree(patched_tree, tmp_path / "workdir")  # the run shares patched_tree: a copy of our own
    before = snapshot(patched_tree, project)
    res = run("--workdir", str(patched_tree), "--project", str(project), "--onto", TARGET, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr  # work, done unattended thanks to the recording (exit 0, as watch says it)
    out = res.stdout
    assert "upstream" in _row(out, "kimi-k25").split()
    p2 = next(line for line in out.splitlines() if line[:3].strip().isdigit() and line.split()[1].startswith("0002"))
    assert "conflict" in p2.split() and "recorded resolution" in p2
    assert "custom_all_reduce.py" in out
    assert snapshot(patched_tree, project) == before


@real
def test_real_full_rebase_is_unattended(patched_tree, tmp_path):
    project = real_project(tmp_path / "project")
    workdir = copy_tree(patched_tree, tmp_path / "workdir")
    primary = {n: (project / n).read_bytes() for n in ("series", "upstream.lock", "CHANGELOG.md")}
    res = run("--workdir", str(workdir), "--project", str(project), "--onto", TARGET, "--source", "sdist")
    assert res.returncode == 0, res.stdout + res.stderr
    # the result is the line lines/0.5.10.post1/; the primary is left as it was (issue 27)
    line = project / "lines" / TARGET
    assert {n: (project / n).read_bytes() for n in primary} == primary
    names = read_series(line).names
    # P3 is upstream there; P6 is not needed (0.5.10's rope is SGLang's own kernel) and P7 is not ported
    # (0.5.10's record, keyed to the same conflict): their recorded drops
    p7 = next(n for n in read_series(ROOT).names if n.startswith("0007-"))
    assert P3 not in names and P6 not in names and p7 not in names and len(names) == len(read_series(ROOT).names) - 3
    assert 'version = "0.5.10.post1"' in (line / "upstream.lock").read_text()
    log = (line / "CHANGELOG.md").read_text()
    assert "pull/19689" in log and "recorded resolution" in log
    assert (project / "rebase-reports" / "0.5.9..0.5.10.post1" / "report.md").is_file()
    assert status.check(line, workdir) == []  # the rebased series applies exactly to its new pin
    st = sglpatch("status", "--workdir", str(workdir), "--project", str(project))
    assert st.returncode == 0 and "line:     0.5.10.post1, from lines/0.5.10.post1/" in st.stdout, st.stdout + st.stderr
    # the patch tests of issue 3 on the 0.5.10.post1 tree (conftest honours SGLPATCH_PATCHED_TREE)
    env = dict(os.environ, SGLPATCH_PATCHED_TREE=str(workdir), SGLPATCH_PROJECT=str(line))
    proc = subprocess.run(
        # its own basetemp: a numbered one would prune the older runs' folders at its exit (gigabytes, inside this test)
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "basetemp"),
         str(ROOT / "tests" / "patches")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_readmes_rebase_on_a_fresh_box_sets_up_its_workdir_and_finishes(tmp_path):
    """Issue 52: `rebase --onto 0.5.10.post1` with no workdir yet advised `apply --line 0.5.10.post1`, which
    is refused (no such line until the rebase makes it): a loop. Now the rebase builds the primary series
    in the line's own workdir first (nothing installed) and goes on."""
    project = copy_project(tmp_path / "project")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_FORK_DIR"}
    res = sglpatch("rebase", "--onto", "0.5.10.post1", "--project", str(project), "--source", "sdist", env=dict(env, HOME=str(home)))
    wd = home / "sglang-fork-0.5.10.post1"
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"sglpatch: rebase: {wd} is not set up yet: building the primary series there first (installs nothing)" in res.stderr
    assert (project / "lines" / "0.5.10.post1" / "series").is_file() and not (home / "sglang-fork").exists()
    assert f"{wd} holds it; install it with `sglpatch apply --line 0.5.10.post1 --workdir {wd} --python PYTHON`" in res.stdout
