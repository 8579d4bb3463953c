"""Shared fixtures: the real SGLang sdists (downloaded once), real git workdirs, the patched tree.

* ``project_root``: this repository (series, patches/, upstream.lock).
* ``project_copy``: a throw-away copy of the project files, for tests that edit the series.
* ``sdist_059`` / ``sdist_0510``: paths of the verified registry sdists (cached in $SGLPATCH_CACHE).
* ``patched_tree``: a workdir where ``sglpatch apply`` built the committed series on 0.5.9.
* ``patched_python`` / ``run_patched``: a venv where ``import sglang`` is that patched tree
  (``pip install --no-deps -e``), and a helper that runs code in it.
* ``sglpatch(*args)`` / ``sglpatch_inproc(*args)``: the CLI in its own process, or in this one
  (``sglpatch.cli.main``, where nothing about a process is under test); the same result.

The harness (which tests are slow, scheduling, CLI zygotes, build-once, the CPU log) is the
plugin tests/harness.py, loaded here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

import pytest

pytest.register_assert_rewrite("harness")  # imported here before pytest_plugins loads it
from harness import built_once, close_zygote, run_cli, run_cli_inproc, start_zygote  # noqa: E402,F401  (tests import them from here)

pytest_plugins = ["harness"]
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
# pip's index, asked of pip once for the run and handed on as PIP_INDEX_URL, where pip and uv read
# it as they read the configuration: sglpatch.upstream.pkgindex.index_url asks `pip config list`
# when it is unset (0.23 CPU-s, in 105 of the suite's processes).
# tests/test_pip_index.py runs that lookup itself, with real pip and a real pip.conf.
if "PIP_INDEX_URL" not in os.environ:
    from sglpatch.upstream import pkgindex

    os.environ["PIP_INDEX_URL"] = pkgindex.index_url()


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


@pytest.fixture
def disk_tmp_path(request, tmp_path_factory) -> Path:
    """A test's temporary folder on a disk. scripts/test.sh puts tmp_path on a tmpfs when there is
    one with room and names a folder on disk in SGLPATCH_TEST_DISK_TMP: for the tests whose new venv
    meets apply's preflight disk check (~25 GiB free where a venv is made when the resolver gives
    no sizes), more than a tmpfs the size of the machine's memory has. Elsewhere a tmp_path of its own."""
    name = re.sub(r"\W", "_", request.node.name)[:30]
    disk = os.environ.get("SGLPATCH_TEST_DISK_TMP")
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=disk)) if disk else tmp_path_factory.mktemp(name)


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


@pytest.fixture(scope="session")
def run_patched(patched_python, tmp_path_factory):
    """run(code, env, timeout): `patched_python -c code` (CUDA hidden), as a CompletedProcess. A
    child forked from a zygote that imported torch and transformers once (tests/zygote.py), unless
    SGLPATCH_PATCHED_PYTHON names another Python or the env changes a PYTHON* variable."""
    cwd = tmp_path_factory.mktemp("run")
    base = dict(os.environ)
    base.pop("PYTHONPATH", None)
    base.setdefault("CUDA_VISIBLE_DEVICES", "")
    (cwd / "tmp").mkdir()
    base["TMPDIR"] = str(cwd / "tmp")  # the scripts' temporary folders in this run's, not left in /tmp
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


# fixed dates for the commits the tests make, so that exports compare byte for byte (set for the
# whole run, as importing the failure-mode file did for every worker before it was split)
os.environ.setdefault("GIT_AUTHOR_DATE", "2026-11-30T12:00:00+00:00")
os.environ.setdefault("GIT_COMMITTER_DATE", "2026-11-30T12:00:00+00:00")

def git(cwd: Path, *args: str, check: bool = True) -> str:
    """Plain git for test assertions (the code under test uses sglpatch.gitcmd)."""
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout.strip()


@pytest.fixture
def git_runs(monkeypatch) -> list[tuple]:
    """The arguments of every git run the code under test makes through sglpatch.gitcmd (Runner.run),
    in order; the runs still happen."""
    from sglpatch.gitcmd import Runner

    runs: list[tuple] = []
    real = Runner.run

    def counted(self, *args, **kw):
        runs.append(args)
        return real(self, *args, **kw)

    monkeypatch.setattr(Runner, "run", counted)
    return runs


def sglpatch(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real console entry point in its own process (run_cli)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return run_cli(list(args), full_env, cwd or ROOT, timeout)


def sglpatch_inproc(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """sglpatch(...) in this process (run_cli_inproc): for tests where nothing about a real process
    (signals, its exit by a signal, umask, locks between processes, crash points) is under test."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return run_cli_inproc(list(args), full_env, cwd or ROOT, timeout)


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
