"""Every supported line in the checkout at once (issue 27): the primary (series, patches/,
upstream.lock) and lines/<release>/, each built into a workdir of its own without rewriting the
checkout. Real git clone of this repository, the real 0.5.9 sdist and 0.5.23 wheel, real pip into
scratch venvs; the series is read from the files (another helper adds patches to the primary)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import ROOT, git, make_venv, run_cli, sglpatch, sglpatch_inproc
from sglpatch.upstream.pin import read_lock
from sglpatch.series import read_series

pytestmark = pytest.mark.slow
LINE = "0.5.23"
P4_0523 = "python/sglang/srt/speculative/spec_profiler.py"


@pytest.fixture(scope="module")
def wheel_0523() -> Path:
    """The 0.5.23 line's wheel in the test cache (index-verified), where `sglpatch lines` reads its Requires-Dist."""
    from conftest import cache_lock
    from sglpatch.upstream import artifacts

    lock = read_lock(ROOT / "lines" / LINE)
    with cache_lock():
        return artifacts.fetch(lock.name, lock.version, "wheel", expect_sha256=lock.sdist_sha256)[1]


def test_lines_lists_each_line_with_its_pin_patches_upstream_and_driver(sdist_059, wheel_0523):
    res = sglpatch_inproc("lines", "--workdir", "/nonexistent/fork")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    primary, line = out.split(f"\n{LINE}: lines/{LINE}/\n")
    v = read_lock(ROOT).version
    assert primary.startswith(f"{v} (primary): series, patches/, upstream.lock\n")
    assert f"  patches:  {len(read_series(ROOT).names)}\n" in primary
    assert all(f"\n    {n}\n" in primary for n in read_series(ROOT).names)
    assert "  upstream: nothing of the primary series\n" in primary
    assert "  driver:   CUDA 12: an NVIDIA driver >= 525.60.13 (Requires-Dist: cuda-python==12.9)\n" in primary
    assert "  workdir:  /nonexistent/fork (sglpatch apply)" in primary
    names = read_series(ROOT / "lines" / LINE).names
    assert f"  pin:      sglang {LINE} (v{LINE}, commit unknown), wheel {read_lock(ROOT / 'lines' / LINE).sdist_filename}\n" in line
    assert f"  patches:  {len(names)}\n" in line and names == ["0001-sm120-flashinfer-allreduce-fusion.patch", "0004-eagle-verify-profiling.patch"]
    dropped = [n for n in read_series(ROOT).names if n not in names]
    assert f"  upstream: {len(dropped)}\n" in line
    assert ("    0002-pcie-custom-allreduce.patch: superseded by upstream's FlashInfer PCIe-IPC allreduce (recorded: resolutions/0.5.23/)\n"
            in line)
    assert "    0003-kimi-k25-eagle3-delegation.patch: absorbed upstream (v0.5.10, https://github.com/sgl-project/sglang/pull/19689)\n" in line
    assert "  driver:   CUDA 13: an NVIDIA driver >= 580 (Requires-Dist: cuda-python>=13.0); below that, " in line
    assert f"  workdir:  /nonexistent/fork-{LINE} (sglpatch apply --line {LINE})" in line


def test_lines_lists_what_is_on_disk_and_fetches_nothing(tmp_path, sdist_059):
    """Issue 50: `sglpatch lines` downloaded the 39 MB 0.5.23 wheel to read its Requires-Dist. It reads the
    release files the cache holds (checked against the lock's sha256) and names the command that fetches
    the others; the package index (a local server that counts what it is asked) is asked nothing."""
    import http.server
    import shutil
    import threading

    asked: list[str] = []

    class Counting(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            asked.append(self.path)
            self.send_error(404)

        do_HEAD = do_GET

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    shutil.copy(sdist_059, cache / "sdist" / sdist_059.name)
    try:
        res = sglpatch("lines", "--workdir", "/nonexistent/fork",
                       env={"SGLPATCH_CACHE": str(cache), "PIP_INDEX_URL": f"http://127.0.0.1:{srv.server_port}/simple"})
    finally:
        srv.shutdown()
    assert res.returncode == 0, res.stderr[-2000:]
    assert asked == [] and sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) == [f"sdist/{sdist_059.name}"]
    primary, line = res.stdout.split(f"\n{LINE}: lines/{LINE}/\n")
    assert "  driver:   CUDA 12: an NVIDIA driver >= 525.60.13 (Requires-Dist: cuda-python==12.9)\n" in primary  # the cached sdist's
    whl = read_lock(ROOT / "lines" / LINE).sdist_filename
    assert (f"  driver:   not read: {whl} is not in the cache (`sglpatch apply --line {LINE} --venv NEWDIR --dry-run` fetches it "
            "and reads it)\n") in line, line
    assert f"  pin:      sglang {LINE} (v{LINE}, commit unknown), wheel {whl}\n" in line


def test_cuda_of_reads_the_highest_major_a_requirement_names():
    from sglpatch.commands.lines import cuda_of

    assert cuda_of(["torch==2.9.1", "cuda-python==12.9"]) == (12, "cuda-python==12.9")
    assert cuda_of(["cuda-python==12.9", "flashinfer_python[cu13]==0.7.2"]) == (13, "flashinfer_python[cu13]==0.7.2")
    assert cuda_of(["nvshmem4py-cu13", "cuda-python==12.9"]) == (13, "nvshmem4py-cu13")
    assert cuda_of(["cuda-bindings>=13.0; sys_platform == 'linux'"]) == (13, "cuda-bindings>=13.0")
    assert cuda_of(["torch==2.14.1", "kernels<0.15"]) == (None, "")


def test_an_unknown_line_is_a_usage_error_naming_those_there_are(tmp_path):
    res = sglpatch_inproc("apply", "--line", "0.5.99", "--workdir", str(tmp_path / "wd"), "--no-install")
    v = read_lock(ROOT).version
    assert res.returncode == 2 and not (tmp_path / "wd").exists()
    assert f"no line 0.5.99 in {ROOT} (lines: {v} (primary), {LINE}); `sglpatch rebase --onto 0.5.99` makes it" in res.stderr


def _scratch(path: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(path)  # uv installs: no pip needed
    return path / "bin" / "python"


def _origin(py: Path) -> str:
    code = "import importlib.util as u; print(u.find_spec('sglang').origin)"
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout.strip()


def _version(py: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout.strip()


def tool_venv(top: Path, co: Path) -> Path:
    """The clone's tool venv, ready as scripts/lib.sh checks it (its stamp), sharing this
    interpreter's packages: the scripts run the sglpatch under test (PYTHONPATH) on the clone."""
    import hashlib

    d = top / "tool-venv"
    if not d.is_dir():
        # the sglpatch under test (an editable install's finder is not seen through the parent .pth)
        import sglpatch

        make_venv(d, also=(Path(sglpatch.__file__).resolve().parents[1],))
        key = hashlib.sha256((co / "pyproject.toml").read_bytes()).hexdigest()
        (d / ".sglpatch-tool").write_text(f"{co} {key}\n")
    return d


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    top = tmp_path_factory.mktemp("lines")
    dest = top / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(dest)], check=True)
    return top, dest


def test_both_lines_side_by_side_in_a_fresh_clone(clone):
    """apply --line 0.5.23 installs the patched 0.5.23 into a scratch venv; the serving venv keeps
    the primary; a later plain scripts/apply.sh leaves ~/sglang-fork on the primary and the
    checkout's files unchanged; moving the served tree to 0.5.23 is refused with a command that
    works as typed."""
    top, co = clone
    home = top / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    base_env = {k: v for k, v in os.environ.items() if k != "SGLANG_FORK_DIR"}
    base_env["PATH"] = f"{Path(sys.executable).parent}:{base_env['PATH']}"  # the test venv's uv, as an activated venv has it

    def run(*args):
        return run_cli(list(args), dict(base_env, **env), co, 900)

    primary = read_lock(co).version
    serve, scratch = _scratch(top / "serve"), _scratch(top / "scratch")
    fork, fork_line = home / "sglang-fork", home / f"sglang-fork-{LINE}"
    # the serving venv on the primary (the README's first command)
    res = run("apply", "--source", "sdist", "--python", str(serve), "--installer", "uv")  # as the user installs
    assert res.returncode == 0, res.stderr[-3000:]
    assert _origin(serve) == str(fork / "python" / "sglang" / "__init__.py")
    # the 0.5.23 line into the scratch venv: its own workdir, the checkout untouched
    res = run("apply", "--line", LINE, "--source", "sdist", "--python", str(scratch), "--installer", "uv")
    assert res.returncode == 0, res.stderr[-3000:]
    names = read_series(co / "lines" / LINE).names
    assert f"installed sglang {LINE} editable from {fork_line / 'python'} into {scratch}" in res.stdout
    assert f"{fork_line} (branch patched, line {LINE}) carries {len(names)} patches:" in res.stdout
    assert _version(scratch) == LINE and _origin(scratch) == str(fork_line / "python" / "sglang" / "__init__.py")
    assert (fork_line / P4_0523).is_file() and "SGLANG_VERIFY_PROFILE" in (fork_line / "python/sglang/srt/environ.py").read_text()
    assert git(co, "status", "--porcelain") == ""
    st = run("status")  # which line each workdir holds
    assert st.returncode == 0 and f"line:     {primary} (primary), from series, patches/, upstream.lock" in st.stdout, st.stdout
    st = run("status", "--line", LINE)
    assert st.returncode == 0 and f"line:     {LINE}, from lines/{LINE}/" in st.stdout and "in sync with the series" in st.stdout
    # a later plain scripts/apply.sh: the served tree stays on the primary, the checkout unchanged
    head = git(fork, "rev-parse", "patched")
    sh = subprocess.run(["bash", str(co / "scripts" / "apply.sh"), "--python", str(serve), "--source", "sdist"], cwd=co,
                        capture_output=True, text=True, env=dict(base_env, SGLPATCH_TOOL_VENV=str(tool_venv(top, co)), **env),
                        timeout=900)
    assert sh.returncode == 0, sh.stdout[-2000:] + sh.stderr[-3000:]
    assert "is up to date" in sh.stdout and git(fork, "rev-parse", "patched") == head
    assert _version(serve) == primary and git(co, "status", "--porcelain") == ""
    # moving the served tree to the 0.5.23 line is refused before any work; the fix works as typed
    res = run("apply", "--line", LINE, "--workdir", str(fork), "--source", "sdist", "--no-install")
    assert res.returncode == 1 and git(fork, "rev-parse", "patched") == head, res.stderr
    assert f"{serve} imports sglang from {fork} (editable): moving that tree from {primary} to {LINE}" in res.stderr
    fix = re.search(r"Build it in a workdir of its own: `(sglpatch [^`]+)`", res.stderr).group(1)
    assert fix == f"sglpatch apply --line {LINE} --workdir {fork}-{LINE} --no-install"
    done = run(*shlex.split(fix)[1:], "--source", "sdist")
    assert done.returncode == 0 and "is up to date" in done.stdout, done.stderr[-2000:]
    # a rebase never moves the served tree either
    rb = run("rebase", "--onto", "0.5.10.post1", "--workdir", str(fork))
    assert rb.returncode == 1 and f"{serve} imports sglang from {fork} (editable): moving that tree onto 0.5.10.post1" in rb.stderr
    assert git(fork, "rev-parse", "patched") == head and git(co, "status", "--porcelain") == ""
    # its fix, typed as shown (a shell line): the line is rebased in its own workdir into lines/ only
    fix = re.search(r"Build it in a workdir of its own: `([^`]+)`", rb.stderr).group(1)
    own = f"{fork}-0.5.10.post1"
    assert fix == f"sglpatch apply --workdir {own} --no-install && sglpatch rebase --onto 0.5.10.post1 --workdir {own}"
    shell_env = dict(base_env, **env)
    done = subprocess.run(["bash", "-c", fix], cwd=co, capture_output=True, text=True, env=shell_env, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert git(co, "status", "--porcelain") == "?? lines/0.5.10.post1/" and git(fork, "rev-parse", "patched") == head
    st = run("status", "--workdir", own)
    assert "line:     0.5.10.post1, from lines/0.5.10.post1/" in st.stdout and "in sync with the series" in st.stdout, st.stdout


def test_bisect_line_names_the_first_bad_patch_of_the_0523_line(tmp_path):
    """bisect --line 0.5.23 runs over the 0.5.23 line's stack and names the patch by that line's
    series (here the 0.5.23 port of P4, the second of its patches, not the primary's second)."""
    wd = tmp_path / "wd"
    res = sglpatch("apply", "--line", LINE, "--workdir", str(wd), "--source", "sdist", "--no-install")
    assert res.returncode == 0, res.stderr[-2000:]
    names = read_series(ROOT / "lines" / LINE).names
    bad = "0004-eagle-verify-profiling.patch"
    cmd = ["--", "sh", "-c", f"test ! -f {wd / P4_0523}"]
    res = sglpatch("bisect", "--line", LINE, "--project", str(ROOT), "--workdir", str(wd), *cmd, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert f"  patch:       {bad} (#{names.index(bad) + 1} of {len(names)})\n" in res.stdout, res.stdout
    assert git(wd, "rev-parse", "--abbrev-ref", "HEAD") == "patched" and git(wd, "status", "--porcelain") == ""
    # a rebase starts from the primary: on this workdir (it holds the 0.5.23 line) it refuses, naming
    # the command that puts the primary back, which works typed as shown in the checkout
    rb = sglpatch("rebase", "--onto", "0.5.10.post1", "--workdir", str(wd), cwd=ROOT)
    assert rb.returncode == 1 and f"{wd} does not hold the primary series on {read_lock(ROOT).version}" in rb.stderr, rb.stderr
    fix = re.search(r"`(sglpatch apply --workdir \S+ --no-install)` builds it", rb.stderr).group(1)
    assert fix == f"sglpatch apply --workdir {wd} --no-install"
    done = sglpatch(*shlex.split(fix)[1:], "--source", "sdist", cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    st = sglpatch("status", "--workdir", str(wd), cwd=ROOT)
    assert f"line:     {read_lock(ROOT).version} (primary)" in st.stdout and "in sync with the series" in st.stdout, st.stdout
    sglpatch("apply", "--line", LINE, "--workdir", str(wd), "--source", "sdist", "--no-install")
    # export writes the line the workdir holds, never the primary; asking for another line is refused
    from conftest import copy_project

    co = copy_project(tmp_path / "co")
    primary = (co / "series").read_bytes()
    ex = sglpatch("export", "--project", str(co), "--workdir", str(wd))
    assert ex.returncode == 0 and f"exported {len(names)} patches: 0 written, {len(names)} unchanged, 0 removed" in ex.stdout, ex.stderr
    v = read_lock(co).version
    ex = sglpatch("export", "--project", str(co), "--line", v, "--workdir", str(wd))
    assert ex.returncode == 2 and (co / "series").read_bytes() == primary
    fix = re.search(r"`(sglpatch export [^`]+)`", ex.stderr).group(1)
    assert fix == f"sglpatch export --line {LINE} --workdir {wd}" and f"{wd} holds the line {LINE}, not the line {v}" in ex.stderr
    assert sglpatch(*shlex.split(fix)[1:], cwd=co).returncode == 0 and (co / "series").read_bytes() == primary
    # regress labels what served with the line the workdir holds, its patches named by that line
    from sglpatch.gpu.shared.series_side import patches_of
    from sglpatch.gpu.server.report import served_markdown

    by = dict(patches_of(ROOT, wd), workdir=str(wd), python="py", sglang_version=LINE, sglang_file="f")
    assert by["line"] == f"{LINE} (lines/{LINE}/)" and [c.split(":")[0] for c in by["carried"]] == names
    md = "\n".join(served_markdown(by, []))
    assert f"- workdir `{wd}`, line {LINE} (lines/{LINE}/), carries {len(names)} patch(es): {names[0]}: " in md


def test_apply_line_venv_builds_a_new_venv_from_the_lines_own_tree(tmp_path):
    """`apply --line 0.5.23 --venv NEW`, not a dry run, on CPU: the plan from a local index (a fake
    release artifact pinning one small wheel), the new venv created, the 0.5.23 line built in its
    own workdir (~/sglang-fork-0.5.23, no second suffix) and installed into it editable with the
    release wheel's METADATA, the venv marked complete, the summary printed."""
    from test_venv_preflight import UV, release, wheel

    if not UV:
        pytest.skip("uv not found")
    index, empty, home = tmp_path / "index", tmp_path / "empty", tmp_path / "home"
    empty.mkdir()
    home.mkdir()
    wheel(index, "sglpatch-fake-dep", "1.0")
    art = release(tmp_path, ["sglpatch-fake-dep==1.0"], version=LINE)
    new = tmp_path / "new"
    e = {"HOME": str(home), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "UV_DEFAULT_INDEX": f"file://{empty}",
         "UV_FIND_LINKS": str(index), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index)}
    proc = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--line", LINE, "--source", "sdist", "--venv", str(new),
                           "--release-artifact", str(art), "--python", sys.executable, "--installer", "uv"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env=dict({k: v for k, v in os.environ.items() if k != "SGLANG_FORK_DIR"}, **e))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wd = home / f"sglang-fork-{LINE}"
    names = read_series(ROOT / "lines" / LINE).names
    assert "preflight: verdict: pass" in proc.stdout and "the release's pins: sglpatch-fake-dep==1.0" in proc.stdout
    assert f"installed sglang {LINE} editable from {wd / 'python'} into {new}/bin/python" in proc.stdout
    assert f"new venv {new}: 1 packages" in proc.stdout and f"{wd} (branch patched, line {LINE}) carries {len(names)} patches:" in proc.stdout
    assert _version(new / "bin" / "python") == LINE and _origin(new / "bin" / "python") == str(wd / "python" / "sglang" / "__init__.py")
    assert not (home / "sglang-fork").exists() and not Path(f"{wd}-{LINE}").exists()
    again = subprocess.run([sys.executable, "-m", "sglpatch.cli", "apply", "--line", LINE, "--venv", str(new), "--source", "sdist",
                            "--release-artifact", str(art), "--python", sys.executable], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, **e))
    assert again.returncode == 1 and "exists and is not empty" in again.stderr, again.stderr  # complete: not rebuilt


def test_line_folders_are_checked_and_a_damaged_one_stops_only_what_reads_it(tmp_path):
    """lines/<R>/ is untrusted input: a link, a name that is no release or a folder without lock and
    series is not a line; a lock pinning another release is one line naming the fix; the primary
    (plain apply, status) is read without the line folders."""
    from conftest import copy_project
    from sglpatch import lines

    co = copy_project(tmp_path / "co")
    (co / "lines" / "notes").mkdir()
    (co / "lines" / "0.6.0").mkdir()  # no lock, no series
    (tmp_path / "elsewhere").mkdir()
    (co / "lines" / "0.7.0").symlink_to(tmp_path / "elsewhere")
    assert [ln.release for ln in lines.all_lines(co)] == [read_lock(co).version, LINE]
    assert lines.dest("0.5.10.post1") == "lines/0.5.10.post1"
    with pytest.raises(Exception, match="not a release version"):
        lines.dest("../x")
    bad = co / "lines" / "0.5.77"
    bad.mkdir()
    (bad / "series").write_text("")
    (bad / "upstream.lock").write_bytes((co / "upstream.lock").read_bytes())
    res = sglpatch_inproc("lines", "--project", str(co))
    assert res.returncode == 1 and f"{bad}/upstream.lock pins {read_lock(co).version}, not the line's release 0.5.77" in res.stderr
    assert lines.at(co).primary and lines.at(co / "lines" / LINE).release == LINE and not lines.at(co / "lines" / LINE).primary
    # the damaged folder is left out, the others still answer (issue 37, fault 1)
    assert lines.holding(co, read_lock(co).pin_digest()).primary
