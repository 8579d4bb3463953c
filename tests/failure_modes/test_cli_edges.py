"""The command line and the reports: a command's own usage, watch's ranges, profile-report's buckets
and devices, the scripts' exit-code tables, the README's checkable figures.

In the world of world.py, with its five guarantees; each test failed before its fix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, sglpatch
from sglpatch import exitcodes
from sglpatch.gpu import profile_report
from sglpatch.errors import SglpatchError


def test_an_unknown_option_shows_the_commands_usage_not_the_top_level_one():
    r = sglpatch("rebase", "--dryrun")
    assert r.returncode == exitcodes.USAGE
    assert r.stderr.startswith("usage: sglpatch rebase [-h]"), r.stderr
    assert r.stderr.splitlines()[-1] == "sglpatch rebase: error: unrecognized arguments: --dryrun"


def test_watch_releases_not_on_the_index_is_a_usage_error_and_a_reversed_range_says_so(monkeypatch):
    from sglpatch.upstream import pkgindex
    from sglpatch.watch import matrix

    known = ["0.5.9", "0.5.10", "0.5.10.post1", "0.5.11"]
    monkeypatch.setattr(pkgindex, "releases", lambda name, after=None, upto=None, first=None: known)
    monkeypatch.setattr(pkgindex, "index_files", lambda name: tuple(
        pkgindex.Artifact(f"sglang-{v}.tar.gz", v, "sdist", "0" * 64, f"https://example.invalid/sglang-{v}.tar.gz") for v in known))
    with pytest.raises(SglpatchError) as e:
        matrix._parse_range("0.5.99", "sglang", "0.5.9")
    assert e.value.exit_code == exitcodes.USAGE  # as `rebase --onto 0.5.99`; was 1 after a failed download
    assert str(e.value) == "sglang 0.5.99 is not a release on the index; the nearest: 0.5.10.post1, 0.5.11 (0.5.11 is the newest)"
    with pytest.raises(SglpatchError) as e:
        matrix._parse_range("0.5.11..0.5.10", "sglang", "0.5.9")
    assert e.value.exit_code == exitcodes.USAGE
    assert str(e.value) == ("--releases 0.5.11..0.5.10: 0.5.11 comes after 0.5.10 (the range is inclusive, oldest first): "
                            "did you mean 0.5.10..0.5.11?")
    assert matrix._parse_range("0.5.11", "sglang", "0.5.9") == ["0.5.11"]


def test_profile_report_refuses_batch_size_0_and_drops_an_empty_batch_bucket(tmp_path):
    from sglpatch.gpu import profile_report as pr

    rec = {"cycles": 10, "cycle_ms_mean": 20.0, "draft_ms_mean": 5.0, "verify_ms_mean": 10.0, "extend_ms_mean": 5.0,
           "accept_length": 2.5, "baseline_step_ms": 10.0}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec | {"batch_size": 0}) + "\n")  # version 1: tokens / (cycles x 0) divided by zero
    with pytest.raises(SglpatchError) as e:
        pr.load(path)
    assert str(e.value) == f"{path}:1: field batch_size is 0, expected a number > 0"
    buckets = {"0": {"cycles": 5, "cycle_ms_mean": 20.0, "accept_length": 2.0}, "1": {"cycles": 10, "cycle_ms_mean": 20.0, "accept_length": 2.5}}
    path.write_text(json.dumps(rec | {"tokens": 25.0, "requests": 10.0, "by_batch_size": buckets}) + "\n")
    s = pr.summarize(pr.load(path))
    assert list(s["by_batch_size"]) == ["1"] and s["by_batch_size"]["1"]["accept_length"] == 2.5
    text = pr.format_text(str(path), s, [])
    assert "batch 0" not in text and "inf" not in text and "nan" not in text


def test_profile_report_of_a_device_is_refused_not_read_forever(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sglpatch.cli", "profile-report", "/dev/zero"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=60, cwd=tmp_path)
    assert r.returncode == exitcodes.ERROR and r.stderr.strip().splitlines() == [
        "sglpatch: error: /dev/zero: not a regular file (a device, a FIFO or a socket); copy the profile to a file and pass that"]


def test_profile_report_draws_no_verdict_from_a_batch_1_bucket_without_cycles(tmp_path):
    """A by_batch_size bucket "1" with 0 cycles (no batch-1 cycle in that interval) said "speculation is
    SLOWER (0.00x the baseline)": no data, no verdict."""
    rec = {"cycles": 10, "cycle_ms_mean": 20.0, "draft_ms_mean": 5.0, "verify_ms_mean": 10.0, "extend_ms_mean": 5.0,
           "accept_length": 2.5, "baseline_step_ms": 10.0, "tokens": 100.0, "requests": 40.0,
           "by_batch_size": {"1": {"cycles": 0, "cycle_ms_mean": 0.0, "accept_length": 0.0},
                             "4": {"cycles": 10, "cycle_ms_mean": 20.0, "accept_length": 2.5}}}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    s = profile_report.summarize(profile_report.load(path))
    assert list(s["by_batch_size"]) == ["4"] and s["speedup"] is None and s["break_even_accept_length"] is None
    text = profile_report.format_text(str(path), s, profile_report.predictions(s, [2.0]))
    assert "SLOWER" not in text and "verdict" not in text and "no batch-1 cycles" in text, text


@pytest.mark.parametrize("script, table", [("test.sh", "exit codes (pytest's, not the sglpatch table):\n  0    every selected "
                                            "test passed\n  1    a test failed\n"), ("mutants.sh", None)])
def test_test_and_mutants_help_show_their_exit_codes(script, table):
    table = table or "\n".join(exitcodes.lines())
    r = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and table in r.stdout, r.stdout


def test_the_readmes_checkable_figures_agree_with_the_tree():
    """The patch count (read from `series`, whatever it is today), the exit-code table (from
    sglpatch.exitcodes) and test.sh's own codes (its header): the README said `[1/4]` with 5 patches,
    and that every scripts/*.sh exits with the table, test.sh included."""
    readme = (ROOT / "README.md").read_text()
    n = len([ln for ln in (ROOT / "series").read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")])
    for m in re.finditer(r"\[(\d+)/(\d+)\]", readme):
        assert int(m.group(2)) == n, f"README.md: {m.group(0)} but the series has {n} patches"
    table = readme[readme.index("## What is in the series"):]
    table = table[: table.index("\n\n", table.index("|---|"))]
    assert len(re.findall(r"^\| P\d+ \|", table, re.M)) == n, "README.md's series table has a row per patch"
    assert "\n".join("    " + line for line in exitcodes.lines()) in readme
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    codes = re.findall(r"^#   (\d+)  ", test_sh[test_sh.index("# exit codes (pytest's"):], re.M)
    said = readme[readme.index("`scripts/test.sh` is the exception"):].split("\n\n")[0]
    assert codes and all(f"{c} " in said for c in codes), (codes, said)
    assert "but test.sh" in exitcodes.lines()[0]
    assert "builds two venvs" in readme
