"""Allreduce latency + correctness worker for `sglpatch regress --tier kernel`.

One process per GPU, started by torchrun (or anything that sets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT), with the sglpatch package importable (PYTHONPATH=src;
sglpatch's own dependencies, GitPython included, are not needed):

    PYTHONPATH=src torchrun --standalone --nproc-per-node 8 -m sglpatch.gpu.kernel.bench --out kb.json
    torchrun --standalone --nproc-per-node 2 src/sglpatch/gpu/kernel/bench.py --out kb.json

It imports only the standard library and torch; every optional library (sglang, sgl_kernel,
flashinfer, mscclpp) is imported inside its backend, guarded: a backend that does not import
is listed under "absent" with the reason (the backends: sglpatch.gpu.kernel.microbench).

For every backend present and every size in --sizes (rows x --hidden, bf16) it measures the
allreduce eager and captured in a CUDA graph (like SGLang's decode), and checks every output
against an exact reference: inputs are small integers, so their bf16 sum over <= 32 ranks is
exact (it is what NCCL returns) and any difference is a wrong result.  Fused backends
(allreduce + residual add + RMSNorm) are checked exactly on the residual output and to two
bf16 ulps on the normed one.

Timing: one sample = --inner allreduces back to back between two CUDA events, divided by
--inner; ranks are aligned on a CPU barrier before each sample; a sample's time is that of the
rank whose events show the least time (the last to arrive, which waited for no other).  The
report gives the median and p90 over --samples samples, in microseconds.  --device cpu runs the
same under gloo on CPU tensors (perf_counter; the CPU tests).

The result file is rewritten after every backend ("in_progress" names the one being measured),
so a launch that hangs or dies keeps what it measured; a step (set-up, one size and mode) that
makes no progress for --step-timeout s ends the run with a HANG line (exit 3).

After each backend's latency rows, --replay N: its op (a fused one: allreduce + add + RMSNorm)
captured in a CUDA graph and replayed N times back to back, each replay compared with NCCL on the
same inputs (sglpatch.gpu.kernel.microbench.replay; the hazard an end barrier guards).

--stress N instead: every non-NCCL backend, N allreduces eager and N as CUDA-graph replays, each
result compared exactly with NCCL (sglpatch.gpu.kernel.microbench.stress).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a file: our folder must not shadow stdlib modules; src must be importable
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(_here))))

import argparse
import datetime
import json
import re
import statistics
import time

from sglpatch.gpu.kernel.microbench.backends import ALL_BACKENDS, backend_class
from sglpatch.gpu.kernel.microbench.common import Ctx, Watchdog, gather, on_every_rank, percentile, set_up_backend
from sglpatch.gpu.kernel.microbench.hardware import cpu_info, hardware_info, nvlink_from_topo
from sglpatch.gpu.kernel.microbench.measure import measure
from sglpatch.gpu.kernel.microbench.replay import DEFAULT_REPLAYS, run_replay
from sglpatch.gpu.kernel.microbench.stress import (
    STRESS_DEFAULT_SIZES, STRESS_SCHEMA, MismatchRing, group_plan, merge_stress_ranks, parse_fault, run_stress, value_bound,
)

# the names tests and older callers import from here
__all__ = ["main", "percentile", "nvlink_from_topo", "merge_stress_ranks", "parse_fault", "value_bound",
           "group_plan", "MismatchRing", "ALL_BACKENDS"]

DEFAULT_SIZES = [1, 2, 3, 4, 8, 16, 64, 512, 2048]
DEFAULT_HIDDEN = 7168
SCHEMA = "sglpatch.kernel_bench/2"


def parse_sizes(text: str) -> list[int]:
    out = [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    if not out or any(n <= 0 for n in out):
        raise argparse.ArgumentTypeError(f"bad --sizes {text!r}: want positive integers like 1,2,3")
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kernel_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES, help="rows, comma separated")
    p.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN, help="columns of every tensor (bf16)")
    p.add_argument("--backends", default=",".join(ALL_BACKENDS), help="comma separated backend names")
    p.add_argument("--modes", default="eager,graph", help="eager and/or graph (CUDA-graph captured)")
    p.add_argument("--name-suffix", default="", help="appended to backend names, e.g. _p2p_off")
    p.add_argument("--samples", type=int, default=40, help="timed samples per size and mode")
    p.add_argument("--inner", type=int, default=10, help="ops back to back in one sample")
    p.add_argument("--warmup", type=int, default=5, help="untimed samples first")
    p.add_argument("--out", required=True, help="JSON result (written by rank 0)")
    p.add_argument("--scratch-dir", help="where backends may write (flashinfer's tuning); default: --out's folder")
    p.add_argument("--unset-env", default="", metavar="A,B",
                   help="variables removed from the environment before NCCL starts (also when a "
                   "sitecustomize set them): the 'NCCL defaults' launch")
    p.add_argument("--step-timeout", type=float, default=600.0,
                   help="seconds one step (a backend's set-up, one size and mode) may take before a HANG exit 3")
    p.add_argument("--custom-ar-max-bytes", type=int, default=64 * 1024 * 1024,
                   help="max_size given to SGLang's CustomAllreduce (so every size is measured)")
    p.add_argument("--pcie-ipc-rows", type=parse_sizes, default=None,
                   help="the row counts the server captures (P5's start-up line: its buckets), e.g. 3,6,12,24: "
                   "PCIe-IPC's tune_batches, its width the widest of them; each is measured too")
    p.add_argument("--pcie-ipc-max-rows", type=int, default=64,
                   help="without --pcie-ipc-rows: PCIe-IPC's width in rows (and its one bucket); larger sizes "
                   "are declined, as the server serves them on NCCL")
    p.add_argument("--b12x-max-bytes", type=int, default=8 * 1024 * 1024,
                   help="capacity of the b12x PCIe runtimes (flashinfer's default)")
    p.add_argument("--replay", type=int, default=DEFAULT_REPLAYS, metavar="N",
                   help="after each backend's latency rows: its op captured in a CUDA graph, replayed N times back to "
                   "back (fresh inputs drawn on the device, no host sync), every replay compared with NCCL; 0: off")
    p.add_argument("--replay-sizes", type=parse_sizes, default=STRESS_DEFAULT_SIZES,
                   help="rows of the replay check (default: decode/verify sizes)")
    s = p.add_argument_group("stress (--stress N replaces the latency run)")
    s.add_argument("--stress", type=int, default=0, metavar="N",
                   help="N allreduces per non-NCCL backend and mode, each compared exactly with NCCL")
    s.add_argument("--stress-sizes", type=parse_sizes, default=STRESS_DEFAULT_SIZES,
                   help="rows cycled through by the stress iterations (default: decode/verify sizes)")
    s.add_argument("--stress-repeat", type=int, default=8,
                   help="back-to-back ops of each size in a group (a group = every size, this many times)")
    s.add_argument("--stress-batch", type=int, default=1024, help="iterations between host syncs")
    s.add_argument("--stress-step-timeout", type=float, default=120.0,
                   help="seconds without progress (set-up, capture or one batch) before a HANG exit 3")
    s.add_argument("--stress-progress-s", type=float, default=10.0, help="seconds between progress lines")
    s.add_argument("--stress-seed", type=int, default=1234)
    s.add_argument("--selftest-fault", default="", metavar="ITER[:RANK[:ELEM]]",
                   help="where selftest_wrong / selftest_hang misbehave (default: N/2 on the last rank)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo on CPU tensors (the tests' mode; perf_counter, the graph mode replays)")
    return p


def write_doc(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def setup(args) -> tuple[Ctx, dict]:
    """Environment, process groups and the run context; returns (ctx, {name: value} unset)."""
    unset = {n: os.environ.pop(n) for n in [x.strip() for x in args.unset_env.split(",") if x.strip()]
             if n in os.environ}
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    is_cuda = args.device == "cuda"
    if is_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        try:
            dist.init_process_group("nccl", device_id=device)
        except TypeError:
            dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    ctx = Ctx()
    ctx.torch, ctx.dist, ctx.args = torch, dist, args
    ctx.rank, ctx.world_size, ctx.device = rank, world_size, device
    ctx.cpu_group = dist.new_group(backend="gloo")
    ctx.hidden, ctx.sizes = args.hidden, args.sizes
    ctx.all_rows = sorted(set(args.sizes) | set(args.stress_sizes))
    ctx.custom_ar_max_bytes = args.custom_ar_max_bytes
    ctx.is_cuda = is_cuda
    ctx.scratch_dir = args.scratch_dir or os.path.dirname(os.path.abspath(args.out))
    ctx.fault = parse_fault(args.selftest_fault, args.stress, world_size)
    return ctx, unset


def measure_row(ctx, backend, label: str, rows: int, mode: str, reason: str | None, wd) -> dict:
    args = ctx.args
    row = {"backend": label, "mode": mode, "rows": rows, "hidden": args.hidden, "bytes": rows * args.hidden * 2}
    if getattr(backend, "fused", False):
        row["fused"] = True
    if mode == "graph" and not ctx.is_cuda:
        row["graph_impl"] = "cpu_replay"
    if reason:
        row.update(status="declined", detail=reason)
        return row
    wd.beat(f"{label} [{rows},{args.hidden}] {mode}")
    def work():
        m = measure(backend, ctx, rows, mode, beat=wd.beat)
        return {"ok": m["ok"], "err": m["max_abs_err"], "detail": m["detail"], "times": m["times_us"]}

    allr, exc = on_every_rank(ctx, work, failed={"ok": False, "err": None, "detail": "", "times": []})
    if exc:
        row.update(status="error", detail=exc)
        return row
    n = min(len(a["times"]) for a in allr)
    # the rank that reached the sample last waits for nobody: its time is the collective's
    # latency without host skew from the CPU barrier
    per_sample = [min(a["times"][i] for a in allr) for i in range(n)]
    wrong = [(i, a) for i, a in enumerate(allr) if not a["ok"]]
    row.update(status="wrong" if wrong else "ok", median_us=round(statistics.median(per_sample), 2),
               p90_us=round(percentile(per_sample, 90), 2), min_us=round(min(per_sample), 2), samples=n,
               max_abs_err=max((a["err"] or 0.0) for a in allr),
               detail="; ".join(f"rank {i}: {a['detail']}" for i, a in wrong))
    return row


def run_latency(ctx, log, hw: dict, unset: dict) -> int:
    torch, args = ctx.torch, ctx.args
    t0 = time.time()
    wd = Watchdog(args.step_timeout, ctx.rank)
    warm = torch.ones(16, device=ctx.device)  # communicator creation outside every measurement
    ctx.dist.all_reduce(warm)
    if ctx.is_cuda:
        torch.cuda.synchronize()
    modes = [m for m in args.modes.split(",") if m]
    wanted = [b for b in args.backends.split(",") if b]
    doc = {"schema": SCHEMA, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": sys.argv, "name_suffix": args.name_suffix, "sizes": args.sizes, "hidden": args.hidden,
           "samples": args.samples, "inner": args.inner, "device": args.device, "hardware": hw,
           "env_unset": unset, "results": [], "replay": [], "absent": {}, "errors": {}, "done": [],
           "in_progress": None, "complete": False}

    def save():
        if ctx.rank == 0:
            doc["elapsed_s"] = round(time.time() - t0, 1)
            write_doc(args.out, doc)

    for bname in wanted:
        label = bname + args.name_suffix
        cls = backend_class(bname, label, doc["errors"])
        if cls is None:
            continue
        doc["in_progress"] = label
        save()
        wd.beat(f"{label}: set-up")
        backend, bad = set_up_backend(ctx, cls, label, log)
        if bad:
            doc["errors" if bad[0] == "error" else "absent"][label] = bad[1]
            doc["done"].append(label)
            continue
        log(f"{label}: measuring {args.sizes} x {args.hidden} bf16, modes {modes}"
            + (f" (+ rows {backend.extra_rows})" if getattr(backend, "extra_rows", None) else "")
            + (f" ({backend.how})" if getattr(backend, "how", None) else ""))
        if getattr(backend, "info", None):  # what the backend built (PCIe-IPC: width, buckets, tune)
            doc.setdefault("backend_info", {})[label] = backend.info
        for rows in sorted(set(args.sizes) | set(getattr(backend, "extra_rows", ()))):
            reasons = gather(ctx, backend.supports(rows))
            reason = next((r for r in reasons if r), None)
            for mode in modes:
                row = measure_row(ctx, backend, label, rows, mode, reason, wd)
                doc["results"].append(row)
                log(f"{label:>22} {mode:>5} {rows:>5}x{args.hidden}: {row.get('status')} "
                    f"median {row.get('median_us', '-')} us p90 {row.get('p90_us', '-')} us")
        if args.replay > 0:  # back-to-back graph replays against NCCL (microbench/replay.py)
            doc["replay"] += run_replay(ctx, backend, label, args.replay_sizes, args.replay, wd, log)
        wd.beat(f"{label}: close")
        backend.close()
        del backend
        if ctx.is_cuda:
            torch.cuda.empty_cache()
        doc["done"].append(label)
    doc["in_progress"], doc["complete"] = None, True
    save()
    log(f"wrote {args.out}")
    ctx.dist.barrier(group=ctx.cpu_group)
    ctx.dist.destroy_process_group()
    return 0


def run_stress_main(ctx, log, hw: dict) -> int:
    torch, dist, args = ctx.torch, ctx.dist, ctx.args
    t0 = time.time()
    if ctx.is_cuda:
        warm = torch.ones(16, device=ctx.device)
        dist.all_reduce(warm)
        torch.cuda.synchronize()
    modes = [m for m in args.modes.split(",") if m]
    wanted = [b for b in args.backends.split(",") if b]
    out = run_stress(ctx, wanted, modes, log)
    if ctx.rank == 0:
        doc = {"schema": STRESS_SCHEMA,
               "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "argv": sys.argv, "name_suffix": args.name_suffix, "iterations": args.stress,
               "sizes": args.stress_sizes, "hidden": args.hidden, "batch": args.stress_batch,
               "step_timeout_s": args.stress_step_timeout, "value_bound": value_bound(ctx.world_size),
               "reference": "nccl" if ctx.is_cuda else "gloo (cpu test mode)", "hardware": hw, **out,
               "elapsed_s": round(time.time() - t0, 1)}
        write_doc(args.out, doc)
        log(f"wrote {args.out}")
    dist.barrier(group=ctx.cpu_group)
    dist.destroy_process_group()
    return 0


def run(args) -> int:
    ctx, unset = setup(args)

    def log(msg):
        if ctx.rank == 0:
            print(f"[kernel_bench] {msg}", flush=True)

    if unset:
        log(f"removed from the environment before NCCL started: {sorted(unset)}")
    hw = None
    if ctx.rank == 0:
        hw = hardware_info(ctx.torch, ctx.world_size) if ctx.is_cuda else cpu_info(ctx.torch, ctx.world_size)
    if args.stress > 0:
        return run_stress_main(ctx, log, hw)
    return run_latency(ctx, log, hw, unset)


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.stress_batch <= 0 or args.stress_repeat <= 0:
        parser.error("--stress-batch and --stress-repeat must be positive")
    if args.samples <= 0 or args.inner <= 0:
        parser.error("--samples and --inner must be positive")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("kernel_bench: run me under torchrun (RANK/WORLD_SIZE unset), e.g.\n"
              "  PYTHONPATH=src torchrun --standalone --nproc-per-node 2 -m sglpatch.gpu.kernel.bench --out kb.json",
              file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
