"""Shared fixtures: the real SGLang sdists (downloaded once), real git workdirs, the patched tree.

* ``project_root``: this repository (series, patches/, upstream.lock).
* ``project_copy``: a throw-away copy of the project files, for tests that edit the series.
* ``sdist_059`` / ``sdist_0510``: paths of the verified registry sdists (cached in $SGLPATCH_CACHE).
* ``patched_tree``: a workdir where ``sglpatch apply`` built the committed series on 0.5.9.
* ``patched_python`` / ``run_patched``: a venv where ``import sglang`` is that patched tree
  (``pip install --no-deps -e``), and a helper that runs code in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the committed series, read once: tests count and name its patches from here, not from a literal
SERIES = [ln.strip() for ln in (ROOT / "series").read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
# tests/real_0523/ runs inside the 0.5.23 venv only (tests/test_port_0523.py starts it with
# SGLPATCH_REAL_0523 set); not descending into it here keeps its conftest from shadowing this one
collect_ignore = [] if os.environ.get("SGLPATCH_REAL_0523") else ["real_0523"]
os.environ["SGLPATCH_TEST_HOOKS"] = "1"  # sglpatch.fsutil.crashpoint: the fault hooks work only under the tests


def test_cache() -> Path:
    """The tests' own cache (downloaded sdists, the tree cache), never the user's ~/.cache/sglpatch:
    $SGLPATCH_TEST_CACHE when set (e.g. to the user's cache, when asked), else beside the test venv
    (kept between runs, like the venv), else one per user under the temp folder. Chosen once, so
    xdist workers and the runs tests start share it."""
    asked = os.environ.get("SGLPATCH_TEST_CACHE")
    if asked:
        return Path(asked)
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "sglpatch-test-cache"
    return Path(tempfile.gettempdir()) / f"sglpatch-test-cache-{os.getuid()}"


TEST_CACHE = test_cache()
os.environ["SGLPATCH_TEST_CACHE"] = os.environ["SGLPATCH_CACHE"] = str(TEST_CACHE)


@contextlib.contextmanager
def cache_lock():
    """The test cache's lock: the first xdist worker (or a second session) fills the cache while the
    others wait, then reuse what it wrote (the tool's cache has no lock of its own)."""
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / ".tests.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def seed_sdists() -> None:
    """Copy the user's cached SGLang sdists (regular files only) into the test cache when it lacks
    them: read-only use of the user's cache, and safe, as every sdist is checked against the sha256
    upstream.lock pins before use. SGLPATCH_TEST_NO_SEED=1: download them instead."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglpatch" / "sdist"
    if os.environ.get("SGLPATCH_TEST_NO_SEED") or not user.is_dir() or user.resolve() == (TEST_CACHE / "sdist").resolve():
        return
    for src in user.glob("sglang-*.tar.gz"):
        dest = TEST_CACHE / "sdist" / src.name
        if src.is_file() and not src.is_symlink() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{src.name}.{os.getpid()}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)

try:  # the GPU tests run on machines without GitPython; they need none of this
    from sglpatch.upstream import artifacts  # noqa: E402
    from sglpatch.stack import build as stack
    from sglpatch.upstream.pin import Lock, read_lock  # noqa: E402
except ImportError:  # pragma: no cover
    artifacts = stack = Lock = read_lock = None

SDIST_0510_SHA256 = "01f7adfe7cde85b238fb0e1bae4b31d494e19d1471cf35ff3c5489a02f9d2263"
PROJECT_FILES = ("series", "upstream.lock", "patches", "resolutions", "CHANGELOG.md", "lines")


# The end-to-end files (each a minute or more of real applies, rebases, venvs, servers and faults,
# measured with --durations): marked `slow`, so that `scripts/test.sh --quick` (-m "not slow") runs
# the unit and patch tests only.
END_TO_END = {
    "test_apply_cli.py", "test_cli_first_contact.py", "test_doctor.py", "test_failure_modes.py", "test_failure_modes_2.py",
    "test_kernel_candidates.py", "test_kernel_stress.py", "test_port_0523.py", "test_rebase.py", "test_regress_ab.py",
    "test_regress_server.py", "test_scripts_fresh_shell.py", "test_stack.py", "test_venv_preflight.py", "test_watch.py",
    "test_jitcheck.py",
    # real installs, applies from the cache and rebase faults too (1.6 min -> 5 min for --quick with them in)
    "test_failure_modes_3.py", "test_failure_modes_4.py", "test_flashinfer_set.py", "test_install_wheel_tree.py", "test_rebase_tree_check.py",
    "test_unpack.py", "test_line_context.py",
}


# How the suite spreads over xdist workers (scripts/test.sh: --dist loadgroup --no-loadscope-reorder):
# a file's tests stay together on one worker (its module fixtures are built once), except the
# files in SPLIT, cut into that many groups of consecutive tests (their fixtures are per process
# and cheap next to their tests); the files go out heaviest first (COST: CPU seconds measured
# with SGLPATCH_TEST_CPU_LOG; a file not listed counts 0.2 s a test), so that no worker is handed a
# long file last. A new slow file belongs in COST; one over about 150 CPU-s without module
# fixtures, in SPLIT too. (The groups are made here, by nodeid, not with xdist_group marks:
# xdist 3.8's loadgroup cannot rename pytest 9's node ids.)
SPLIT = {"test_failure_modes.py": 4, "test_failure_modes_2.py": 3}
PATCH_TESTS = "patches"
COST = {  # CPU seconds per file: a fresh-clone run of the suite after the CLI zygote (issue 29, 703 tests)
    "test_failure_modes.py": 265, "test_failure_modes_2.py": 176, "test_scripts_fresh_shell.py": 157,
    "test_kernel_candidates.py": 120, "test_regress_server.py": 105, "test_rebase.py": 88, "test_lines.py": 77,
    "test_port_0523.py": 74, "test_stack.py": 72, "test_regress_ab.py": 56, "test_watch.py": 53, "test_doctor.py": 45,
    "test_kernel_stress.py": 44, "test_unpack.py": 35, "test_apply_cli.py": 34, "test_venv_preflight.py": 30,
    "test_bisect.py": 27, "test_install_wheel_tree.py": 24, "test_cli_first_contact.py": 18, "test_rebase_tree_check.py": 17,
    "test_flashinfer_set.py": 17, "test_formatters.py": 15, "test_failure_modes_3.py": 11, "test_failure_modes_4.py": 14, "test_zygote.py": 9,
    "test_line_context.py": 31,
    "test_mergecheck.py": 8, "test_doctor_procs.py": 6, "test_doctor_pidns.py": 6,
    PATCH_TESTS: 48,  # tests/patches/, one group: one patched venv and one zygote, not one per worker
}


def group_of(path: str) -> str:
    """The xdist group of a test file (relative path): tests/patches/ is one."""
    return PATCH_TESTS if f"/{PATCH_TESTS}/" in f"/{path}" else path


def cost_of(path: Path, tests: int) -> float:
    return COST.get(PATCH_TESTS if PATCH_TESTS in path.parts[-2:-1] else path.name, 0.2 * tests)


def xdist_groups(nodeids: list) -> dict:
    """{nodeid: group}: its file (tests/patches/: one group), or for a file in SPLIT, one of that many
    runs of consecutive tests."""
    by_file: dict = {}
    for nodeid in nodeids:
        by_file.setdefault(nodeid.split("::")[0], []).append(nodeid)
    out = {}
    for path, ids in by_file.items():
        n = SPLIT.get(path.rsplit("/", 1)[-1], 1)
        for i, nodeid in enumerate(ids):
            out[nodeid] = group_of(path) if n == 1 else f"{path}#{i * n // len(ids)}"
    return out


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        """loadscope with SPLIT's groups: the work queue in collection order (heaviest file first)."""

        def _split_scope(self, nodeid: str) -> str:
            if getattr(self, "_groups", None) is None:
                self._groups = xdist_groups(list(self.collection))
            return self._groups[nodeid]

    return FileGroups(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in END_TO_END:
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # an xdist worker: heaviest file first (a serial run keeps pytest's order)
        count: dict = {}
        for item in items:
            count[item.path] = count.get(item.path, 0) + 1
        order = {id(item): k for k, item in enumerate(items)}
        items.sort(key=lambda item: (-cost_of(item.path, count[item.path]), str(item.path), order[id(item)]))


# Where the suite's CPU goes (load-independent, unlike --durations on a shared machine):
# SGLPATCH_TEST_CPU_LOG=FILE appends one JSON line per test phase (CPU seconds of this process and
# the children it waited for, and wall seconds), one per worker for its whole run, and prints the
# top 15 tests and the files by CPU at the end. scripts/test.sh sets it (sglpatch-test-cpu.jsonl in the
# test venv, emptied each run).
CPU_LOG = os.environ.get("SGLPATCH_TEST_CPU_LOG")
os.environ.setdefault("SGLPATCH_TEST_CPU_ROOT", str(os.getpid()))  # the pytest run (xdist's controller)
if os.getpid() != int(os.environ["SGLPATCH_TEST_CPU_ROOT"]) and not (
    os.environ.get("PYTEST_XDIST_WORKER") and os.getppid() == int(os.environ["SGLPATCH_TEST_CPU_ROOT"])
):
    CPU_LOG = None  # a pytest that a test started (tests/patches on a rebased tree): its CPU is that test's


_LIVE_ZYGOTES: list = []  # started, not closed: their children are not this process's children yet


def start_zygote(python: Path, env: dict, folder: Path, **kw):
    """zygote.start, with the zygote's children counted in this process's CPU until close_zygote."""
    import zygote

    zy = zygote.start(python, env, folder, **kw)
    if zy:
        _LIVE_ZYGOTES.append(zy)
    return zy


def close_zygote(zy) -> None:
    zy.close()  # waited for: its children's CPU is in RUSAGE_CHILDREN now
    _LIVE_ZYGOTES.remove(zy)


def _cpu_now() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + sum(zy.cpu for zy in _LIVE_ZYGOTES)


def _cpu_log(**rec) -> None:
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _timed(phase: str):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item):
        if not CPU_LOG:
            yield
            return
        c0, w0 = _cpu_now(), time.monotonic()
        yield
        _cpu_log(id=item.nodeid, phase=phase, cpu=round(_cpu_now() - c0, 3), wall=round(time.monotonic() - w0, 3))

    return hook


pytest_runtest_setup, pytest_runtest_call, pytest_runtest_teardown = (_timed(p) for p in ("setup", "call", "teardown"))


def pytest_sessionfinish(session):
    close_cli_zygotes()
    if CPU_LOG:  # each process's own total (collection and session teardowns included); xdist's
        # controller without its workers (they log their own)
        controller = not os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("dist") not in (None, "no")
        s = resource.getrusage(resource.RUSAGE_SELF)
        cpu = s.ru_utime + s.ru_stime if controller else _cpu_now()
        _cpu_log(id=os.environ.get("PYTEST_XDIST_WORKER", "main"), phase="process", cpu=round(cpu, 3), wall=0)


def pytest_terminal_summary(terminalreporter):
    if not CPU_LOG or os.environ.get("PYTEST_XDIST_WORKER") or not Path(CPU_LOG).is_file():
        return
    tests: dict = {}
    files: dict = {}
    total = 0.0
    for line in Path(CPU_LOG).read_text().splitlines():
        r = json.loads(line)
        if r["phase"] == "process":
            total += r["cpu"]
            continue
        t = tests.setdefault(r["id"], [0.0, 0.0])
        t[0], t[1] = t[0] + r["cpu"], t[1] + r["wall"]
        f = files.setdefault(r["id"].split("::")[0], [0.0, 0.0])
        f[0], f[1] = f[0] + r["cpu"], f[1] + r["wall"]
    say = terminalreporter.write_line
    say(f"CPU (user+sys, children waited for): {total:.0f} s in all processes; by test (cpu / wall s):")
    for name, (cpu, wall) in sorted(tests.items(), key=lambda kv: -kv[1][0])[:15]:
        say(f"  {cpu:8.1f} {wall:8.1f}  {name}")
    say("by file (cpu / wall s):")
    for name, (cpu, wall) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        say(f"  {cpu:8.1f} {wall:8.1f}  {name}")


@pytest.fixture(scope="session")
def project_root() -> Path:
    return ROOT


def copy_project(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture
def project_copy(tmp_path) -> Path:
    return copy_project(tmp_path / "project")


@pytest.fixture(scope="session")
def sdist_059() -> Path:
    with cache_lock():
        seed_sdists()
        return artifacts.fetch_sdist(read_lock(ROOT))


def lock_0510() -> "Lock":
    return Lock(
        name="sglang",
        url="https://github.com/sgl-project/sglang",
        tag="v0.5.10.post1",
        commit="0000000",  # replaced by tests that need it
        version="0.5.10.post1",
        sdist_filename="sglang-0.5.10.post1.tar.gz",
        sdist_sha256=SDIST_0510_SHA256,
        sdist_subdir="python",
    )


@pytest.fixture(scope="session")
def sdist_0510() -> Path:
    with cache_lock():
        seed_sdists()
        return artifacts.fetch_sdist(lock_0510())


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory, request) -> Path:
    given = os.environ.get("SGLPATCH_PATCHED_TREE")
    if given:  # e.g. the rebase test re-running the patch tests on the rebased tree
        return Path(given)
    installed = os.environ.get("SGLPATCH_PATCHED_PYTHON")
    if installed:  # the installed editable tree: <workdir>/python/sglang/__init__.py
        out = subprocess.run([installed, "-c", "import sglang; print(sglang.__file__)"], capture_output=True, text=True)
        assert out.returncode == 0, f"{installed} cannot import sglang: {out.stderr[-500:]}"
        return Path(out.stdout.strip().splitlines()[-1]).resolve().parents[2]
    request.getfixturevalue("sdist_059")  # fetched under the cache's lock
    with built_once(tmp_path_factory, "patched-fork") as (workdir, done):
        if not done:
            stack.apply(ROOT, workdir / "sglang-fork", source="sdist")
    return workdir / "sglang-fork"


def venv_0523() -> Path:
    """The 0.5.23 test venv's python ($SGLPATCH_TEST_VENV_0523, else .venv-0523; it may not exist).
    scripts/test.sh builds that venv in the background, holding VENV.lock until done: wait for it."""
    venv = Path(os.environ.get("SGLPATCH_TEST_VENV_0523") or ROOT / ".venv-0523")
    lock = venv.with_name(venv.name + ".lock")
    if lock.is_file():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            fcntl.flock(f, fcntl.LOCK_UN)
    return venv / "bin" / "python"


def cuda_home() -> str | None:
    """The CUDA toolkit the JIT builds use, as the user's box sets it (CUDA_HOME=/usr/local/cuda-12.8):
    $CUDA_HOME, else the folder above nvcc when it holds libcudart (a wrapper script in /usr/local/bin
    is not a toolkit: then /usr/local/cuda); None without nvcc."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    for cand in (Path(os.path.realpath(nvcc)).parents[1], Path("/usr/local/cuda")):
        if (cand / "bin" / "nvcc").is_file() and list((cand / "lib64").glob("libcudart.so*")):
            return str(cand)
    return str(Path(nvcc).parents[1])


def wait_pid(path: Path, timeout: float = 20.0) -> int:
    """The pid a child process wrote into path, once it has (an AssertionError past timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def make_venv(env_dir: Path, also: tuple[Path, ...] = ()) -> Path:
    """A venv that sees this interpreter's packages (also when this interpreter is itself a
    venv, where system_site_packages would skip them), so that installing into it is cheap;
    `also`: folders it sees after them (e.g. the sglpatch under test)."""
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site_dir = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    import site

    parents = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    (Path(site_dir) / "_sglpatch_parent.pth").write_text("\n".join([*parents, *map(str, also)]) + "\n")
    return py


@pytest.fixture(scope="session")
def patched_python(tmp_path_factory, request) -> Path:
    """A venv (sharing this interpreter's packages) with the patched tree installed --no-deps -e.

    With SGLPATCH_PATCHED_PYTHON set (the regression suite's cpu tier on the target), the patch
    tests run against that interpreter's installed sglang instead.
    """
    installed = os.environ.get("SGLPATCH_PATCHED_PYTHON")
    if installed:
        return Path(installed)
    patched_tree = request.getfixturevalue("patched_tree")
    with built_once(tmp_path_factory, "patched-venv", str(patched_tree)) as (where, done):
        if not done:
            _install_patched(make_venv(where / "env"), patched_tree)
    return where / "env" / "bin" / "python"


def _install_patched(py: Path, patched_tree: Path) -> None:
    cmd = [
        str(py),
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "-e",
        str(patched_tree / "python"),
    ]
    version_py = (patched_tree / "python" / "sglang" / "_version.py").read_text()
    version = re.search(r"__version__ = version = '([^']+)'", version_py).group(1)
    env = dict(os.environ, SETUPTOOLS_SCM_PRETEND_VERSION=version)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the build rewrites _version.py; keep the tree as apply left it
    subprocess.run(["git", "checkout", "-q", "--", "python/sglang/_version.py"], cwd=patched_tree, check=False)


@contextlib.contextmanager
def built_once(tmp_path_factory, name: str, key: str = ""):
    """(folder, done): a folder the whole run shares (all xdist workers: under the run's base temp
    folder), built by the first worker that asks while the others wait on its lock; done says it
    was built before, for the same key. A build that failed or was killed is started over.
    Read-only to its users. A pytest run inside a test (PYTEST_XDIST_WORKER inherited) has a base
    temp folder of its own, so it builds its own."""
    base = tmp_path_factory.getbasetemp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = base.parent if worker and base.name == f"popen-{worker}" else base
    where, stamp = root / f"shared-{name}", root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = stamp.is_file() and stamp.read_text() == key
        if not done:
            stamp.unlink(missing_ok=True)
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir()
        yield where, done
        stamp.write_text(key)


@pytest.fixture(scope="session")
def run_patched(patched_python, tmp_path_factory):
    """run(code, env, timeout): `patched_python -c code` (CUDA hidden), as a CompletedProcess. A
    child forked from a zygote that imported torch and transformers once (tests/zygote.py), unless
    SGLPATCH_PATCHED_PYTHON names another Python or the env changes a PYTHON* variable."""
    cwd = tmp_path_factory.mktemp("run")
    base = dict(os.environ)
    base.pop("PYTHONPATH", None)
    base.setdefault("CUDA_VISIBLE_DEVICES", "")
    zy = None if os.environ.get("SGLPATCH_PATCHED_PYTHON") else start_zygote(patched_python, base, cwd)

    def run(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        full_env = dict(base, **(env or {}))
        if zy and not any(k.startswith("PYTHON") and base.get(k) != v for k, v in (env or {}).items()):
            return zy.run(code, full_env, cwd, timeout)
        return subprocess.run(
            [str(patched_python), "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd
        )

    yield run
    if zy:
        close_zygote(zy)


def git(cwd: Path, *args: str, check: bool = True) -> str:
    """Plain git for test assertions (the code under test uses sglpatch.gitcmd)."""
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout.strip()


# `python -m sglpatch.cli ARGS` as a child forked from a zygote that imported sglpatch.cli once
# (tests/zygote.py): importing it (GitPython, packaging, the commands) was 0.3 of the 0.4 CPU-seconds
# a no-op apply took, and the suite runs about 700 of them. Each is still its own process with its own
# environment, folder, exit status and signals. A plain subprocess where that could differ: another
# PYTHON*/GIT_PYTHON*/locale setting than the zygote's, no git on PATH, SGLPATCH_TEST_NO_ZYGOTE=1.
_CLI_ZYGOTES: dict = {}
_CLI_CODE = "import sys\nfrom sglpatch.cli import main\nsys.exit(main())\n"


def _zygote_key(env: dict) -> tuple:
    keep = ("PYTHON", "GIT_PYTHON", "LANG", "LC_")
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(keep)))


def _cli_zygote(env: dict):
    if os.environ.get("SGLPATCH_TEST_NO_ZYGOTE") or not shutil.which("git", path=env.get("PATH", "")):
        return None
    key = _zygote_key(env)
    if key not in _CLI_ZYGOTES:  # its folder (output files) in this process's temp folder
        _CLI_ZYGOTES[key] = start_zygote(sys.executable, env, Path(tempfile.gettempdir()), preload=("sglpatch.cli",))
    return _CLI_ZYGOTES[key]


def close_cli_zygotes() -> None:
    for zy in _CLI_ZYGOTES.values():
        if zy:
            close_zygote(zy)
            shutil.rmtree(zy.folder, ignore_errors=True)
    _CLI_ZYGOTES.clear()


def run_cli(args: list, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m sglpatch.cli *args` with exactly env, in cwd, as a CompletedProcess (text)."""
    argv = [sys.executable, "-m", "sglpatch.cli", *map(str, args)]
    zy = _cli_zygote(env)
    if zy is None:
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    return zy.run(_CLI_CODE, env, cwd, timeout, argv=[str(Path(zy.python).parent / "sglpatch"), *argv[3:]], args=argv)


def sglpatch(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real console entry point in its own process (run_cli)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return run_cli(list(args), full_env, cwd or ROOT, timeout)


def loosen(repo: Path) -> None:
    """A repository's packs back to loose objects: a tree cache as an earlier sglpatch left it, or
    as a kill between an unpack and its packing leaves it."""
    for pack in sorted((repo / "objects" / "pack").glob("pack-*.pack")):
        data = pack.read_bytes()
        for f in pack.parent.glob(f"{pack.stem}.*"):
            f.unlink()
        subprocess.run(["git", "unpack-objects", "-q"], cwd=repo, input=data, check=True)


def terminal_sigint() -> None:
    """preexec_fn for a child that a test sends Ctrl-C: SIGINT as in a terminal's foreground, also
    when the suite itself runs in the background (a shell's `&` without job control ignores SIGINT
    for everything it starts, and an ignored SIGINT is inherited across exec)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
