"""Lines as one concept (issue 37): the line, its workdir and the serving Python are resolved once
(sglpatch.context, the naming rule in sglpatch.linepath) and every command and script acts on the
line it names and nothing else. Real processes on a project copy, the real 0.5.9 sdist and 0.5.23
wheel (the test cache), real pip into scratch venvs that see the test interpreter's packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, copy_project, git, make_venv, sglpatch
from sglpatch.upstream.pin import read_lock

pytestmark = pytest.mark.slow
LINE = "0.5.23"


def _env(tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_FORK_DIR"}
    env.update(HOME=str(tmp / "home"), SGLANG_FORK_DIR=str(tmp / "fork"))
    env.update(extra)
    (tmp / "home").mkdir(exist_ok=True)
    return env


def _run(tmp, co, *args, **extra):
    return sglpatch(*args, "--project", str(co), cwd=co, env=_env(tmp, **extra), timeout=900)


def _tree(co: Path) -> dict:
    return {p.relative_to(co).as_posix(): p.read_bytes() for p in sorted(co.rglob("*")) if p.is_file()}


@pytest.fixture
def co(tmp_path):
    return copy_project(tmp_path / "co")


def test_export_refuses_a_tree_on_another_lines_pin_whatever_lines_holds(tmp_path, co):
    """Fault 1: a damaged lines/R/ made export without --line write the 0.5.23 line's commits into
    the primary series (exit 0); the pin is now checked against the line's lock."""
    res = _run(tmp_path, co, "apply", "--line", LINE, "--source", "sdist", "--no-install")
    assert res.returncode == 0, res.stderr[-2000:]
    wd = tmp_path / f"fork-{LINE}"
    assert (wd / "python" / "sglang").is_dir() and f"sglpatch: line {LINE}, workdir {wd}" in res.stderr
    bad = co / "lines" / "0.5.77"  # what a rebase killed at its finishing step leaves: a lock not yet the line's
    bad.mkdir()
    (bad / "series").write_text("")
    (bad / "upstream.lock").write_bytes((co / "upstream.lock").read_bytes())
    before = _tree(co)
    res = _run(tmp_path, co, "export", "--workdir", str(wd))  # the line the tree holds, found past the damaged folder
    assert res.returncode == 0 and f"export: line {LINE}, workdir {wd}" in res.stderr and "0 written" in res.stdout, res.stderr
    assert _tree(co) == before  # the primary kept P2, P3 and P5
    v = read_lock(co).version
    res = _run(tmp_path, co, "export", "--line", v, "--workdir", str(wd))
    assert res.returncode == 2 and f"{wd} holds the line {LINE}, not the line {v}" in res.stderr, res.stderr
    assert f"`sglpatch export --line {LINE} --workdir {wd}`" in res.stderr and _tree(co) == before
    lock = co / "lines" / LINE / "upstream.lock"  # the line's own folder unreadable too: no line holds the tree
    lock.write_text(lock.read_text().replace(f'version = "{LINE}"', 'version = "0.5.22"'))
    before = _tree(co)
    res = _run(tmp_path, co, "export", "--workdir", str(wd))
    assert res.returncode == 2 and f"{wd} holds another release than any line's lock, not the line {v}" in res.stderr, res.stderr
    assert _tree(co) == before


def test_scripts_pass_the_line_through_and_a_trailing_slash_keeps_the_line_beside(tmp_path, co):
    """Faults 2 and 3: scripts/export.sh and bisect.sh --line act on the line's tree (they passed
    --workdir $SGLANG_FORK_DIR, the primary's); SGLANG_FORK_DIR=/x/fork/ puts the line's tree in
    /x/fork-R, not /x/fork/-R; `apply.sh --line=` is refused."""
    import shutil

    from test_lines import tool_venv

    shutil.copytree(ROOT / "scripts", co / "scripts")
    shutil.copy2(ROOT / "pyproject.toml", co / "pyproject.toml")
    env = _env(tmp_path, SGLANG_FORK_DIR=f"{tmp_path / 'fork'}/", SGLPATCH_TOOL_VENV=str(tool_venv(tmp_path, co)))

    def sh(name, *args):
        return subprocess.run(["bash", str(co / "scripts" / name), *args], cwd=tmp_path, capture_output=True, text=True, env=env,
                              timeout=900)

    res = sh("apply.sh", "--line", LINE, "--source", "sdist", "--no-install")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    wd = tmp_path / f"fork-{LINE}"
    assert (wd / "python").is_dir() and not (tmp_path / "fork").exists(), sorted(os.listdir(tmp_path))
    res = sh("export.sh", "--line", LINE)
    assert res.returncode == 0 and f"export: line {LINE}, workdir {wd}" in res.stderr, res.stderr[-2000:]
    res = sh("bisect.sh", "--line", LINE, "--", sys.executable, "-c", "import sys; sys.exit(0)")
    assert f"bisect: line {LINE}, workdir {wd}" in res.stderr, res.stdout + res.stderr[-2000:]
    assert git(wd, "status", "--porcelain") == "" and not (tmp_path / "fork").exists()
    res = sh("apply.sh", "--line=", "--no-install")
    assert res.returncode == 2 and "--line needs a release" in res.stderr and not (tmp_path / "fork-").exists(), res.stderr


def _fake_sglang(py: Path, version: str) -> None:
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    d = Path(site) / f"sglang-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")


def test_every_python_that_imports_a_tree_guards_it_and_advice_keeps_the_line(tmp_path, co):
    """Fault 4: install into A, then B, delete B: the next apply moved A's tree (only the last
    interpreter was recorded). Fault 9: the advice printed for a line keeps --line."""
    a, b = make_venv(tmp_path / "a"), make_venv(tmp_path / "b")
    for py in (a, b):
        res = _run(tmp_path, co, "apply", "--line", LINE, "--source", "sdist", "--python", str(py), "--installer", "pip")
        assert res.returncode == 0, res.stderr[-3000:]
    assert f"scripts/apply.sh --line {LINE} --venv NEWDIR" in res.stdout  # b cannot import sglang yet: the advice keeps the line
    wd = tmp_path / f"fork-{LINE}"
    head = git(wd, "rev-parse", "patched")
    import shutil

    shutil.rmtree(tmp_path / "b")
    res = _run(tmp_path, co, "apply", "--workdir", str(wd), "--source", "sdist", "--no-install")
    assert res.returncode == 1 and f"{a} imports sglang from {wd} (editable)" in res.stderr, res.stderr[-2000:]
    assert git(wd, "rev-parse", "patched") == head
    res = _run(tmp_path, co, "export", "--line", LINE, SGLANG_FORK_DIR=str(tmp_path / "gone"))
    assert res.returncode == 1 and f"is not set up yet; run `sglpatch apply --line {LINE} --workdir {tmp_path}/gone-{LINE}" in res.stderr


def test_a_python_serving_another_release_is_refused_and_another_cpython_gets_its_own_wheel(tmp_path, co):
    """Fault 7: apply --line 0.5.23 into a Python serving 0.5.9 installed it --no-deps over 0.5.9's
    dependencies, exit 0; now refused (one line) unless --venv or --other-release, and the mirror.
    Fault 8: the line's cp311 wheel tree into a Python 3.12 was installed, unloadable: the release's
    own cp312 wheel (the index's, hash-checked, its sources the lock's) now supplies the compiled
    extensions; a Python with no wheel on the index (3.9) is refused before any work, saying so."""
    serve = make_venv(tmp_path / "serve")
    _fake_sglang(serve, read_lock(co).version)
    res = _run(tmp_path, co, "apply", "--line", LINE, "--source", "sdist", "--python", str(serve))
    assert res.returncode == 2 and not (tmp_path / f"fork-{LINE}").exists(), res.stderr[-2000:]
    assert f"{serve} serves sglang {read_lock(co).version}, not {LINE}" in res.stderr
    assert f"`sglpatch apply --line {LINE} --venv NEWDIR`" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    other = make_venv(tmp_path / "other")
    _fake_sglang(other, LINE)
    res = _run(tmp_path, co, "apply", "--source", "sdist", "--python", str(other))  # the mirror case
    assert res.returncode == 2 and f"serves sglang {LINE}, not {read_lock(co).version}" in res.stderr
    v312 = make_venv(tmp_path / "v312")  # a Python 3.12 as far as apply's probe asks (no 3.12 here); the rest is a scratch venv
    shim = tmp_path / "py312"
    shim.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        if [[ "$*" == *"importlib.metadata as m, importlib.util"* ]]; then printf '\\n\\ncp39\\n'; exit 0; fi
        exec {v312} "$@"
        """))
    shim.chmod(0o755)
    res = _run(tmp_path, co, "apply", "--line", LINE, "--source", "sdist", "--python", str(shim))  # a Python the release has no wheel for
    assert res.returncode == 2 and "(CPython 3.11 only)" in res.stderr and "(Python 3.9)" in res.stderr, res.stderr[-2000:]
    assert f"the package index has no sglang {LINE} wheel for Python 3.9 either" in res.stderr and not (tmp_path / f"fork-{LINE}").exists()
    shim.write_text(shim.read_text().replace("cp39", "cp312"))
    res = _run(tmp_path, co, "apply", "--line", LINE, "--source", "sdist", "--python", str(shim), "--installer", "pip")
    assert res.returncode == 0, res.stderr[-3000:]
    from sglpatch.upstream import pkgindex

    art = pkgindex.wheel_for("sglang", LINE, "cp312")  # the index's own entry: the file taken is checked against its sha256
    assert art.filename == f"sglang-{LINE}-cp312-cp312-manylinux_2_34_x86_64.whl"
    assert "for Python 3.12: " in res.stderr and f" compiled extension(s) of {art.filename} (sha256 {art.sha256}, the index's)" in res.stderr
    wd = tmp_path / f"fork-{LINE}"
    assert list(wd.rglob("*.cpython-312-x86_64-linux-gnu.so")) and list(wd.rglob("*.cpython-311-x86_64-linux-gnu.so"))
    assert git(wd, "status", "--porcelain") == "" and f"installed sglang {LINE} editable from {wd / 'python'}" in res.stdout
    taken = len(list(wd.rglob("*.cpython-312-x86_64-linux-gnu.so")))
    assert f"for Python 3.12: {taken} compiled extension(s)" in res.stderr
    shutil.rmtree(tmp_path / "v312")  # nothing imports the tree now: it may move to the primary's release, and they go with its pin
    res = _run(tmp_path, co, "apply", "--workdir", str(wd), "--source", "sdist", "--no-install")
    assert res.returncode == 0 and f"removed {taken} compiled extension(s) for Python 3.12" in res.stderr, res.stderr[-3000:]
    assert not (wd / ".git" / "sglpatch-extensions").exists() and not list(wd.rglob("*.cpython-31[12]-x86_64-linux-gnu.so"))
    assert f"that an install of another release left beside {wd}'s tree" in res.stderr and git(wd, "status", "--porcelain") == ""


def _paused(tmp_path, co, step, *args, env_extra=None):
    base = tmp_path / f"pause-{step.replace(':', '-')}"
    env = _env(tmp_path, SGLPATCH_TEST_HOOKS="1", SGLPATCH_PAUSE_AT=step, SGLPATCH_PAUSE_FILE=str(base), **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, "-m", "sglpatch.cli", *args, "--project", str(co)], cwd=co, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not Path(f"{base}.reached").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return proc, base


def test_a_second_apply_is_told_another_one_works_from_git_init_to_the_install(tmp_path, co):
    """Fault 6: two applies on a new workdir: the loser was told the folder is not sglpatch's
    (git init ran before the lock). Fault 5: the install ran after the lock was released: a second
    apply cleared the scratch folder and moved the tree mid-install."""
    wd = tmp_path / "new"
    first, base = _paused(tmp_path, co, "init", "apply", "--line", LINE, "--workdir", str(wd), "--source", "sdist", "--no-install")
    res = _run(tmp_path, co, "apply", "--line", LINE, "--workdir", str(wd), "--source", "sdist", "--no-install")
    assert res.returncode == 1 and f"another sglpatch command is working on {wd}" in res.stderr, res.stderr
    assert "not made by sglpatch" not in res.stderr
    Path(f"{base}.go").touch()
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    py = make_venv(tmp_path / "venv")
    first, base = _paused(tmp_path, co, "install:built", "apply", "--line", LINE, "--workdir", str(wd), "--source", "sdist",
                          "--python", str(py), "--installer", "pip")
    head = git(wd, "rev-parse", "patched")
    res = _run(tmp_path, co, "apply", "--workdir", str(wd), "--source", "sdist", "--no-install")  # would move the tree to the primary
    assert res.returncode == 1 and f"another sglpatch command is working on {wd}" in res.stderr, res.stderr
    assert git(wd, "rev-parse", "patched") == head
    Path(f"{base}.go").touch()
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0 and f"installed sglang {LINE} editable from {wd / 'python'} into {py}" in out, err[-3000:]


def test_watch_keeps_its_finished_report_beside_a_damaged_line_folder(tmp_path, co):
    """Fault 10: watch threw its finished report away (exit 1) over a lines/R/ it only lists."""
    bad = co / "lines" / "0.5.77"
    bad.mkdir()
    (bad / "series").write_text("")
    (bad / "upstream.lock").write_bytes((co / "upstream.lock").read_bytes())
    out = tmp_path / "w.json"
    res = sglpatch("watch", "--project", str(co), "--releases", LINE, "--json", str(out), timeout=900)
    assert res.returncode in (0, 3) and out.is_file(), res.stderr[-2000:]
    assert "release" in res.stdout and f"{bad}/upstream.lock pins" in res.stderr


def test_rough_edges_names_order_and_hints(tmp_path, co):
    from sglpatch import linepath, lines

    assert linepath.workdir_of(linepath.base("/x/fork/"), LINE) == Path(f"/x/fork-{LINE}")
    assert linepath.release_of(Path("/x/fork"), Path(f"/x/fork-{LINE}")) == LINE and linepath.release_of(Path("/x/fork"), Path("/x/fork-old")) is None
    assert sorted(["0.5.23.post1", "0.5.23rc1", "0.5.23"], key=lines._vkey) == ["0.5.23rc1", "0.5.23", "0.5.23.post1"]
    for name in ("../x", "--foo"):
        res = _run(tmp_path, co, "status", f"--line={name}")
        assert res.returncode == 2 and "rebase --onto" not in res.stderr and "named by its release" in res.stderr, res.stderr


def _state(wd: Path) -> dict:
    """A workdir as a byte-for-byte witness: every ref, its config, its index and every file's bytes."""
    files = {p.relative_to(wd).as_posix(): p.read_bytes() for p in sorted(wd.rglob("*")) if p.is_file() and not p.is_symlink()
             and ".git/objects/" not in p.as_posix()}
    return {"refs": git(wd, "for-each-ref"), "head": git(wd, "symbolic-ref", "-q", "HEAD"), "files": files}


def test_line_makes_each_command_act_on_that_lines_tree_and_nothing_of_the_primarys(tmp_path, co):
    """--line 0.5.23 on status, check, rebase --dry-run, watch (and a real rebase's refusal): each says
    which line it used, reads that line's series and tree, and leaves the primary's workdir (and,
    as they only read, the line's) exactly as it was."""
    fork, wd = tmp_path / "fork", tmp_path / f"fork-{LINE}"
    for args in ((), ("--line", LINE)):
        res = _run(tmp_path, co, "apply", *args, "--source", "sdist", "--no-install")
        assert res.returncode == 0, res.stderr[-2000:]
    before, before_line, project = _state(fork), _state(wd), _tree(co)
    names = [n.split("-")[0] for n in (co / "lines" / LINE / "series").read_text().split() if n.endswith(".patch")]
    res = _run(tmp_path, co, "status", "--line", LINE)
    assert res.returncode == 0 and f"line:     {LINE}, from lines/{LINE}/" in res.stdout and str(wd) in res.stdout, res.stdout
    assert str(fork) + "\n" not in res.stdout and f"{fork} " not in res.stdout
    res = _run(tmp_path, co, "check", "--line", LINE)
    assert res.returncode == 0 and f"check: line {LINE} (lines/{LINE}/)" in res.stderr, res.stderr[-2000:]
    res = _run(tmp_path, co, "rebase", "--line", LINE, "--onto", "0.5.10", "--dry-run")  # the line's 2 patches, not the primary's
    assert res.returncode == 3 and f"rebase: line {LINE} (lines/{LINE}/), workdir {wd}" in res.stderr, res.stderr[-2000:]
    assert f"upstream watch: sglang {LINE}" in res.stdout and "0002-" not in res.stdout and all(n in res.stdout for n in names), res.stdout
    res = _run(tmp_path, co, "rebase", "--line", LINE, "--onto", "0.5.10.post1")  # a real rebase starts from the primary: one line
    assert res.returncode == 2 and f"not from the line {LINE}; nothing was changed" in res.stderr, res.stderr[-2000:]
    res = _run(tmp_path, co, "rebase", "--line", LINE, "--continue")  # --line names a new rebase's series, never a resumed one
    assert res.returncode == 2 and "--line go with a new rebase" in res.stderr, res.stderr[-2000:]
    res = _run(tmp_path, co, "watch", "--line", LINE, "--releases", LINE)
    assert res.returncode == 0 and f"watch: line {LINE} (lines/{LINE}/)" in res.stderr, res.stderr[-2000:]
    header = next(ln for ln in res.stdout.splitlines() if ln.startswith("release "))
    assert header.split() == ["release", *(f"P{int(n)}" for n in names), "verdict"], res.stdout  # P1 P4: the line's columns
    assert _state(fork) == before and _state(wd) == before_line and _tree(co) == project


def test_source_auto_is_one_decision_of_the_context_for_every_command(tmp_path, co):
    """--source auto: apply and rebase each decided it their own way and check could not take it;
    now the context decides it once per command by one rule (sglpatch.upstream.materialize.choose_source) and
    says so once, for the line's own pin or a rebase's target."""
    import re

    src = ROOT / "src" / "sglpatch"
    deciding = {p.relative_to(src).as_posix() for p in src.rglob("*.py") if re.search(r"\b(choose_source|source_reachable)\(", p.read_text())}
    assert deciding == {"context.py", "upstream/materialize.py"}, deciding
    for lock in (co / "upstream.lock", co / "lines" / LINE / "upstream.lock"):
        lock.write_text(lock.read_text().replace('url = "https://github.com/sgl-project/sglang"', 'url = "https://127.0.0.1:9/nowhere/sglang"'))
    # the registry's artifact is named by its kind: the primary's sdist, the line's wheel (issue 50: "sdist (... .whl)")
    res = _run(tmp_path, co, "check", "--line", LINE, "--source", "auto")
    assert res.returncode == 0 and res.stderr.count("sglpatch: source: wheel (https://127.0.0.1:9/nowhere/sglang ") == 1, res.stderr
    assert f"the registry's {read_lock(co / 'lines' / LINE).sdist_filename}, as the lock pins it" in res.stderr
    res = _run(tmp_path, co, "check", "--source", "auto")
    assert res.returncode == 0 and res.stderr.count("sglpatch: source: sdist (https://127.0.0.1:9/nowhere/sglang ") == 1, res.stderr
    assert f"the registry's {read_lock(co).sdist_filename}, as the lock pins it" in res.stderr
    res = _run(tmp_path, co, "rebase", "--line", LINE, "--onto", "0.5.10", "--dry-run", "--source", "auto")
    assert res.returncode == 3 and res.stderr.count("sglpatch: source: sdist (") == 1, res.stderr[-2000:]
    assert "the registry has the sdist of 0.5.10" in res.stderr


def test_a_rebase_holds_the_workdirs_own_lock_as_every_change_does(tmp_path, co):
    """The rebase (and bisect) took only .git/sglpatch.lock by hand; now each holds the workdir
    object's lock (the folder's and that file, as apply's transaction): a second command is told
    by the one owner of DIR's lock that another command works there, and changes nothing."""
    fork = tmp_path / "fork"
    res = _run(tmp_path, co, "apply", "--source", "sdist", "--no-install")
    assert res.returncode == 0, res.stderr[-2000:]
    head = git(fork, "rev-parse", "patched")
    proc, _ = _paused(tmp_path, co, "rebase:upstream", "rebase", "--onto", "0.5.10", "--workdir", str(fork))
    try:
        res = _run(tmp_path, co, "apply", "--source", "sdist", "--no-install", "--force")
        assert res.returncode == 1 and f"another sglpatch command is working on {fork} (setting it up, installing, exporting, rebasing" in res.stderr
        assert "is locked" not in res.stderr and git(fork, "rev-parse", "patched") == head, res.stderr
    finally:
        proc.kill()
        proc.communicate()


def test_an_error_in_a_lines_series_names_that_lines_file(tmp_path, co):
    """A bad entry on line 6 of lines/0.5.23/series was reported as `series:6` (the primary's file)."""
    series = co / "lines" / LINE / "series"
    text = series.read_text().splitlines()
    assert len(text) == 5  # three comment lines, P1, P4
    series.write_text("\n".join([*text, text[3] + " -p2"]) + "\n")
    res = _run(tmp_path, co, "check", "--line", LINE)
    assert res.returncode != 0 and f"lines/{LINE}/series:6: unknown option '-p2'" in res.stderr.strip().splitlines()[-1], res.stderr
    (co / "series").write_text((co / "series").read_text() + "0001-sm120-flashinfer-allreduce-fusion.patch\n")  # the primary: series:N
    res = _run(tmp_path, co, "check")
    assert res.returncode != 0 and f"series:{len((co / 'series').read_text().splitlines())}: " in res.stderr and "lines/" not in res.stderr


def test_mutants_builds_the_committed_lines_tree_through_the_context(tmp_path, capfd):
    """tests/mutants.py replayed a rebase to get the 0.5.23 tree; it now builds the committed line
    (lines/0.5.23/) as `apply --line` does, resolved by the context, says which line, and every
    0.5.23 mutant applies there."""
    import mutants

    from sglpatch.series import read_series

    tree = mutants.build_tree(LINE, tmp_path / LINE)
    assert f"mutants: line {LINE} (lines/{LINE}/), tree {tmp_path / LINE / 'wd'}" in capfd.readouterr().err
    subjects = git(tree, "log", "--reverse", "--format=%s", "upstream..patched").splitlines()
    assert len(subjects) == len(read_series(ROOT / "lines" / LINE).names) and mutants.check(LINE, tree) == []


def test_the_wheel_for_another_python_must_carry_the_locks_sources(tmp_path):
    """The cp312 wheel supplies only compiled extensions: a file the lock pins that differs there
    refuses it, and nothing is written beside the tree."""
    from sglpatch import lineguard, lines
    from sglpatch.errors import SglpatchError

    ln = lines.find(ROOT, LINE)
    rel = next(iter(ln.lock.blobs))
    ln.lock.blobs = {rel: "0" * 40}  # in memory only
    with pytest.raises(SglpatchError, match=rf"cp312-cp312-manylinux_2_34_x86_64.whl: {rel} is not the file lines/{LINE}/upstream.lock pins"):
        lineguard.compiled_for(tmp_path, ln, "cp312", sys.executable)
    assert not any(tmp_path.rglob("*"))


def test_a_new_venv_of_another_cpython_gets_the_releases_own_extensions(tmp_path, disk_tmp_path, co):
    """Fault 8 through --venv NEWDIR: the new venv is of the base Python's CPython (3.12 to apply's
    probe), so the line's cp311 tree takes the release's own cp312 extensions before the install
    into the new venv (the plan: a fake release artifact on a local index, as tests/test_venv_preflight.py);
    a base Python the release has no wheel for is refused before any venv is made."""
    from test_venv_preflight import release, wheel

    index = tmp_path / "index"
    wheel(index, "sglpatch-fake-dep", "1.0")
    art = release(tmp_path, ["sglpatch-fake-dep==1.0"], version=LINE)
    base = make_venv(tmp_path / "base")
    shim = tmp_path / "py312"
    shim.write_text(f"#!/bin/bash\nif [[ \"$*\" == *\"importlib.metadata as m, importlib.util\"* ]]; then printf '\\n\\ncp39\\n'; exit 0; fi\n"
                    f"exec {base} \"$@\"\n")
    shim.chmod(0o755)
    env = dict(PIP_FIND_LINKS=str(index), PATH=f"{tmp_path / 'nobin'}:{os.environ['PATH']}")
    args = ("apply", "--line", LINE, "--source", "sdist", "--venv", str(disk_tmp_path / "new"), "--release-artifact", str(art),
            "--python", str(shim), "--installer", "pip")
    res = _run(tmp_path, co, *args, **env)
    assert res.returncode == 2 and "(Python 3.9)" in res.stderr and "--venv NEWDIR --python PY3.11" in res.stderr, res.stderr[-2000:]
    assert not (disk_tmp_path / "new").exists() and not (tmp_path / f"fork-{LINE}").exists()
    shim.write_text(shim.read_text().replace("cp39", "cp312"))
    res = _run(tmp_path, co, *args, **env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    wd = tmp_path / f"fork-{LINE}"
    assert "for Python 3.12: " in res.stderr and list(wd.rglob("*.cpython-312-x86_64-linux-gnu.so")), res.stderr[-2000:]
    assert f"installed sglang {LINE} editable from {wd}/python into {disk_tmp_path / 'new'}/bin/python" in res.stdout
    assert git(wd, "status", "--porcelain") == "" and "sglpatch-fake-dep" in subprocess.run(
        [str(disk_tmp_path / "new" / "bin" / "python"), "-m", "pip", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("args", [("lines",), ("status", "--line", LINE), ("apply", "--line", LINE, "--no-install"),
                                  ("bisect", "--triage", "--", "true")])
def test_the_filesystem_root_as_workdir_is_one_line(tmp_path, args):
    """SGLANG_FORK_DIR=/ (or --workdir /): one line naming it, exit 2; was a ValueError traceback."""
    res = sglpatch(*args, cwd=ROOT, env=dict(os.environ, SGLANG_FORK_DIR="/"))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"sglpatch: error: SGLANG_FORK_DIR=/: the workdir cannot be the filesystem root; name a folder of its own, "
        f"e.g. {Path.home() / 'sglang-fork'}"], res.stderr
    res = sglpatch("status", "--workdir", "/", cwd=ROOT)
    assert res.returncode == 2 and "sglpatch: error: --workdir /: the workdir cannot be the filesystem root" in res.stderr
