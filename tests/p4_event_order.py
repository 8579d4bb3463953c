"""Fakes of a GPU whose timing events complete late, one at a time, or never, for the P4 cycle
profiler (speculative/spec_profiler.py) of both lines (issue 29: fakes that complete every event
at once hide ordering faults). Standard library and torch only: tests/patches/test_p4_verify_profile.py
runs it in the patched 0.5.9 venv, tests/real_0523/test_p4_0523.py in the 0.5.23 venv.

    run(sp) -> dict    sp: the patched sglang.srt.speculative.spec_profiler module
"""

from __future__ import annotations


class Gpu:
    completed = 0  # the id of the last event the emulated GPU has finished (in record order)
    clock = 0.0


class SlowEvent:
    """A CUDA timing event of the emulated GPU: done only once Gpu.completed reaches it."""

    seq = 0

    def record(self, stream=None):
        SlowEvent.seq += 1
        self.id, self.t = SlowEvent.seq, Gpu.clock

    def query(self):
        return self.id <= Gpu.completed

    def elapsed_time(self, end):
        # on a real GPU this blocks (or raises) when either event is unfinished: forbid it
        assert self.query() and end.query(), f"elapsed_time on an unfinished event ({self.id}..{end.id}, done {Gpu.completed})"
        return end.t - self.t


def one_cycle(p, accept, draft=1.0, verify=29.0, extend=0.5):
    p.begin_cycle()
    Gpu.clock += draft
    p.end_draft()
    Gpu.clock += verify
    p.end_verify(accept)
    Gpu.clock += extend
    p.end_cycle()


def run(sp) -> dict:
    import torch

    out = {}
    # 1. the GPU trails the host by one event: after each cycle its extend event is still running
    #    (its verify event is done). A cycle may be read only once its last event is done
    Gpu.completed, Gpu.clock, SlowEvent.seq = 0, 0.0, 0
    p = sp.SpecCycleProfiler(interval=1000, event_factory=SlowEvent, timer_name="slow", max_pending=64)
    seen = []
    for i in range(8):
        one_cycle(p, [2], extend=0.5 + i)
        Gpu.completed = SlowEvent.seq - 1
        p.poll()
        seen.append(len(p._samples["cycle"]))
    Gpu.completed = SlowEvent.seq
    p.poll()
    out["trailing_seen"] = seen
    out["trailing_extend"] = p._samples["extend"]
    # 2. a stalled GPU: more unfinished cycles than max_pending. The oldest are dropped; once the
    #    GPU catches up, the newest max_pending cycles are the ones read, in order
    Gpu.completed, SlowEvent.seq = -1, 0
    q = sp.SpecCycleProfiler(interval=1000, event_factory=SlowEvent, timer_name="slow", max_pending=4)
    for i in range(10):
        one_cycle(q, [i + 1])
    Gpu.completed = SlowEvent.seq
    q.poll()
    out["stalled"] = {"dropped": q.num_dropped, "tokens": q._tokens, "cycles": len(q._samples["cycle"])}
    # 3. the accept lengths as a (CPU) tensor that the caller reuses before the events complete:
    #    the profiler must keep the values of its own cycle, not read the buffer late
    Gpu.completed, SlowEvent.seq = -1, 0
    r = sp.SpecCycleProfiler(interval=1000, event_factory=SlowEvent, timer_name="slow")
    buf = torch.tensor([2, 3], dtype=torch.int32)
    one_cycle(r, buf)
    buf.fill_(9)  # the next batch's accept lengths land in the same buffer
    Gpu.completed = SlowEvent.seq
    r.poll()
    out["reused_buffer"] = {"tokens": r._tokens, "requests": r._requests}
    return out


def check(out: dict) -> None:
    """The assertions both lines share."""
    # cycle k is read one cycle later, when its extend event has completed, never earlier
    assert out["trailing_seen"] == list(range(8)), out["trailing_seen"]
    assert out["trailing_extend"] == [0.5 + i for i in range(8)], out["trailing_extend"]
    assert out["stalled"] == {"dropped": 6, "tokens": 7.0 + 8 + 9 + 10, "cycles": 4}, out["stalled"]
    assert out["reused_buffer"] == {"tokens": 5.0, "requests": 2}, out["reused_buffer"]
