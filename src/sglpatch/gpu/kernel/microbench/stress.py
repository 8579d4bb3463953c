"""--stress N: for each non-NCCL backend, N allreduces eager and N as CUDA-graph replays, each
compared exactly with NCCL's allreduce of the same input.

Iteration i takes the size sizes[i % len(sizes)] and a fresh input drawn on the device (integers
in [-b, b] as bf16, b = min(8, 256 // world_size): every sum is exact in bf16 whatever the order,
so any difference is a wrong result).  The checks run on the device into a ring of
--stress-batch slots; the host reads the ring once per batch, and the ranks agree over the CPU
group after each batch (all stop at the first batch that shows a mismatch on any rank).  A
watchdog thread ends the process with a HANG line when a step (setup, capture, or one batch)
makes no progress for --stress-step-timeout s.
"""

from __future__ import annotations

import functools
import time

from sglpatch.gpu.kernel.microbench.backends import NcclBackend, backend_class
from sglpatch.gpu.kernel.microbench.common import Backend, Watchdog, gather, on_every_rank, set_up_backend
from sglpatch.gpu.kernel.microbench.measure import CpuReplay

STRESS_DEFAULT_SIZES = [1, 2, 3, 4, 8, 16]
STRESS_SCHEMA = "sglpatch.kernel_bench.stress/1"


def value_bound(world_size: int) -> int:
    """Largest |input| such that every partial sum over world_size ranks is an exact bf16
    integer (bf16 holds integers up to 256 exactly)."""
    return max(1, min(8, 256 // max(1, world_size)))


def parse_fault(text: str, n_iter: int, world_size: int) -> dict:
    """--selftest-fault ITER[:RANK[:ELEM]]; default: the middle iteration, the last rank, element 7."""
    parts = [p for p in (text or "").split(":")]
    it = int(parts[0]) if parts and parts[0] else n_iter // 2
    rank = int(parts[1]) if len(parts) > 1 and parts[1] else world_size - 1
    elem = int(parts[2]) if len(parts) > 2 and parts[2] else 7
    return {"iteration": it, "rank": rank, "element": elem}


def group_plan(sizes: list[int], repeat: int) -> list[int]:
    """Rows of the ops of one group: each size `repeat` times back to back (as decode runs
    many allreduces of one size in a row), then the next size."""
    return [n for n in sizes for _ in range(repeat)]


class MismatchRing:
    """Check results on the device for `groups` groups of len(plan) ops each: per op, the
    number of elements that differ from the reference, the first one (index inside the op's
    output) and both values there.  A group's outputs and references are compared in one
    pass over their concatenation; nothing here syncs with the host except read()."""

    def __init__(self, torch, groups: int, plan: list[int], hidden: int, device, dtype):
        self.torch, self.plan, self.hidden = torch, plan, hidden
        g = len(plan)
        self.offsets = [0]
        for n in plan:
            self.offsets.append(self.offsets[-1] + n * hidden)
        self.numel = self.offsets[-1]
        self.seg = torch.repeat_interleave(torch.arange(g, device=device),
                                           torch.tensor([n * hidden for n in plan], device=device))
        self.pos = torch.arange(self.numel, device=device)
        self.off = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=device)
        self.count = torch.zeros((groups, g), dtype=torch.int64, device=device)
        self.first = torch.zeros((groups, g), dtype=torch.int64, device=device)
        self.got = torch.zeros((groups, g), dtype=dtype, device=device)
        self.want = torch.zeros((groups, g), dtype=dtype, device=device)

    def record(self, slot: int, out_flat, ref_flat) -> None:
        """Compare one group exactly (NaN counts as different)."""
        t = self.torch
        neq = out_flat.ne(ref_flat)
        cnt, fst = self.count[slot], self.first[slot]
        cnt.zero_()
        cnt.index_add_(0, self.seg, neq.to(t.int64))
        fst.fill_(self.numel)
        fst.scatter_reduce_(0, self.seg, t.where(neq, self.pos, self.numel), "amin")
        idx = fst.clamp(max=self.numel - 1)
        t.index_select(out_flat, 0, idx, out=self.got[slot])
        t.index_select(ref_flat, 0, idx, out=self.want[slot])
        fst.sub_(self.off)

    def read(self, n: int, start: int, rank: int) -> tuple[int, int, dict | None]:
        """One host sync for n groups starting at iteration `start`: (iterations with a
        difference, differing elements, the first difference)."""
        g = len(self.plan)
        counts = self.count[:n].reshape(-1).tolist()
        bad = [k for k, c in enumerate(counts) if c]
        if not bad:
            return 0, 0, None
        k = bad[0]
        s, j = divmod(k, g)
        local = int(self.first[s, j])
        first = {"iteration": start + k, "rank": rank, "rows": self.plan[j], "hidden": self.hidden,
                 "element": [local // self.hidden, local % self.hidden], "flat_index": local,
                 "got": float(self.got[s, j]), "nccl": float(self.want[s, j]), "elements_wrong": counts[k]}
        return len(bad), sum(counts), first


def merge_stress_ranks(per_rank: list[dict]) -> dict:
    """Combine the ranks' stress results of one backend and mode into one row."""
    done = min(r["iterations_done"] for r in per_rank)
    firsts = [r["first_mismatch"] for r in per_rank if r.get("first_mismatch")]
    first = min(firsts, key=lambda f: (f["iteration"], f["rank"])) if firsts else None
    by_rank = {str(i): r["mismatched_iterations"] for i, r in enumerate(per_rank) if r["mismatched_iterations"]}
    return {
        "iterations_done": done,
        "mismatched_iterations": max((r["mismatched_iterations"] for r in per_rank), default=0),
        "mismatched_elements": sum(r["mismatched_elements"] for r in per_rank),
        "mismatch_ranks": by_rank,
        "first_mismatch": first,
        "stopped_early": any(r.get("stopped_early") for r in per_rank),
        "group": per_rank[0].get("group"),
        "elapsed_s": round(max(r["elapsed_s"] for r in per_rank), 1),
        "status": "mismatch" if first else ("ok" if done == per_rank[0]["iterations_requested"] else "incomplete"),
    }


def describe_mismatch(backend: str, mode: str, f: dict) -> str:
    r, c = f["element"]
    return (f"{backend} {mode}: first mismatch at iteration {f['iteration']} on rank {f['rank']}, "
            f"[{f['rows']},{f['hidden']}] element [{r},{c}]: got {f['got']:g}, NCCL {f['nccl']:g} "
            f"({f['elements_wrong']} elements wrong in that iteration)")



def stress_one(backend: Backend, ctx, mode: str, sizes: list[int], wd: Watchdog) -> dict:
    """The stress run of one backend in one mode on this rank.  Iterations go in groups:
    the group's ops run back to back (fresh inputs drawn on the device, then the backend's
    allreduce; eager, or one CUDA graph of the whole group replayed), then NCCL reduces the
    same inputs in one call and one pass compares all of them on the device."""
    torch, dist, args = ctx.torch, ctx.dist, ctx.args
    hidden = ctx.hidden
    plan = group_plan(sizes, args.stress_repeat)
    g = len(plan)
    n_groups = -(-args.stress // g)  # N rounded up to whole groups
    n_iter = n_groups * g
    per_batch = max(1, args.stress_batch // g)
    label = f"stress {backend.name}{args.name_suffix} {mode}"
    torch.manual_seed(args.stress_seed * 1009 + ctx.rank)
    b = value_bound(ctx.world_size)
    its = torch.zeros(g, dtype=torch.int64, device=ctx.device)  # iteration number of each op
    steps = torch.arange(g, dtype=torch.int64, device=ctx.device)
    xs = [torch.zeros((n, hidden), dtype=torch.bfloat16, device=ctx.device) for n in plan]
    ring = MismatchRing(torch, per_batch, plan, hidden, ctx.device, torch.bfloat16)
    x_flat = torch.zeros(ring.numel, dtype=torch.bfloat16, device=ctx.device)
    out_flat = torch.zeros_like(x_flat)

    def group():  # the part under test
        outs = []
        for j, x in enumerate(xs):
            x.random_(-b, b + 1)
            outs.append(backend.stress_op(x, its[j]))
        return outs

    wd.beat(f"{label}: set-up")
    if mode == "eager":
        run_group = group
    elif ctx.is_cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                group()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        wd.beat(f"{label}: CUDA-graph capture")
        graph = torch.cuda.CUDAGraph()
        with backend.capture_ctx():
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_outs = group()
        torch.cuda.synchronize()

        def run_group():
            graph.replay()
            return static_outs
    else:
        replay = CpuReplay(group)

        def run_group():
            replay.replay()
            return replay.outs
    dist.barrier(group=ctx.cpu_group)
    res = {"iterations_requested": n_iter, "iterations_done": 0, "mismatched_iterations": 0,
           "mismatched_elements": 0, "first_mismatch": None, "stopped_early": False, "group": g}
    t0 = last = time.monotonic()
    done = 0
    while done < n_iter:
        nb = min(per_batch, (n_iter - done) // g)
        wd.beat(f"{label}: iterations {done}..{done + nb * g - 1}")
        for s in range(nb):
            start = done + s * g
            for i in range(start, start + g):
                backend.before_iteration(i)
            torch.add(steps, start, out=its)
            outs = run_group()
            torch.cat([x.view(-1) for x in xs], out=x_flat)
            torch.cat([o.reshape(-1) for o in outs], out=out_flat)
            dist.all_reduce(x_flat)  # NCCL (gloo in --device cpu) on the same inputs: the reference
            ring.record(s, out_flat, x_flat)
        n_bad, n_el, first = ring.read(nb, done, ctx.rank)
        done += nb * g
        res["iterations_done"] = done
        res["mismatched_iterations"] += n_bad
        res["mismatched_elements"] += n_el
        if first and res["first_mismatch"] is None:
            res["first_mismatch"] = first
        flag = torch.tensor([n_bad], dtype=torch.int64)
        dist.all_reduce(flag, group=ctx.cpu_group)  # every rank stops at the same batch
        now = time.monotonic()
        if int(flag) > 0:
            res["stopped_early"] = done < n_iter
            break
        if ctx.rank == 0 and (now - last >= args.stress_progress_s or done == n_iter):
            last = now
            print(f"[kernel_bench] {label}: {done}/{n_iter} iterations, 0 mismatches, "
                  f"{now - t0:.0f} s, {done / max(now - t0, 1e-9):.0f} it/s", flush=True)
    res["elapsed_s"] = round(time.monotonic() - t0, 2)
    return res


def run_stress(ctx, wanted: list[str], modes: list[str], log) -> dict:
    """Every backend in `wanted` (NCCL is the reference, not stressed), every mode."""
    torch, args = ctx.torch, ctx.args
    wd = Watchdog(args.stress_step_timeout, ctx.rank)
    rows_out: list[dict] = []
    absent: dict[str, str] = {}
    errors: dict[str, str] = {}
    for bname in wanted:
        label = bname + args.name_suffix
        cls = backend_class(bname, label, errors)
        if cls is None:
            continue
        if cls is NcclBackend or getattr(cls, "fused", False):
            absent[label] = ("the reference, not stressed" if cls is NcclBackend else
                             "not in the stress run (fused with RMSNorm; checked in the latency run)")
            continue
        if cls.stress_op is Backend.stress_op:
            absent[label] = "has no stress mode (checked in the latency run)"
            continue
        wd.beat(f"stress {label}: backend set-up")
        backend, bad = set_up_backend(ctx, cls, f"stress {label}", log, every_rank_traceback=True)
        if bad:
            (errors if bad[0] == "error" else absent)[label] = bad[1]
            continue
        reasons = gather(ctx, [backend.supports(n) for n in args.stress_sizes])
        sizes = [n for k, n in enumerate(args.stress_sizes) if not any(r[k] for r in reasons)]
        declined = [n for n in args.stress_sizes if n not in sizes]
        if not sizes:
            errors[label] = f"declined every stress size {args.stress_sizes}"
            backend.close()
            continue
        for mode in modes:
            log(f"stress {label} {mode}: {args.stress} iterations in groups of {len(sizes) * args.stress_repeat} "
                f"back-to-back ops (rows {sizes} x {ctx.hidden} bf16, {args.stress_repeat} each), every result "
                f"checked against NCCL")
            allr, exc = on_every_rank(ctx, functools.partial(stress_one, backend, ctx, mode, sizes, wd), sync=False)
            row = {"backend": label, "mode": mode, "sizes": sizes, "declined_sizes": declined,
                   "hidden": ctx.hidden, "iterations_requested": args.stress,
                   "graph_impl": ("cuda_graph" if ctx.is_cuda else "cpu_replay") if mode == "graph" else None}
            if exc:
                row.update(status="error", detail=exc, iterations_done=min(a.get("iterations_done", 0) for a in allr))
            else:
                row.update(merge_stress_ranks(allr))
                done = row["iterations_done"]
                row["it_per_s"] = round(done / row["elapsed_s"], 1) if row["elapsed_s"] else None
            rows_out.append(row)
            if row.get("first_mismatch"):
                log("MISMATCH " + describe_mismatch(label, mode, row["first_mismatch"]))
            log(f"stress {label} {mode}: {row['status']}: {row.get('iterations_done')}/{args.stress} iterations, "
                f"{row.get('mismatched_iterations', '-')} mismatched, {row.get('elapsed_s', '-')} s")
        backend.close()
        del backend
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    wd.beat("stress: writing the result")
    return {"stress": rows_out, "absent": absent, "errors": errors}


