"""Latency samples of one backend at one size: eager, or captured in a CUDA graph (as SGLang's
decode runs); on CPU (--device cpu, gloo: the tests) timed with perf_counter and the "graph"
replayed by re-running the recorded ops (CpuReplay).

One sample = `inner` ops back to back (inputs rotate among `inner` buffers) between two CUDA
events (or perf_counter reads), divided by `inner`; the ranks meet on a CPU barrier before each
sample.  The caller takes, per sample, the least time over the ranks (the last to arrive, which
waited for nobody)."""

from __future__ import annotations

import time


class CpuReplay:
    """--device cpu: stands in for a CUDA graph by re-running the captured ops into the same
    output tensors; the bookkeeping around it is the one the GPU run uses."""

    def __init__(self, fn):
        self.fn = fn
        self.outs = fn()

    def replay(self):
        for o, new in zip(self.outs, self.fn()):
            if hasattr(o, "copy_") and hasattr(new, "shape"):
                o.copy_(new)


def _poison(torch, backend, outs):
    if hasattr(backend, "poison"):
        backend.poison(outs)
    elif not backend.in_place:
        for o in outs:
            if isinstance(o, torch.Tensor):
                o.fill_(float("nan"))


def measure(backend, ctx, rows: int, mode: str, beat=lambda what: None) -> dict:
    """{"ok", "max_abs_err", "detail", "times_us"} of this rank; the first sample's outputs and
    the last one's are both checked."""
    torch, dist = ctx.torch, ctx.dist
    inner = ctx.args.inner
    backend.prepare(rows, inner)
    times: list[float] = []
    cuda = ctx.is_cuda
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def sample(fn):
        sync()
        dist.barrier(group=ctx.cpu_group)
        if cuda:
            start.record()
            res = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / inner)
        else:
            t0 = time.perf_counter()
            res = fn()
            times.append((time.perf_counter() - t0) * 1e6 / inner)
        return res

    def run_all():
        return [backend.op(k) for k in range(inner)]

    first_check = None
    graph = None
    if mode == "eager":
        for _ in range(ctx.args.warmup):
            backend.refill()
            run_all()
        outs = None
        for s in range(ctx.args.samples):
            backend.refill()
            outs = sample(run_all)
            if s == 0:
                first_check = backend.check(outs)
    else:
        beat(f"{backend.name} [{rows}] graph: warm-up and capture")
        if cuda:
            # warm up on a side stream as torch.cuda.graph wants, then capture `inner` ops
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    backend.refill()
                    run_all()
            torch.cuda.current_stream().wait_stream(side)
            sync()
            backend.refill()
            graph = torch.cuda.CUDAGraph()
            with backend.capture_ctx():
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    outs = run_all()
            sync()
            replay = graph.replay
        else:
            backend.refill()
            rec = CpuReplay(run_all)
            outs, replay = rec.outs, rec.replay
        for _ in range(ctx.args.warmup):
            backend.refill()
            replay()
        for s in range(ctx.args.samples):
            backend.refill()
            _poison(torch, backend, outs)
            sample(replay)
            if s == 0:
                first_check = backend.check(outs)
        sync()
    ok, err, detail = backend.check(outs)
    if first_check is not None and not first_check[0]:
        ok, err, detail = first_check
    del graph
    return {"ok": ok, "max_abs_err": err, "detail": detail, "times_us": times}
