"""P4 on SGLang 0.5.23's own modules (issue 18): EAGLEWorkerV2's real __init__ (its real order:
the hook after _hosts_draft and _draft_worker), the real environ switches and spec_profiler.

Stand-ins only for what needs CUDA: EagleDraftWorker (loads the draft model on the GPU) and
EAGLEWorkerV2.verify (the target forward); the context is a real resolved ServerArgs
published into a context of SGLang's own."""

from __future__ import annotations

import json
import types

import pytest
import torch

from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import eagle_worker_v2 as ew

ENV = ("SGLANG_VERIFY_PROFILE", "SGLANG_VERIFY_PROFILE_INTERVAL", "SGLANG_VERIFY_PROFILE_FILE",
       "SGLANG_VERIFY_PROFILE_BASELINE_STEP_MS", "SGLANG_BASELINE_STEP_MS")


class Draft:
    """EagleDraftWorker stand-in (the real one loads the draft model onto the GPU)."""

    parallel_layout = None

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        self.trace = []

    def draft(self, batch):
        self.trace.append("draft")

    def _draft_extend_for_decode(self, batch, out):
        self.trace.append("extend")


@pytest.fixture
def worker(model_dir, monkeypatch):
    from sglang.srt.runtime_context import create_context, get_parallel, use_context

    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(ew, "EagleDraftWorker", Draft)
    commits = []

    def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):  # the target forward (CUDA)
        lens = commits.pop(0) if commits else [2, 3]
        return types.SimpleNamespace(accept_lens=torch.tensor(lens, dtype=torch.int32))

    monkeypatch.setattr(ew.EAGLEWorkerV2, "verify", verify)
    sa = ServerArgs(model_path=str(model_dir), device="cpu", tp_size=2, speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=str(model_dir), speculative_num_steps=3,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    sa.resolve_once()
    ctx = create_context(sa, role="test")

    def make(tp_rank=0, last_pp_rank=True):
        pp_group = types.SimpleNamespace(is_last_rank=last_pp_rank)
        with use_context(ctx), get_parallel().override(tp_rank=tp_rank, dp_rank=3, pp_group=pp_group):
            return ew.EAGLEWorkerV2(sa, gpu_id=0, nccl_port=0, target_worker=None)

    return types.SimpleNamespace(make=make, commits=commits)


def cycle(w, n=1):
    for _ in range(n):
        w._draft_worker.draft(None)
        out = w.verify(None)
        w._draft_worker._draft_extend_for_decode(None, out)


def test_off_wraps_nothing(worker):
    w = worker.make()
    assert w.spec_profiler is None and w._hosts_draft and isinstance(w._draft_worker, Draft)
    assert "verify" not in vars(w) and "draft" not in vars(w._draft_worker)


def test_on_times_real_worker_cycles(worker, monkeypatch, tmp_path):
    out = tmp_path / "profile.jsonl"
    for k, v in (("SGLANG_VERIFY_PROFILE", "1"), ("SGLANG_VERIFY_PROFILE_INTERVAL", "2"),
                 ("SGLANG_VERIFY_PROFILE_FILE", str(out)), ("SGLANG_VERIFY_PROFILE_BASELINE_STEP_MS", "10")):
        monkeypatch.setenv(k, v)
    assert worker.make(tp_rank=1).spec_profiler is None  # TP rank 0 only
    assert worker.make(last_pp_rank=False).spec_profiler is None  # only the stage that hosts the draft
    w = worker.make()
    prof = w.spec_profiler
    assert prof is not None and prof.name == "eagle_v2" and prof.interval == 2
    worker.commits[:] = [[4], [1, 1, 1]]  # a batch of 1 commits 4, a batch of 3 commits 1+1+1
    cycle(w, 2)
    prof.poll()
    assert w._draft_worker.trace == ["draft", "extend"] * 2
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["version"] == 2 and rec["name"] == "eagle_v2" and rec["dp_rank"] == 3 and rec["cycles"] == 2
    assert rec["accept_length"] == pytest.approx(1.75) and rec["tokens"] == 7 and rec["requests"] == 4
    assert set(rec["by_batch_size"]) == {"1", "3"} and rec["baseline_step_ms"] == 10.0


def test_baseline_env_names(worker, monkeypatch):
    from sglang.srt.environ import envs
    from sglang.srt.speculative.spec_profiler import baseline_step_ms_from_env

    assert envs.SGLANG_VERIFY_PROFILE.get() is False and envs.SGLANG_VERIFY_PROFILE_INTERVAL.get() == 100
    assert baseline_step_ms_from_env() == 12.2
    monkeypatch.setenv("SGLANG_BASELINE_STEP_MS", "20")  # the deprecated alias
    assert baseline_step_ms_from_env() == 20.0
    monkeypatch.setenv("SGLANG_VERIFY_PROFILE_BASELINE_STEP_MS", "15")
    assert baseline_step_ms_from_env() == 15.0


def test_events_completing_late_or_never_are_read_in_order():
    """The profiler on a GPU whose events complete one cycle late (the extend still running), or
    never (more unfinished cycles than max_pending), and accept lengths in a buffer the caller
    reuses: the shared fakes of tests/p4_event_order.py (issue 29)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import p4_event_order

    from sglang.srt.speculative import spec_profiler as sp

    p4_event_order.check(p4_event_order.run(sp))


def test_profiler_logs_the_verdict_sentence_exactly():
    """The verdict line 0.5.23's spec_profiler logs itself every interval (issue 39): the same cases
    and whole lines as 0.5.9's (tests/p4_verdict_cases.py), batch 1 against its break-even."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import p4_verdict_cases

    from sglang.srt.speculative import spec_profiler as sp

    assert p4_verdict_cases.run_cases(sp) == {case: [want] for case, want in p4_verdict_cases.EXPECTED.items()}
