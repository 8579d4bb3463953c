"""sglpatch profile-report: the arithmetic on a known file, and the CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglpatch.gpu import profile_report as pr
from sglpatch.errors import SglpatchError


def _rec(cycles, draft, verify, extend, accept, baseline=12.2, **extra):
    cycle = draft + verify + extend
    rec = {"version": 1, "name": "eagle", "timer": "cuda", "cycles": cycles, "batch_size": 1.0, "accept_length": accept,
           "baseline_step_ms": baseline, "break_even_accept_length": cycle / baseline}  # fmt: skip
    for phase, v in (("draft", draft), ("verify", verify), ("extend", extend), ("cycle", cycle)):
        rec.update({f"{phase}_ms_mean": v, f"{phase}_ms_median": v, f"{phase}_ms_p90": v * 1.1})
    rec.update(extra)
    return rec


KNOWN = [_rec(100, 0.6, 29.1, 0.3, 2.0), _rec(300, 0.7, 30.0, 0.3, 2.2)]


@pytest.fixture
def known_file(tmp_path):
    path = tmp_path / "profile.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in KNOWN) + "\n")  # trailing blank line is fine
    return path


def test_summary_arithmetic_on_known_file(known_file):
    s = pr.summarize(pr.load(known_file))
    # weights are cycles: (100 * 30.0 + 300 * 31.0) / 400 = 30.75 ms
    assert s["cycles"] == 400 and s["intervals"] == 2
    assert s["cycle_ms_mean"] == pytest.approx(30.75)
    assert s["verify_ms_mean"] == pytest.approx((100 * 29.1 + 300 * 30.0) / 400)  # 29.775
    assert s["verify_frac"] == pytest.approx(29.775 / 30.75)  # 96.8 %
    assert s["accept_length"] == pytest.approx((100 * 2.0 + 300 * 2.2) / 400)  # 2.15
    assert s["tok_s"] == pytest.approx(1000 * 2.15 / 30.75)  # 69.9 tok/s
    assert s["baseline_tok_s"] == pytest.approx(1000 / 12.2)
    assert s["break_even_accept_length"] == pytest.approx(30.75 / 12.2)  # 2.52
    assert s["speedup"] == pytest.approx((1000 * 2.15 / 30.75) / (1000 / 12.2))
    assert s["cycle_ms_p90_max"] == pytest.approx(31.0 * 1.1)
    assert s["baseline_source"] == "file"


def test_users_numbers():
    # 30 ms cycle, 12.2 ms baseline: break-even 2.46; at accept length 2.0, 66.7 tok/s
    assert round(pr.break_even_accept_length(30.0, 12.2), 2) == 2.46
    assert pr.predicted_tok_s(30.0, 2.0) == pytest.approx(66.667, abs=1e-3)
    s = pr.summarize([_rec(50, 0.6, 29.1, 0.3, 2.0)])
    preds = pr.predictions(s, [2.46, 3.0])
    assert preds[0]["tok_s"] == pytest.approx(82.0)  # break-even reproduces the baseline
    assert preds[1]["tok_s"] == pytest.approx(100.0)


def test_baseline_override(known_file):
    s = pr.summarize(pr.load(known_file), baseline_step_ms=10.0)
    assert s["break_even_accept_length"] == pytest.approx(3.075)
    assert s["baseline_source"] == "command line"


def test_records_without_baseline_use_default(tmp_path):
    rec = _rec(10, 1.0, 20.0, 1.0, 2.0)
    del rec["baseline_step_ms"]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    s = pr.summarize(pr.load(path))
    assert s["baseline_step_ms"] == pr.DEFAULT_BASELINE_STEP_MS == 12.2


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("", "empty"),
        ("{not json\n", ":1: not valid JSON"),
        ("[1, 2]\n", ":1: expected a JSON object"),
        (json.dumps({"cycles": 3}) + "\n", ":1: missing field(s)"),
        (json.dumps(_rec(10, 1, 2, 3, "two")) + "\n", "field accept_length"),
        (json.dumps(_rec(0, 1, 2, 3, 2.0)) + "\n", "must be > 0"),
        (json.dumps(KNOWN[0]) + "\n" + "garbage\n", ":2: not valid JSON"),
    ],
)
def test_malformed_files_give_one_line_errors(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(SglpatchError) as exc:
        pr.load(path)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(SglpatchError, match="no such file.*SGLANG_VERIFY_PROFILE=1"):
        pr.load(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------- CLI end to end


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "sglpatch.cli", "profile-report", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_text(known_file):
    proc = _cli(known_file, "--accept-length", "2.46", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "400 cycles in 2 interval(s)" in out
    assert "verify share of cycle: 96.8%" in out
    assert "break-even accept length: 2.52" in out
    assert "SLOWER" in out  # 2.15 < 2.52
    assert "predicted at accept length 3: 97.6 tok/s" in out


def test_cli_json(known_file):
    proc = _cli(known_file, "--json", "--baseline-step-ms", "12.2", "--accept-length", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["summary"]["break_even_accept_length"] == pytest.approx(30.75 / 12.2)
    assert data["predictions"] == [
        {"accept_length": 3.0, "tok_s": pytest.approx(3000 / 30.75), "speedup": pytest.approx(3000 / 30.75 * 0.0122)}
    ]


def test_cli_missing_file_is_one_line_error(tmp_path):
    proc = _cli(tmp_path / "nope.jsonl")
    assert proc.returncode == 1
    assert proc.stderr.startswith("sglpatch: error: ") and proc.stderr.count("\n") == 1
    assert proc.stdout == ""


def test_cli_malformed_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(KNOWN[0]) + "\n{oops\n")
    proc = _cli(path)
    assert proc.returncode == 1 and ":2: not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("bad", [["--accept-length", "0"], ["--accept-length", "x"], ["--baseline-step-ms", "-1"]])
def test_cli_rejects_bad_numbers(known_file, bad):
    proc = _cli(known_file, *bad)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
