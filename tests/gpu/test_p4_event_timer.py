"""P4 on a real GPU: the cost and accuracy of the EAGLE cycle event timer.

Needs torch with CUDA only (no sglang). The profiler module is loaded BY FILE PATH:
$SGLPATCH_SPEC_PROFILER if set, else it is rebuilt from the new-file hunk of
patches/0004-eagle-verify-profiling.patch (the exact text the patch adds), so the test
runs on a bare GPU box holding just this repository.

Run:  python -m pytest -q -s tests/gpu/test_p4_event_timer.py
 or:  python tests/gpu/test_p4_event_timer.py        (no pytest needed; prints the same figures)
"""

from __future__ import annotations

import importlib.util
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    import pytest
except ImportError:  # script mode on a bare GPU box: torch only
    pytest = None

if pytest is not None:
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: skipped before torch loads (every xdist worker collects this)
        pytest.skip("needs a CUDA GPU: no NVIDIA driver here (/dev/nvidiactl)", allow_module_level=True)
    torch = pytest.importorskip("torch")
    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]
else:
    import torch

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "patches" / "0004-eagle-verify-profiling.patch"
MODULE = "python/sglang/srt/speculative/spec_profiler.py"


def _module_source_from_patch(patch: Path) -> str:
    text = patch.read_text()
    m = re.search(
        rf"^diff --git a/{re.escape(MODULE)} b/{re.escape(MODULE)}\nnew file mode.*?\n@@ -0,0 \+1,(\d+) @@\n",
        text,
        re.M | re.S,
    )
    assert m, f"{patch} does not add {MODULE}"
    lines = text[m.end() :].split("\n")[: int(m.group(1))]
    assert all(x.startswith("+") for x in lines), "unexpected hunk shape"
    return "\n".join(x[1:] for x in lines) + "\n"


def load_profiler_module():
    path = os.environ.get("SGLPATCH_SPEC_PROFILER")
    if not path:
        path = os.path.join(tempfile.mkdtemp(prefix="p4gpu-"), "spec_profiler.py")
        Path(path).write_text(_module_source_from_patch(PATCH))
    spec = importlib.util.spec_from_file_location("spec_profiler_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gpu_sleep_ms(ms: float, cycles_per_ms: float):
    torch.cuda._sleep(int(ms * cycles_per_ms))


def _calibrate() -> float:
    """GPU clock cycles per ms for torch.cuda._sleep."""
    torch.cuda._sleep(1_000_000)  # warm-up
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20_000_000
    s.record()
    torch.cuda._sleep(n)
    e.record()
    e.synchronize()
    return n / s.elapsed_time(e)


def measure(n_cycles: int = 2000) -> dict:
    sp = load_profiler_module()
    cpm = _calibrate()
    x = torch.randn(256, 256, device="cuda")
    accept = torch.tensor([3, 2, 3, 2], dtype=torch.int32, device="cuda")

    def cycle(prof, draft_ms, verify_ms, extend_ms):
        if prof:
            prof.begin_cycle()
        _gpu_sleep_ms(draft_ms, cpm)
        if prof:
            prof.end_draft()
        _gpu_sleep_ms(verify_ms, cpm)
        acc = accept + 0  # produced on the stream, like the real verify
        if prof:
            prof.end_verify(acc)
        _gpu_sleep_ms(extend_ms, cpm)
        if prof:
            prof.end_cycle()

    # 1) host cost of the profiler calls per cycle, GPU busy with tiny kernels
    prof = sp.SpecCycleProfiler(interval=10**9, baseline_step_ms=12.2, name="gpu-test")
    assert prof.timer == "cuda"
    for _ in range(50):  # warm-up: event pool, pinned allocator
        cycle(prof, 0, 0, 0)
    torch.cuda.synchronize()
    per_cycle = []
    for _ in range(n_cycles):
        t0 = time.perf_counter_ns()
        prof.begin_cycle()
        y = x @ x
        prof.end_draft()
        y = y @ x
        prof.end_verify(accept + 0)
        y = y + 1
        prof.end_cycle()
        per_cycle.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    # same loop without the profiler: the kernels' own launch cost
    base = []
    for _ in range(n_cycles):
        t0 = time.perf_counter_ns()
        y = x @ x
        y = y @ x
        _ = accept + 0
        y = y + 1
        base.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    overhead_us = (statistics.median(per_cycle) - statistics.median(base)) / 1e3

    # 2) no host sync: the host runs ahead of a GPU that is busy 30 ms per cycle
    # one reporting window for all 30 cycles, so the summary covers them all
    prof2 = sp.SpecCycleProfiler(interval=1000, baseline_step_ms=12.2, name="gpu-test")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        cycle(prof2, 1.0, 28.0, 1.0)
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()

    # 3) accuracy: phases of known GPU duration
    for _ in range(25):
        cycle(prof2, 1.0, 28.0, 1.0)
        torch.cuda.synchronize()
    rec = prof2.summary() or {}
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "overhead_us_per_cycle": overhead_us,
        "profiled_host_us_median": statistics.median(per_cycle) / 1e3,
        "unprofiled_host_us_median": statistics.median(base) / 1e3,
        "events_created": prof.num_events_created,
        "host_ms_for_5_cycles_of_30ms_gpu": host_ms,
        "summary": rec,
    }


def _print(r: dict):
    s = r["summary"]
    print(
        f"\nP4 event timer on {r['device']} (torch {r['torch']}): "
        f"{r['overhead_us_per_cycle']:.1f} us host overhead per cycle "
        f"({r['profiled_host_us_median']:.1f} us profiled vs {r['unprofiled_host_us_median']:.1f} us unprofiled, "
        f"median of cycles; {r['events_created']} events created in total); "
        f"= {100 * r['overhead_us_per_cycle'] / 30000:.3f}% of a 30 ms cycle. "
        f"Host time to issue 5 cycles of 30 ms GPU work: {r['host_ms_for_5_cycles_of_30ms_gpu']:.1f} ms (no sync). "
        f"Measured phases for 1/28/1 ms GPU sleeps: draft {s.get('draft_ms_median', float('nan')):.2f}, "
        f"verify {s.get('verify_ms_median', float('nan')):.2f}, extend {s.get('extend_ms_median', float('nan')):.2f}, "
        f"accept length {s.get('accept_length', float('nan')):.2f}."
    )


def test_event_timer_overhead_and_accuracy():
    r = measure()
    _print(r)
    s = r["summary"]
    assert r["events_created"] <= 4 * 10, "events must come from a bounded, reused pool"
    assert r["host_ms_for_5_cycles_of_30ms_gpu"] < 60, "the host waited for the GPU: a sync in the hot path"
    assert s["timer"] == "cuda" and s["cycles"] >= 25
    assert s["verify_ms_median"] == pytest.approx(28.0, rel=0.1)
    assert s["draft_ms_median"] == pytest.approx(1.0, rel=0.3, abs=0.1)
    assert s["extend_ms_median"] == pytest.approx(1.0, rel=0.3, abs=0.1)
    assert s["accept_length"] == pytest.approx(2.5)
    assert r["overhead_us_per_cycle"] < 200, "per-cycle cost must stay far below a 30 ms cycle"


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("skipped: needs a CUDA GPU")
        sys.exit(0)
    _print(measure())
