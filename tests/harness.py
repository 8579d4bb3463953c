"""The test harness: a pytest plugin (loaded by tests/conftest.py's ``pytest_plugins``), apart from
the fixtures. What it does, and what each part saves:

* **slow**: marks the end-to-end files (END_TO_END) `slow`; ``scripts/test.sh --quick`` leaves them out,
  and the tests marked `slow` in other files (a whole nvcc build).
* **scheduling** (``--dist loadfile --no-loadscope-reorder``, xdist's own): a file's tests on one
  worker, the files heaviest first, by the wall seconds each test took: tests/durations.json (kept
  in the checkout, so that a fresh clone, CI's, starts in that order; rewritten by a whole run with
  ``scripts/test.sh --write-durations``), overlaid by this machine's own figures (written by this
  plugin to $SGLPATCH_TEST_CACHE/durations.json at the end of each run); a test measured nowhere
  counts UNMEASURED seconds. Nothing to keep up by hand.
* **CLI runs**: ``run_cli`` runs ``python -m sglpatch.cli`` as a child forked from a zygote that
  imported sglpatch.cli once (tests/zygote.py); ``run_cli_inproc`` calls ``sglpatch.cli.main`` in
  this process, for tests where nothing about a real process is under test. Same result shape.
* **build once**: ``built_once``, a folder all xdist workers share, built by the first that asks.
* **CPU log**: SGLPATCH_TEST_CPU_LOG=FILE, CPU seconds per test phase and process, summed at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# --------------------------------------------------------------------------------------
# slow: the end-to-end files (each a minute or more of real applies, rebases, venvs, servers and
# faults, measured with --durations), paths under tests/; a folder counts for all its files

END_TO_END = {
    "failure_modes/", "test_apply_cli.py", "test_cli_first_contact.py", "test_doctor.py",
    "test_kernel_candidates.py", "test_kernel_pcie_ipc_tier.py", "test_kernel_stress.py", "test_port_0523.py", "test_rebase.py", "test_regress_ab.py",
    "test_regress_server.py", "test_scripts_fresh_shell.py", "test_stack.py", "test_venv_preflight.py", "test_watch.py",
    "test_jitcheck.py", "test_lines.py", "test_bisect.py", "test_venv_pip_config.py",
    # real installs, applies from the cache and rebase faults too (1.6 min -> 5 min for --quick with them in)
    "test_flashinfer_set.py", "test_install_wheel_tree.py", "test_rebase_tree_check.py",
    "test_unpack.py", "test_line_context.py",
    "test_docs_commands.py",  # the README's and the runbook's command blocks on the user layer (issue 51)
    "test_regress_verdicts.py", "test_sigterm.py", "test_tool_bytes.py", "test_rebase_claim.py",  # real runs (issues 50, 52)
    "test_results_recipes.py",  # results/*/README.md's rerun recipes built from a fresh clone (issue 51)
    "test_user_layer.py",  # a fresh clone's own .tool-venv, apply, the whole cpu tier and two bisects (issue 50)
}


def is_end_to_end(path: Path) -> bool:
    try:
        rel = path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return False
    return any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in END_TO_END)


# --------------------------------------------------------------------------------------
# scheduling: the files heaviest first, by measured durations

UNMEASURED = 1.0  # seconds a test counts before a run has measured it


KEPT = TESTS / "durations.json"  # in the checkout: --write-durations rewrites it


def durations_file() -> Path:
    """This machine's figures, beside the test venv."""
    return Path(os.environ.get("SGLPATCH_TEST_CACHE", tempfile.gettempdir())) / "durations.json"


MAX_SECONDS = 1e6  # a figure above this is not a test's duration


def _seconds(v) -> float | None:
    """A duration from the file, or None: numbers only (not bools, strings, lists), finite, 0..MAX_SECONDS."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # a 400-digit integer
        return None
    return f if math.isfinite(f) and 0 <= f <= MAX_SECONDS else None


def _read(path: Path) -> dict:
    """{nodeid: seconds} of path, entry by entry: a bad entry is left out, the good ones kept."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(got, dict):
        return {}
    return {k: f for k, v in got.items() if isinstance(k, str) and (f := _seconds(v)) is not None}


def read_durations() -> dict:
    """{nodeid: wall seconds (setup + call + teardown)}: the checkout's figures, overlaid by this
    machine's; {} when neither is there or readable."""
    return dict(_read(KEPT), **_read(durations_file()))


def pytest_addoption(parser):
    parser.addoption("--write-durations", action="store_true",
                     help=f"write this run's durations into {KEPT.relative_to(TESTS.parent)} (the order a fresh clone runs in)")


def file_costs(items, durations: dict) -> dict:
    """{file: seconds}: each test's measured duration, or UNMEASURED."""
    costs: dict = {}
    for item in items:
        f = item.nodeid.split("::")[0]
        costs[f] = costs.get(f, 0.0) + durations.get(item.nodeid, UNMEASURED)
    return costs


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (the cpu tier's runner, the tool's own
def pytest_configure_node(node):  # venv) pytest would refuse the whole plugin as "unknown hook"
    """xdist's controller reads the durations once and hands them to every worker, so that all of
    them collect in the same order even when another run writes the file meanwhile."""
    node.workerinput["sglpatch_durations"] = read_durations()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_end_to_end(item.path):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # an xdist worker: heaviest file first (a serial run keeps pytest's order)
        costs = file_costs(items, config.workerinput.get("sglpatch_durations", {}))
        order = {id(item): k for k, item in enumerate(items)}
        items.sort(key=lambda item: (-costs[item.nodeid.split("::")[0]], item.nodeid.split("::")[0], order[id(item)]))


_MEASURED: dict = {}  # this run's {nodeid: seconds}, in the controller (or a serial run)


def pytest_runtest_logreport(report):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _MEASURED[report.nodeid] = _MEASURED.get(report.nodeid, 0.0) + report.duration


def write_durations(path: Path, pruned: bool = False) -> None:
    """Merge this run's durations into path (a test this run did not run keeps its old figure;
    pruned: not when its file is gone)."""
    if not _MEASURED or os.environ.get("SGLPATCH_TEST_CPU_ROOT") != str(os.getpid()):
        return
    merged = dict(_read(path), **{k: round(v, 1) for k, v in _MEASURED.items()})
    if pruned:
        merged = {k: v for k, v in merged.items() if k in _MEASURED or (TESTS.parent / k.split("::")[0]).is_file()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(merged, sort_keys=True, indent=0) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


# --------------------------------------------------------------------------------------
# build once, for all xdist workers


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


# --------------------------------------------------------------------------------------
# the CPU log: SGLPATCH_TEST_CPU_LOG=FILE appends one JSON line per test phase (CPU seconds of this
# process and the children it waited for, wall seconds, and when it ended on which worker: how busy
# the cores were over the run), one per worker for its whole run, and
# prints the top 15 tests and the files by CPU at the end. scripts/test.sh sets it
# (sglpatch-test-cpu.jsonl in the test venv, emptied each run). Load-independent, unlike --durations.

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
        _cpu_log(id=item.nodeid, phase=phase, cpu=round(_cpu_now() - c0, 3), wall=round(time.monotonic() - w0, 3),
                 end=round(time.time(), 1), worker=os.environ.get("PYTEST_XDIST_WORKER", "main"))

    return hook


pytest_runtest_setup, pytest_runtest_call, pytest_runtest_teardown = (_timed(p) for p in ("setup", "call", "teardown"))


def pytest_sessionfinish(session):
    close_cli_zygotes()
    write_durations(durations_file())
    if session.config.getoption("write_durations"):
        write_durations(KEPT, pruned=True)
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


# --------------------------------------------------------------------------------------
# CLI runs. `python -m sglpatch.cli ARGS` as a child forked from a zygote that imported sglpatch.cli
# once (tests/zygote.py): importing it (GitPython, packaging, the commands) was 0.3 of the 0.4
# CPU-seconds a no-op apply took. Each is still its own process with its own environment, folder,
# exit status and signals. A plain subprocess where that could differ: another
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


# What an in-process run cannot stand for: these make the tool kill or stop its own process.
NOT_INPROC = ("SGLPATCH_CRASH_AT", "SGLPATCH_PAUSE_AT")


def run_cli_inproc(args: list, env: dict, cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """`sglpatch.cli.main(args)` in this process, as run_cli would run it in a child: with exactly
    env (os.environ swapped for the call, with monkeypatch, and TMPDIR read again), in cwd, its
    stdout and stderr captured at the file descriptors (so what its own children print is caught
    too), argparse's SystemExit and an uncaught exception (a traceback, status 1) as a child's exit
    status. timeout is not enforced (nothing here can hang on a signal). Not for tests of a
    process: signals, exit by a signal, umask, locks between processes, crash points."""
    from sglpatch import cli

    bad = [k for k in NOT_INPROC if env.get(k)]
    assert not bad, f"{bad} stops the process: use run_cli for this run"
    argv = [str(a) for a in args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, pytest.MonkeyPatch.context() as mp:
        for k in list(os.environ):
            mp.delenv(k)
        for k, v in env.items():
            mp.setenv(k, v)
        mp.chdir(cwd)
        mp.setattr(tempfile, "tempdir", None)
        mp.setattr(sys, "argv", [str(Path(sys.executable).parent / "sglpatch"), *argv])
        streams = [io.TextIOWrapper(io.FileIO(os.dup(f.fileno()), "w"), encoding="utf-8", write_through=True) for f in (out, err)]
        mp.setattr(sys, "stdout", streams[0])
        mp.setattr(sys, "stderr", streams[1])
        for s in (sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                s.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            status = cli.main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1])
        except Exception:
            traceback.print_exc()
            status = 1
        finally:
            for s in streams:
                s.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            for s in streams:
                s.close()
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess([sys.executable, "-m", "sglpatch.cli", *argv], int(status or 0), texts[0], texts[1])
