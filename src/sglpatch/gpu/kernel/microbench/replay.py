"""Back-to-back CUDA-graph replays of one allreduce, each compared with NCCL on the same inputs
(issue 53): the hazard an end barrier guards.  A fused allreduce + add that returns before every
peer has read its buffers passes a microbenchmark timed with a host sync per sample, and corrupts
the next reduction when SGLang's graphs replay it back to back.

For each backend and size: one CUDA graph holds one step -- a device counter is advanced, a fresh
input is drawn on the device (integers in [-b, b] as bf16, b = stress.value_bound: every sum is exact
in any order), stored in an input ring at the counter's slot, reduced by the backend (for a fused
backend: allreduce + residual add + RMSNorm) and its output stored in an output ring at that slot.
The graph is replayed N times back to back, no host sync and no other collective in between; then
NCCL reduces the whole input ring in one call and one device pass compares every replay's output
with it: exactly, or for the fused norm within two bf16 ulps (common.check_fused's bound).  One host
read per backend and size.  On CPU (--device cpu, gloo: the tests) the step is run N times instead of
replayed, with the same bookkeeping.
"""

from __future__ import annotations

import functools

from sglpatch.gpu.kernel.microbench.common import (
    BF16_NORM_ATOL, BF16_NORM_RTOL, RMS_EPS, Backend, add_rmsnorm_reference, gather, norm_inputs,
    on_every_rank,
)
from sglpatch.gpu.kernel.microbench.stress import value_bound

DEFAULT_REPLAYS = 64


def has_replay_op(backend) -> bool:
    """A plain backend replays its stress_op; a fused one its fused_op."""
    if getattr(backend, "fused", False):
        return hasattr(backend, "fused_op")
    return type(backend).stress_op is not Backend.stress_op


def _first(torch, mask, n: int):
    """(replays with a difference, index of the first, flat element inside it) of a [n, numel] mask."""
    per = mask.reshape(n, -1).sum(1)
    bad = int((per > 0).sum())
    if not bad:
        return 0, None, None
    k = int(torch.nonzero(per)[0])
    return bad, k, int(torch.nonzero(mask.reshape(n, -1)[k])[0])


def replay_one(backend, ctx, rows: int, n: int, beat=lambda what: None) -> dict:
    """This rank's check of one backend at [rows, hidden] over n back-to-back replays."""
    torch, dist = ctx.torch, ctx.dist
    h, dev, bf = ctx.hidden, ctx.device, torch.bfloat16
    fused = getattr(backend, "fused", False)
    b = value_bound(ctx.world_size)
    torch.manual_seed(4321 + ctx.rank * 7919 + rows)
    slot = torch.full((1,), -1, dtype=torch.int64, device=dev)
    x = torch.zeros((rows, h), dtype=bf, device=dev)
    ins = torch.zeros((n, rows, h), dtype=bf, device=dev)
    outs = [torch.full((n, rows, h), float("nan"), dtype=bf, device=dev) for _ in range(2 if fused else 1)]
    if fused:
        gamma, residual = norm_inputs(torch, rows, h, dev)
        res_o, norm_o = torch.empty_like(residual), torch.empty_like(residual)

    def step():  # what the graph holds: no host value is read
        slot.add_(1)
        x.random_(-b, b + 1)
        ins.index_copy_(0, slot, x.unsqueeze(0))
        if fused:
            backend.fused_op(x, residual, gamma, res_o, norm_o)
            outs[0].index_copy_(0, slot, res_o.unsqueeze(0))
            outs[1].index_copy_(0, slot, norm_o.unsqueeze(0))
        else:
            outs[0].index_copy_(0, slot, backend.stress_op(x, slot).unsqueeze(0))

    beat(f"replay {backend.name} [{rows},{h}]: warm-up and capture")
    if ctx.is_cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # eager first: plans and buffers are made outside the capture
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with backend.capture_ctx():
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step()
        slot.fill_(-1)
        for o in outs:
            o.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier(group=ctx.cpu_group)
        beat(f"replay {backend.name} [{rows},{h}]: {n} back-to-back replays")
        for _ in range(n):  # back to back: no host sync, no other collective in between
            graph.replay()
        torch.cuda.synchronize()
    else:
        dist.barrier(group=ctx.cpu_group)
        for _ in range(n):
            step()
    beat(f"replay {backend.name} [{rows},{h}]: NCCL on the same inputs")
    dist.all_reduce(ins)  # the reference: NCCL (gloo on CPU) over every replay's input at once
    if fused:
        res_ref, norm_ref = add_rmsnorm_reference(torch, ins, residual, gamma, RMS_EPS)
        checks = [("residual", outs[0], outs[0].float().ne(res_ref), res_ref),
                  ("norm", outs[1], ~((outs[1].float() - norm_ref).abs() <= BF16_NORM_ATOL
                                      + BF16_NORM_RTOL * norm_ref.abs()), norm_ref)]
    else:
        checks = [("output", outs[0], outs[0].ne(ins), ins)]
    res = {"mismatched_replays": 0, "first_mismatch": None}
    for name, got, mask, ref in checks:
        bad, k, e = _first(torch, mask, n)
        if bad and (res["first_mismatch"] is None or k < res["first_mismatch"]["replay"]):
            res["first_mismatch"] = {"replay": k, "rank": ctx.rank, "output": name, "element": [e // h, e % h],
                                     "got": float(got.reshape(n, -1)[k, e]), "nccl": float(ref.reshape(n, -1)[k, e])}
        res["mismatched_replays"] = max(res["mismatched_replays"], bad)
    return res


def run_replay(ctx, backend, label: str, sizes: list[int], n: int, wd, log) -> list[dict]:
    """Every size the backend takes (all ranks agree), one row each, merged over the ranks."""
    out = []
    if not has_replay_op(backend):
        return [{"backend": label, "status": "declined", "rows": None, "replays": n,
                 "detail": "no capturable op for the replay check"}]
    for rows in sizes:
        reasons = gather(ctx, backend.supports(rows))
        row = {"backend": label, "rows": rows, "hidden": ctx.hidden, "replays": n,
               "graph_impl": "cuda_graph" if ctx.is_cuda else "cpu_repeat"}
        if any(reasons):
            out.append({**row, "status": "declined", "detail": next(r for r in reasons if r)})
            continue
        allr, exc = on_every_rank(ctx, functools.partial(replay_one, backend, ctx, rows, n, wd.beat))
        if exc:
            row.update(status="error", detail=exc)
        else:
            firsts = [a["first_mismatch"] for a in allr if a["first_mismatch"]]
            first = min(firsts, key=lambda f: (f["replay"], f["rank"])) if firsts else None
            row.update(status="mismatch" if first else "ok", first_mismatch=first,
                       mismatched_replays=max(a["mismatched_replays"] for a in allr))
        log(f"{label:>22} replay {rows:>5}x{ctx.hidden}: {row['status']} ({n} back-to-back replays vs NCCL)"
            + (f": first replay {row['first_mismatch']['replay']} rank {row['first_mismatch']['rank']}"
               if row.get("first_mismatch") else ""))
        out.append(row)
    return out
