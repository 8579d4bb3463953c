"""tests/harness.py's scheduling: the files run heaviest first by the durations kept in the checkout
(tests/durations.json), overlaid by this machine's; `--write-durations` rewrites the kept file. The
order is seen in a real pytest run under xdist (one worker, so the order is the worker's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness

TESTS = Path(__file__).resolve().parent


def _suite(root: Path) -> None:
    for name, n in (("test_a.py", 1), ("test_b.py", 2), ("test_c.py", 1)):
        body = "".join(f"def test_{k}():\n    open({str(root / 'order')!r}, 'a').write(__file__.rsplit('/', 1)[1] + '\\n')\n"
                       for k in range(n))
        (root / name).write_text(body)


def _run(root: Path, cache: Path, *args: str, serial: bool = False) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLPATCH_TEST_CPU", "PYTEST_"))}
    env.update(SGLPATCH_TEST_CACHE=str(cache), PYTHONPATH=f"{TESTS}{os.pathsep}{env.get('PYTHONPATH', '')}")
    (root / "order").unlink(missing_ok=True)
    xdist = ["-p", "no:xdist"] if serial else ["-n", "1", "--dist", "loadfile", "--no-loadscope-reorder"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "harness", *xdist,
                        "--rootdir", str(root), "--basetemp", str(root.parent / "basetemp"), str(root), *args],
                       cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return (root / "order").read_text().split()


def test_files_run_heaviest_first_by_the_measured_durations(tmp_path):
    root, cache = tmp_path / "suite", tmp_path / "cache"
    root.mkdir()
    cache.mkdir()
    _suite(root)
    # measured: c weighs 5 s, a 1.5 s; b's two tests unmeasured, 1 s each (2 s): c, b, then a
    (cache / "durations.json").write_text(json.dumps({"test_a.py::test_0": 1.5, "test_c.py::test_0": 5}))
    assert _run(root, cache) == ["test_c.py", "test_b.py", "test_b.py", "test_a.py"]
    # the run wrote what it measured beside the test venv, every test, over what was there
    got = json.loads((cache / "durations.json").read_text())
    assert sorted(got) == [f"{f}::test_{k}" for f, k in (("test_a.py", 0), ("test_b.py", 0), ("test_b.py", 1), ("test_c.py", 0))]
    assert got["test_c.py::test_0"] < 5 and all(v >= 0 for v in got.values())


def test_the_kept_figures_are_the_base_and_this_machines_win(tmp_path, monkeypatch):
    kept, mine = tmp_path / "kept.json", tmp_path / "cache" / "durations.json"
    mine.parent.mkdir()
    monkeypatch.setattr(harness, "KEPT", kept)
    monkeypatch.setenv("SGLPATCH_TEST_CACHE", str(mine.parent))
    assert harness.read_durations() == {}
    kept.write_text(json.dumps({"tests/x.py::a": 4, "tests/x.py::b": 2}))
    mine.write_text(json.dumps({"tests/x.py::b": 7}))
    assert harness.read_durations() == {"tests/x.py::a": 4.0, "tests/x.py::b": 7.0}
    mine.write_text("not json")
    assert harness.read_durations() == {"tests/x.py::a": 4.0, "tests/x.py::b": 2.0}


def test_write_durations_merges_rounds_and_prunes_gone_files(tmp_path, monkeypatch):
    kept = tmp_path / "kept.json"
    here = "tests/test_harness.py::test_write_durations_merges_rounds_and_prunes_gone_files"
    kept.write_text(json.dumps({"tests/gone.py::t": 1.0, "tests/test_layout.py::t": 2.0, here: 9.0}))
    monkeypatch.setattr(harness, "_MEASURED", {here: 0.04321, "tests/failure_modes/test_series.py::t": 1.26})
    monkeypatch.setenv("SGLPATCH_TEST_CPU_ROOT", str(os.getpid()))
    harness.write_durations(kept, pruned=True)
    assert json.loads(kept.read_text()) == {"tests/failure_modes/test_series.py::t": 1.3, "tests/test_layout.py::t": 2.0, here: 0.0}
    assert kept.read_text().endswith("\n") and not list(tmp_path.glob(".kept.json.*"))
    kept.write_text(json.dumps({"tests/gone.py::t": 1.0}))
    harness.write_durations(kept)  # this machine's file: nothing pruned
    assert json.loads(kept.read_text())["tests/gone.py::t"] == 1.0


DAMAGED = '{"test_a.py::test_0": ' + "9" * 400 + ', "test_b.py::test_0": "inf", "test_b.py::test_1": -3, ' \
    '"test_c.py::test_0": "nan", "x": [1], "test_c.py::test_9": 2.5, "test_a.py::test_9": true}'


@pytest.mark.parametrize("serial", [False, True])
def test_a_damaged_durations_file_is_read_entry_by_entry_and_rewritten(tmp_path, serial):
    """A 400-digit integer, inf, nan, a negative, a list, a bool: each bad entry ignored (the good ones
    kept), the run passes (parallel and serial), and the file is rewritten with finite figures."""
    root, cache = tmp_path / "suite", tmp_path / "cache"
    root.mkdir()
    cache.mkdir()
    _suite(root)
    (cache / "durations.json").write_text(DAMAGED)
    order = _run(root, cache, serial=serial)
    assert sorted(order) == ["test_a.py", "test_b.py", "test_b.py", "test_c.py"]
    got = json.loads((cache / "durations.json").read_text())
    assert got["test_c.py::test_9"] == 2.5 and "x" not in got and "test_a.py::test_9" not in got
    assert all(isinstance(v, float) and 0 <= v < 1e9 for v in got.values()), got


def test_the_kept_file_names_only_tests_that_exist():
    kept = json.loads(harness.KEPT.read_text())
    assert kept and all((TESTS.parent / k.split("::")[0]).is_file() for k in kept)
    assert all(isinstance(v, (int, float)) and v >= 0 for v in kept.values())


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU box: the GPU test files import torch to see its GPUs")
def test_collecting_the_suite_does_not_import_torch(tmp_path):
    """Every xdist worker collects every file: a file that imports torch at collection costs each
    worker 1.5-2 CPU-s (tests/gpu/ skips first where no NVIDIA driver is)."""
    code = ("import sys, pytest\n"
            f"rc = pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', '--basetemp', {str(tmp_path / 'bt')!r},\n"
            f"                  {str(TESTS)!r}])\n"
            "print('torch imported:', 'torch' in sys.modules, [m for m in ('sglang', 'transformers') if m in sys.modules])\n"
            "sys.exit(rc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLPATCH_TEST_CPU", "PYTEST_"))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "torch imported: False []", r.stdout[-3000:]


def _fstype(path: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True).stdout.strip()


def test_tmp_path_on_the_tmpfs_test_sh_chose_and_disk_tmp_path_on_disk(tmp_path, disk_tmp_path):
    """scripts/test.sh put the tests' temporary files on a tmpfs (SGLPATCH_TEST_DISK_TMP names its
    folder on disk then): tmp_path and TMPDIR there, disk_tmp_path (the new venvs that meet
    preflight's 25 GiB disk check) in that folder on disk."""
    disk = os.environ.get("SGLPATCH_TEST_DISK_TMP")
    if not disk:
        pytest.skip("scripts/test.sh did not put the tests' temporary files on a tmpfs in this run")
    assert _fstype(tmp_path) == _fstype(os.environ["TMPDIR"]) == "tmpfs"
    assert disk_tmp_path.parent == Path(disk) and _fstype(disk_tmp_path) != "tmpfs"
