"""Write a P4 verify-profile file the way the server does, without a GPU or a model: P4's own
profiler (sglang.srt.speculative.spec_profiler, from the patched tree this Python imports) is fed
EAGLE-3 cycles on a virtual clock. The phase times and accept lengths are the user's figures from
before the series (draft 0.6 ms, verify 29.1 ms, draft-extend 0.3 ms: a 30 ms cycle; accept length
2.0 at batch 1), not a measurement. On the box the server writes this file itself, with
SGLANG_VERIFY_PROFILE=1 SGLANG_VERIFY_PROFILE_FILE=/data/prof.jsonl.

usage: python docs/examples/p4_profile_example.py OUT.jsonl   (with the serving Python)
"""

import sys

from sglang.srt.speculative.spec_profiler import SpecCycleProfiler

NOW = [0.0]  # the virtual clock, in ms


class Event:
    def __init__(self):
        self.t = 0.0

    def record(self, stream=None):
        self.t = NOW[0]

    def query(self):
        return True

    def elapsed_time(self, end):
        return end.t - self.t


def main(out: str) -> None:
    open(out, "w").close()
    prof = SpecCycleProfiler(interval=100, path=out, baseline_step_ms=12.2, event_factory=Event, timer_name="example")
    for i in range(300):  # three records of 100 cycles
        prof.begin_cycle()
        NOW[0] += 0.6
        prof.end_draft()
        NOW[0] += 29.1
        prof.end_verify([(1, 2, 3)[i % 3]])  # committed tokens per request, bonus included: 2.0 on average
        NOW[0] += 0.3
        prof.end_cycle()
    print(f"{out}: {sum(1 for _ in open(out))} records of {prof.interval} cycles")


if __name__ == "__main__":
    main(sys.argv[1])
