"""A wheel-sourced tree installs (issue 27 item 3): 0.5.23 is wheel-only, so its tree holds only
python/sglang/ (no pyproject.toml). `apply --python SCRATCH` installs it as a generated editable
wheel: a .pth to the tree plus a dist-info carrying the release wheel's own METADATA. Real pip,
the real 0.5.23 wheel, the recorded 0.5.23 patches; reinstall changes nothing; `pip uninstall`
leaves the venv as it was."""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from conftest import ROOT, git, sglpatch

PATCHES = ["0001-sm120-flashinfer-allreduce-fusion.patch", "0004-eagle-verify-profiling.patch"]


@pytest.fixture(scope="module")
def line_0523(tmp_path_factory):
    """A project pinned to the 0.5.23 wheel carrying the recorded 0.5.23 patches."""
    from sglpatch.upstream import artifacts
    from sglpatch.upstream.pin import Lock, write_lock

    proj = tmp_path_factory.mktemp("l0523") / "project"
    (proj / "patches").mkdir(parents=True)
    art, path = artifacts.fetch("sglang", "0.5.23", "wheel")
    write_lock(proj, Lock(name="sglang", url="https://github.com/sgl-project/sglang", tag="v0.5.23",
                          commit=artifacts.recorded_commit(path) or "unknown", version="0.5.23",
                          sdist_filename=art.filename, sdist_sha256=art.sha256, sdist_subdir="python"))
    for n in PATCHES:
        shutil.copy(ROOT / "resolutions" / "0.5.23" / n, proj / "patches" / n)
    (proj / "series").write_text("\n".join(PATCHES) + "\n")
    return proj, path


def _site(py: Path) -> Path:
    return Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if "__pycache__" not in p.parts)


def test_wheel_sourced_tree_installs_editable_with_the_wheels_metadata(line_0523, tmp_path):
    from sglpatch.upstream import artifacts

    proj, wheel = line_0523
    env_dir = tmp_path / "scratch"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = _site(py)
    before = _listing(site)
    wd = tmp_path / "wd"
    args = ("apply", "--project", str(proj), "--workdir", str(wd), "--source", "sdist", "--python", str(py), "--installer", "pip")
    res = sglpatch(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"installed sglang 0.5.23 editable from {wd / 'python'} into {py}" in res.stdout
    assert not (wd / "python" / "pyproject.toml").exists()
    # what it lacks is named, with a way that works for a tree without build files (not `pip install -e`)
    assert f"warning: {py} cannot import sglang yet" in res.stdout and "scripts/apply.sh --venv NEWDIR" in res.stdout
    assert "pip install -e" not in res.stdout
    after = _listing(site)
    assert sorted(set(after) - set(before))[:1] == ["__editable__.sglang-0.5.23.pth"]
    assert (site / "__editable__.sglang-0.5.23.pth").read_text() == f"{(wd / 'python').resolve()}\n"
    code = ("import importlib.metadata as m, importlib.util as u; d = m.distribution('sglang'); "
            "print(d.version); print(len(d.requires)); print(u.find_spec('sglang').origin)")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    want = email.parser.Parser().parsestr(artifacts.metadata_bytes(wheel).decode())
    assert out[0] == "0.5.23" and int(out[1]) == len(want.get_all("Requires-Dist")) > 50
    assert out[2] == str((wd / "python" / "sglang" / "__init__.py").resolve())
    show = subprocess.run([str(py), "-m", "pip", "show", "sglang"], capture_output=True, text=True, check=True).stdout
    assert "Version: 0.5.23" in show
    # the patched code is on its sys.path: P4's profiler and its switch (from patch 0004); importing
    # sglang.srt needs the release's dependencies, which --no-deps leaves out
    spec = ("import sys, pathlib; f = 'sglang/srt/speculative/spec_profiler.py'; "
            "print(next(str(pathlib.Path(p, f)) for p in sys.path if pathlib.Path(p, f).is_file()))")
    origin = subprocess.run([str(py), "-c", spec], capture_output=True, text=True, cwd=tmp_path).stdout.strip()
    assert origin == str((wd / "python/sglang/srt/speculative/spec_profiler.py").resolve())
    assert "SGLANG_VERIFY_PROFILE" in (wd / "python/sglang/srt/environ.py").read_text()
    assert git(wd, "status", "--porcelain") == ""
    # reinstall: idempotent (the same files, the tree untouched)
    res2 = sglpatch(*args)
    assert res2.returncode == 0, res2.stderr[-3000:]
    assert _listing(site) == after and git(wd, "status", "--porcelain") == ""
    # uninstall leaves nothing behind
    un = subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "sglang"], capture_output=True, text=True)
    assert un.returncode == 0 and "Successfully uninstalled sglang-0.5.23" in un.stdout
    assert _listing(site) == before


def test_the_fix_a_not_set_up_refusal_names_works_as_typed(tmp_path):
    """`export` on a workdir that is not set up names one command; typed as shown (from the tool's
    own Python, which apply refuses to install into) it sets the workdir up, and the command then
    gets past that refusal. (A new rebase sets its workdir up itself: tests/test_rebase.py.)"""
    import re
    import shlex

    wd = tmp_path / "fresh"
    res = sglpatch("export", "--workdir", str(wd))
    assert res.returncode == 1 and not wd.exists(), res.stderr
    cmd = re.search(r"run `(sglpatch apply [^`]+)` first", res.stderr).group(1)
    assert cmd == f"sglpatch apply --workdir {wd} --no-install"
    done = sglpatch(*shlex.split(cmd)[1:], "--source", "sdist")
    assert done.returncode == 0, done.stderr[-2000:]
    again = sglpatch("status", "--workdir", str(wd))
    assert again.returncode == 0 and "state:    in sync with the series" in again.stdout, again.stdout + again.stderr
