"""P4's verdict cases, shared by the 0.5.9 test (tests/patches/test_p4_verdict.py, in the patched
venv) and the 0.5.23 one (tests/real_0523/test_p4_0523.py, on 0.5.23's own module): the two lines
carry the same spec_profiler.py, and each patch is tested where a fault planted in it shows.

run_cases drives a spec_profiler module through its public marks (begin_cycle, end_draft,
end_verify, end_cycle) with an exact clock as its event source (event_factory=): each cycle takes
1 / 17 / 2 ms (draft / verify / extend) unless a case says otherwise, so every number in the line
is known. Both sides of the break-even and on it (accept length 1.75, 2.25 and exactly 2.00
against 20 ms / 10 ms = 2.00: a tie does not beat the baseline, as profile-report says too), with
batch 1 and the other batch sizes pulling the overall accept length the other way.
Standard library only (it runs inside the venvs under test).
"""

from __future__ import annotations

import logging


class _Clock:
    now = 0.0


class _Event:  # a timing event on an exact clock, complete once recorded
    def record(self, stream=None):
        self.t = _Clock.now

    def query(self):
        return True

    def elapsed_time(self, end):
        return end.t - self.t


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.got = []

    def emit(self, record):
        self.got.append([record.levelname, record.getMessage()])


def run_cases(sp) -> dict:
    """{case: [[level, message], ...]}: what spec_profiler module sp logs for each case."""
    cap = _Capture()
    sp.logger.addHandler(cap)
    sp.logger.setLevel(logging.DEBUG)
    out = {}
    try:
        for name, baseline, phases, batches in CASES:
            p = sp.SpecCycleProfiler(interval=len(batches), baseline_step_ms=baseline, event_factory=_Event, timer_name="exact")
            cap.got.clear()
            for i, accept_lens in enumerate(batches):
                _Clock.now = 1000.0 * i
                p.begin_cycle()
                _Clock.now += phases[0]
                p.end_draft()
                _Clock.now += phases[1]
                p.end_verify(accept_lens)
                _Clock.now += phases[2]
                p.end_cycle()
            out[name] = list(cap.got)
    finally:
        sp.logger.removeHandler(cap)
    return out


PHASES = [1.0, 17.0, 2.0]  # a 20 ms cycle: break-even 2.00 against a 10 ms step
CASES = [
    ("above", 10.0, PHASES, [[2], [2], [2], [3]]),  # batch 1 commits 2.25 tokens a cycle
    ("below", 10.0, PHASES, [[2], [2], [2], [1]]),  # 1.75
    ("tie", 10.0, PHASES, [[2], [2], [2], [2]]),  # exactly 2.00: a tie does not beat the baseline
    ("batch1_below_overall_above", 10.0, PHASES, [[2], [4, 4, 4, 4], [1], [4, 4, 4, 4]]),  # 1.50, overall 3.50
    ("batch1_above_overall_below", 10.0, PHASES, [[3], [1, 1, 1, 1], [3], [1, 1, 1, 1]]),  # 3.00, overall 1.40
    ("no_batch1", 10.0, PHASES, [[2, 3], [2, 3]]),
    ("users_cycle", 12.2, [1.0, 28.0, 1.0], [[2]]),  # the user's 30 ms cycle against 82 tok/s
]

BEATS = "speculation beats the baseline"
SLOWER = ("speculation is SLOWER than the baseline: raise the accept length (better drafter) or cut verify time, "
          "else disable speculation")
PHASE_PART = "draft 1.00/1.00, verify 17.00/17.00, extend 2.00/2.00, cycle 20.00/20.00; verify 85% of cycle"


def line(cycles: int, phases: str, stats: str, verdict: str) -> list:
    return ["INFO", f"Spec cycle profile [eagle] over {cycles} cycles (median/p90 ms): {phases}; {stats}; {verdict}."]


EXPECTED = {
    "above": line(4, PHASE_PART, "mean batch 1.00, accept len 2.25, 112.5 tok/s per request, 112.5 tok/s throughput",
                  f"batch 1: accept len 2.25, break-even accept len 2.00 vs 10 ms/step (100.0 tok/s): {BEATS}"),
    "below": line(4, PHASE_PART, "mean batch 1.00, accept len 1.75, 87.5 tok/s per request, 87.5 tok/s throughput",
                  f"batch 1: accept len 1.75, break-even accept len 2.00 vs 10 ms/step (100.0 tok/s): {SLOWER}"),
    "tie": line(4, PHASE_PART, "mean batch 1.00, accept len 2.00, 100.0 tok/s per request, 100.0 tok/s throughput",
                f"batch 1: accept len 2.00, break-even accept len 2.00 vs 10 ms/step (100.0 tok/s): {SLOWER}"),
    "batch1_below_overall_above": line(
        4, PHASE_PART, "mean batch 2.50, accept len 3.50, 175.0 tok/s per request, 437.5 tok/s throughput",
        f"batch 1: accept len 1.50, break-even accept len 2.00 vs 10 ms/step (100.0 tok/s): {SLOWER}"),
    "batch1_above_overall_below": line(
        4, PHASE_PART, "mean batch 2.50, accept len 1.40, 70.0 tok/s per request, 175.0 tok/s throughput",
        f"batch 1: accept len 3.00, break-even accept len 2.00 vs 10 ms/step (100.0 tok/s): {BEATS}"),
    "no_batch1": line(2, PHASE_PART, "mean batch 2.00, accept len 2.50, 125.0 tok/s per request, 250.0 tok/s throughput",
                      "no batch-1 cycles, so no break-even against the 10 ms/step single-stream baseline"),
    "users_cycle": line(1, "draft 1.00/1.00, verify 28.00/28.00, extend 1.00/1.00, cycle 30.00/30.00; verify 93% of cycle",
                        "mean batch 1.00, accept len 2.00, 66.7 tok/s per request, 66.7 tok/s throughput",
                        f"batch 1: accept len 2.00, break-even accept len 2.46 vs 12.2 ms/step (82.0 tok/s): {SLOWER}"),
}
