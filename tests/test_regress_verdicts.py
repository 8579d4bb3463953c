"""Every row of sglpatch.gpu.shared.verdict.TABLE, produced by the real cpu tier: a real pytest run
on planted patch tests against a planted package under test (`fakesgl`, on the profile's
PYTHONPATH), through `sglpatch regress` as the user runs it; the exit code and every printed
line asserted. Only tests that ran give a verdict (issue 50)."""

from __future__ import annotations

import json
import sys
import venv
from pathlib import Path

import pytest

from sglpatch.cli import main as cli_main
from sglpatch.gpu.cpu import pytest_record
from sglpatch.gpu.shared import verdict

OK_PKG = "VERSION = '1'\n"
SLEEPS = "import time\ndef test_slow(): time.sleep(60)\n"

# outcome -> (files under tests/patches, fakesgl/ files, extra [cpu] lines, the cause the line names)
CASES = {
    "passed": ({"test_p.py": "def test_ok(): pass\ndef test_ok2(): pass\n"}, {}, "", "2 passed, 0 failed, 0 errors, 0 skipped"),
    "failed": ({"test_p.py": "def test_ok(): pass\ndef test_bad(): assert 0\n"}, {}, "", "test_p.py::test_bad"),
    "under_test_broken": ({"test_p.py": "import fakesgl.removed\ndef test_ok(): pass\n", "test_q.py": "def test_ok(): pass\n"},
                          {}, "", "ModuleNotFoundError: No module named 'fakesgl.removed' (in the code under test)"),
    "timed_out": ({"test_p.py": SLEEPS}, {}, "timeout_s = 3\n", "pytest timed out after 3 s (killed)"),
    "runner_internal_error": ({"conftest.py": "def pytest_configure_nodes(node): pass\n", "test_p.py": "def test_ok(): pass\n"},
                              {}, "", "unknown hook 'pytest_configure_nodes'"),
    "runner_usage_error": ({"conftest.py": "import no_such_runner_plugin_sglpatch\n", "test_p.py": "def test_ok(): pass\n"},
                           {}, "", "No module named 'no_such_runner_plugin_sglpatch'"),
    "nothing_collected": ({"helpers.py": "X = 1\n"}, {}, "", "pytest collected no test"),
    "interrupted": ({"test_p.py": "import os, signal\ndef test_stop(): os.kill(os.getpid(), signal.SIGINT)\n"}, {}, "",
                    "pytest was interrupted"),
    "runner_lacks": ({"test_p.py": "import no_such_dep_sglpatch\ndef test_ok(): pass\n", "test_q.py": "def test_ok(): pass\n"},
                     {}, "", "No module named 'no_such_dep_sglpatch' (not the code under test)"),
    "no_runner": ({"test_p.py": "def test_ok(): pass\n"}, {}, 'pytest_args = ["-p", "no:sglpatch.gpu.cpu.pytest_record"]\n',
                  "the runner wrote no outcome record"),
    "cannot_start": ({"test_p.py": "def test_ok(): pass\n"}, {}, 'import_check = "no_such_module_sglpatch"\n',
                     "no_such_module_sglpatch not installed in"),
}

# what issue 50 asks of each, written here apart from the table under test: 1 only from what ran
EXPECTED_EXIT = {"passed": 0, "failed": 1, "under_test_broken": 1, "timed_out": 1, "runner_internal_error": 125,
                 "runner_usage_error": 125, "nothing_collected": 125, "interrupted": 125, "runner_lacks": 125,
                 "no_runner": 125, "cannot_start": 125}


def plant(tmp_path: Path, outcome: str) -> Path:
    tests, pkg, extra, _ = CASES[outcome]
    proj, site = tmp_path / "proj", tmp_path / "site"
    for rel, text in {**{f"tests/patches/{k}": v for k, v in tests.items()}}.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(text)
    (proj / "tests" / "patches").mkdir(parents=True, exist_ok=True)
    for rel, text in {"__init__.py": OK_PKG, **pkg}.items():
        (site / "fakesgl" / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / "fakesgl" / rel).write_text(text)
    (proj / "targets").mkdir(parents=True, exist_ok=True)
    cpu = [line for line in ('import_check = "fakesgl"', "timeout_s = 120") if line.split()[0] not in extra]
    (proj / "targets" / "t.toml").write_text(f'[env]\nPYTHONPATH = "{site}"\n[cpu]\n' + "\n".join(cpu) + f"\n{extra}")
    return proj


def run_tier(tmp_path: Path, proj: Path, capsys) -> tuple[int, list[str]]:
    rc = cli_main(["regress", "--tier", "cpu", "--profile", "t", "--project", str(proj),
                   "--report-dir", str(tmp_path / "r"), "--python", sys.executable])
    return rc, capsys.readouterr().out.splitlines()


def test_every_row_of_the_table_has_a_case():
    assert set(CASES) == set(verdict.ROWS) == set(EXPECTED_EXIT)
    assert {r.outcome: r.exit_code for r in verdict.TABLE} == EXPECTED_EXIT


@pytest.mark.parametrize("outcome", list(CASES))
def test_each_outcome_gives_its_exit_code_and_names_its_cause(tmp_path, capsys, outcome):
    proj = plant(tmp_path, outcome)
    row = verdict.ROWS[outcome]
    rc, out = run_tier(tmp_path, proj, capsys)
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert (rc, doc["exit_code"], doc["tiers"]["cpu"]["outcome"], doc["tiers"]["cpu"]["status"]) == \
        (EXPECTED_EXIT[outcome], row.exit_code, outcome, row.status), out
    status_word = {"pass": "pass", "fail": "fail", "cannot_run": "cannot_run"}[row.status]
    assert out[0].startswith(f"tier cpu: {status_word}: "), out
    assert out[-1].startswith(f"regress: {status_word} (exit {row.exit_code}); report: "), out
    cause = CASES[outcome][3]
    assert any(cause in line for line in out), (cause, out)
    if row.status == "cannot_run":
        assert any(line.startswith("  - cannot run here: ") for line in out), out
        assert outcome == "cannot_start" or out[1].endswith("no verdict"), out
        assert not any(line.startswith("  - ") and "cannot run here" not in line for line in out), out


def test_code_under_test_that_does_not_import_is_a_failure(tmp_path, capsys):
    proj = plant(tmp_path, "passed")
    (tmp_path / "site" / "fakesgl" / "__init__.py").write_text("raise RuntimeError('a patch broke me')\n")
    rc, out = run_tier(tmp_path, proj, capsys)
    assert rc == 1 and "fakesgl does not import with" in out[1] and "a patch broke me" in out[1], out


def test_cannot_run_here_from_a_fixture_is_no_verdict(tmp_path, capsys):
    """A fixture that finds the Python under test lacking what the tests need (e.g. apache-tvm-ffi for
    the JIT build) raises CannotRunHere: no verdict, even with every other test passing."""
    proj = plant(tmp_path, "passed")
    (proj / "tests" / "patches" / "test_r.py").write_text(
        "import pytest\nfrom sglpatch.gpu.cpu.pytest_record import CannotRunHere\n"
        "@pytest.fixture\ndef builder():\n    raise CannotRunHere('the Python under test lacks tvm_ffi')\n"
        "def test_build(builder): pass\n")
    rc, out = run_tier(tmp_path, proj, capsys)
    assert rc == 125, out
    assert "tests/patches/test_r.py::test_build: the Python under test lacks tvm_ffi" in "\n".join(out)


def test_a_failure_beside_a_module_the_runner_cannot_import_is_still_a_failure(tmp_path, capsys):
    proj = plant(tmp_path, "runner_lacks")
    (proj / "tests" / "patches" / "test_q.py").write_text("def test_bad(): assert 0\n")
    rc, out = run_tier(tmp_path, proj, capsys)
    assert rc == 1 and "test_q.py::test_bad" in out[1], out


def test_a_module_of_the_code_under_test_that_raises_on_import_is_a_failure(tmp_path, capsys):
    """The module exists but its own import fails (a frame inside the code under test), against a
    test module whose own import lacks a runner module: told apart."""
    proj = plant(tmp_path, "passed")
    (tmp_path / "site" / "fakesgl" / "broken.py").write_text("import no_such_dep_in_code_under_test\n")
    (proj / "tests" / "patches" / "test_q.py").write_text("import fakesgl.broken\n")
    rc, out = run_tier(tmp_path, proj, capsys)
    assert rc == 1 and "No module named 'no_such_dep_in_code_under_test' (in the code under test)" in out[1], out


def test_a_killed_runner_is_no_verdict(tmp_path, capsys):
    proj = plant(tmp_path, "passed")
    (proj / "tests" / "patches" / "test_p.py").write_text(
        "import os, signal\ndef test_die(): os.kill(os.getpid(), signal.SIGKILL)\n")
    rc, out = run_tier(tmp_path, proj, capsys)
    assert rc == 125 and "pytest was killed by signal 9" in "\n".join(out), out


def test_every_test_skipped_is_no_verdict(tmp_path, capsys):
    proj = plant(tmp_path, "passed")
    (proj / "tests" / "patches" / "test_p.py").write_text("import pytest\n@pytest.mark.skip('x')\ndef test_s(): pass\n")
    rc, out = run_tier(tmp_path, proj, capsys)
    assert rc == 125 and "no test ran: 1 skipped, none passed" in "\n".join(out), out


def test_a_runner_without_pytest_cannot_run(tmp_path, capsys):
    proj = plant(tmp_path, "passed")
    venv.EnvBuilder(with_pip=False).create(tmp_path / "bare")
    with (proj / "targets" / "t.toml").open("a") as f:
        f.write(f'pytest_python = "{tmp_path / "bare" / "bin" / "python"}"\n')
    rc, out = run_tier(tmp_path, proj, capsys)
    assert rc == 125 and "has no pytest" in "\n".join(out), out


def test_classify_tells_the_code_under_test_from_the_runner(tmp_path):
    under = tmp_path / "tree" / "fakesgl"
    under.mkdir(parents=True)
    assert pytest_record.classify(ModuleNotFoundError("x", name="fakesgl.gone"), [under], "fakesgl") == "under_test"
    assert pytest_record.classify(ModuleNotFoundError("x", name="fakesglx.gone"), [under], "fakesgl") == "runner"
    assert pytest_record.classify(ModuleNotFoundError("x", name="torch"), [under], "fakesgl") == "runner"
    assert pytest_record.classify(ImportError("cannot import name", path=str(under / "a.py")), [under], "fakesgl") == "under_test"
    assert pytest_record.classify(SyntaxError("bad", (str(under / "b.py"), 1, 1, "x")), [under], "fakesgl") == "under_test"
    assert pytest_record.classify(SyntaxError("bad", (str(tmp_path / "test_x.py"), 1, 1, "x")), [under], "fakesgl") == "runner"


def test_docs_show_the_table_the_code_keeps():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "regress.md").read_text()
    assert "\n".join(verdict.lines()) in doc
