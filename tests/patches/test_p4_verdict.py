"""P4 (0004-eagle-verify-profiling) on 0.5.9: the verdict sentence the profiler itself logs every
SGLANG_VERIFY_PROFILE_INTERVAL cycles (issue 39), not only the one `sglpatch profile-report` prints
(tests/test_profile_report.py).

The patched spec_profiler runs in the patched venv, driven by tests/p4_verdict_cases.py (the
cases, the exact clock and every expected line; the 0.5.23 line's test runs the same ones). Each
line is asserted whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p4_verdict_cases import EXPECTED

CODE = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import p4_verdict_cases
import sglang.srt.speculative.spec_profiler as sp
print(json.dumps(p4_verdict_cases.run_cases(sp)))
"""


@pytest.fixture(scope="module")
def logged(run_patched):
    proc = run_patched(CODE, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(EXPECTED))
def test_profiler_logs_the_verdict_sentence_exactly(logged, case):
    """One line per interval (no other record), the verdict from batch 1's accept length against
    batch 1's break-even, whatever the other batch sizes commit."""
    assert logged[case] == [EXPECTED[case]]
