"""The commands in one table and their one option vocabulary (issue 39), in-process through
sglpatch.cli.main / build_parser: every command module is in the table once, --help groups them,
no private argparse is reached into, and the shared options (--source, --json FILE, --report-dir,
--...timeout SEC) mean the same on every command; old spellings still work and warn once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from sglpatch import argtypes, cli, cliargs

SRC = ROOT / "src" / "sglpatch"


def _opt(parser, flag):
    return next((a for a in parser._actions if flag in a.option_strings), None)  # reading a parser's actions: the test's view only


def test_every_command_module_is_in_the_one_table_once_with_the_same_shape():
    mods = [m for _, ms in cli.COMMANDS for m in ms]
    files = sorted(p.stem for p in (SRC / "commands").glob("*.py") if p.stem != "__init__")
    assert sorted(m.__name__.rsplit(".", 1)[1] for m in mods) == files and len(set(mods)) == len(mods) == 12
    for m in mods:
        assert isinstance(m.NAME, str) and isinstance(m.HELP, str) and callable(m.register) and callable(m.run), m.__name__
    _, parsers = cli.build_parser()
    assert list(parsers) == [m.NAME for m in mods]
    assert [g for g, _ in cli.COMMANDS] == ["everyday", "moving releases", "finding faults"]
    assert [m.NAME for m in cli.COMMANDS[1][1]] == ["rebase", "watch"]
    assert {m.NAME for m in cli.COMMANDS[0][1]} >= {"apply", "status", "export", "lines"}
    assert [m.NAME for m in cli.COMMANDS[2][1]] == ["bisect", "regress", "doctor", "profile-report"]
    for path in [SRC / "cli.py", SRC / "cliargs.py", *(SRC / "commands").glob("*.py")]:
        assert not re.search(r"\._(subparsers|choices_actions|group_actions|actions|option_string_actions)\b", path.read_text()), path


def test_help_lists_the_commands_by_group_in_the_tables_order(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    block = out[out.index("everyday:"):out.index("positional arguments")].splitlines()
    heads = [i for i, ln in enumerate(block) if not ln.startswith(" ") and ln]
    assert [block[i] for i in heads] == ["everyday:", "moving releases:", "finding faults:"]
    names = [ln.split()[0] for ln in block if ln.startswith("  ")]
    assert names == [m.NAME for _, ms in cli.COMMANDS for m in ms]
    assert "  profile-report  summarize an EAGLE cycle profile" in out


def test_an_unknown_option_is_told_with_the_commands_own_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["rebase", "--dryrun"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: sglpatch rebase") and "unrecognized arguments: --dryrun" in err


def test_source_is_one_option_on_apply_check_and_rebase():
    _, parsers = cli.build_parser()
    acts = {n: _opt(parsers[n], "--source") for n in ("apply", "check", "rebase")}
    assert all(tuple(a.choices) == cliargs.SOURCES == ("auto", "git", "registry", "sdist", "wheel") for a in acts.values())
    assert {n: a.default for n, a in acts.items()} == {"apply": "auto", "check": "registry", "rebase": "registry"}
    assert all(a.help.startswith(cliargs.SOURCE_HELP) for a in acts.values())
    assert [n for n, p in parsers.items() if _opt(p, "--source")] == ["apply", "check", "rebase"]
    from sglpatch.context import Context

    ctx = Context.__new__(Context)
    assert ctx.source("registry") == "sdist" and ctx.source("wheel") == "wheel" and ctx.source("git") == "git"


def test_every_timeout_is_seconds_and_positive(capsys):
    _, parsers = cli.build_parser()
    found = [(n, a) for n, p in parsers.items() for a in p._actions 
             if any(re.fullmatch(r"--([a-z0-9]+-)?timeout", s) for s in a.option_strings) and a.dest != "on_timeout"]  # a choice
    assert sorted((n, a.option_strings[0]) for n, a in found) == [
        ("apply", "--probe-timeout"), ("bisect", "--timeout"), ("doctor", "--p2p-timeout")]
    assert all(a.metavar == "SEC" and a.type is argtypes.positive for _, a in found)
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--p2p-timeout", "0"])
    assert e.value.code == 2 and "'0' must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("command,old,extra", [("regress", "--report", []), ("bisect", "--log-dir", ["--", "true"])])
def test_report_dir_and_its_old_spelling_warned_once(command, old, extra, capsys, monkeypatch):
    monkeypatch.setattr(argtypes, "_warned", set())
    _, parsers = cli.build_parser()
    new = parsers[command].parse_args(["--report-dir", "/x/r", *extra])
    assert new.report_dir == "/x/r" and capsys.readouterr().err == ""
    for _ in range(2):
        args = parsers[command].parse_args([old, "/x/o", *extra])
        assert args.report_dir == "/x/o"
    err = capsys.readouterr().err.splitlines()
    assert err == [f"sglpatch: warning: {old} is an old spelling of --report-dir; it still works, and will be removed"]
    assert not re.search(rf"{old}\b(?!-)", parsers[command].format_help()) and "--report-dir DIR" in parsers[command].format_help()


def test_json_file_dash_and_the_old_flag_of_profile_report(tmp_path, capsys):
    rec = {"version": 1, "cycles": 10, "batch_size": 1.0, "accept_length": 2.0, "baseline_step_ms": 12.2}
    rec.update({f"{p}_ms_{s}": v for p, v in (("draft", 1.0), ("verify", 28.0), ("extend", 1.0), ("cycle", 30.0))
                for s in ("mean", "median", "p90")})
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    assert cli.main(["profile-report", str(f), "--json", "-"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["summary"]["cycles"] == 10 and out.err == ""
    assert cli.main(["profile-report", str(f), "--json", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    assert "break-even" in text and json.loads((tmp_path / "s.json").read_text())["file"] == str(f)
    assert cli.main(["profile-report", str(f), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["summary"]["cycles"] == 10
    assert out.err.splitlines() == ["sglpatch: warning: --json without FILE is an old spelling of --json -; it still works, and will be removed"]
    _, parsers = cli.build_parser()
    for n in ("watch", "doctor", "profile-report"):
        a = _opt(parsers[n], "--json")
        assert a.metavar == "FILE" and "'-': standard output" in a.help, n
    assert [n for n, p in parsers.items() if _opt(p, "--json")] == ["watch", "doctor", "profile-report"]


def test_scripts_take_a_lone_dash_as_a_value(tmp_path):
    import subprocess

    res = subprocess.run(["bash", "-c", f'. {ROOT}/scripts/lib.sh; check_values x --json - && check_values x --json --foo'],
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip() == "x: --json needs a value (see x --help)"
    assert Path(ROOT / "scripts" / "regress.sh").read_text().count("--report-dir") >= 2


def test_applys_options_come_in_groups():
    _, parsers = cli.build_parser()
    text = parsers["apply"].format_help()
    heads = ["which tree:", "the upstream tree:", "where it is installed:", "a new venv:"]
    assert [text.index(h) for h in heads] == sorted(text.index(h) for h in heads)
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in parsers["apply"]._action_groups}
    assert groups["a new venv"] == ["--venv", "--cuda", "--release-artifact"] and groups["the upstream tree"] == [
        "--source", "--upstream-url", "--probe-timeout"]


def test_building_the_parser_imports_no_gpu_command_code():
    """Every `sglpatch` process builds the whole parser: doctor's and regress's options live in
    sglpatch.gpu.options, so their run-time modules (and what those import) load only when run;
    profile-report's module is its own light one."""
    code = "import sys, sglpatch.cli as c; c.build_parser(); print(' '.join(sorted(m for m in sys.modules if m.startswith('sglpatch.gpu'))))"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert got == ["sglpatch.gpu", "sglpatch.gpu.options", "sglpatch.gpu.profile_report"], got
